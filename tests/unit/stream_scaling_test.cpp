// Streams must cost nothing much: a program that allocates on a thousand streams (one per
// request in a server, say) must not pay a page table for each, and what users poll must not
// walk them. Host memory is counted by replacing global operator new in this test binary.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"

namespace {
std::atomic<std::int64_t> g_live_bytes{0};
std::atomic<std::int64_t> g_allocations{0};
}  // namespace

// Each block carries its size in a 16-byte header, so that delete can count it.
void* operator new(std::size_t size) {
  auto* base = static_cast<std::size_t*>(std::malloc(size + 16));
  if (base == nullptr) throw std::bad_alloc();
  *base = size;
  g_live_bytes += static_cast<std::int64_t>(size);
  ++g_allocations;
  return reinterpret_cast<char*>(base) + 16;
}
void operator delete(void* p) noexcept {
  if (p == nullptr) return;
  auto* base = reinterpret_cast<std::size_t*>(static_cast<char*>(p) - 16);
  g_live_bytes -= static_cast<std::int64_t>(*base);
  std::free(base);
}
void operator delete(void* p, std::size_t) noexcept { operator delete(p); }
void* operator new[](std::size_t size) { return operator new(size); }
void operator delete[](void* p) noexcept { operator delete(p); }
void operator delete[](void* p, std::size_t) noexcept { operator delete(p); }

namespace gmem {
namespace {

TEST(StreamScaling, AThousandStreamsCostLittleHostMemory) {
  SimulatedDevice device;  // 80 GiB: an arena spans as much virtual memory
  Engine engine(device);
  engine.free(engine.malloc(4096, 1));  // the engine's own one-time structures
  engine.free(engine.malloc(8u << 20, 1));
  const std::int64_t before = g_live_bytes.load();
  constexpr int kStreams = 1000;
  std::vector<void*> blocks;
  blocks.reserve(2 * kStreams);
  for (int s = 2; s < 2 + kStreams; ++s) {
    blocks.push_back(engine.malloc(4096, static_cast<StreamId>(s)));     // a slab
    blocks.push_back(engine.malloc(8u << 20, static_cast<StreamId>(s)));  // pages of its own
  }
  for (void* p : blocks) engine.free(p);
  const std::int64_t per_stream = (g_live_bytes.load() - before) / kStreams;
  EXPECT_LE(per_stream, 64 * 1024) << per_stream << " bytes of host memory per stream";
  RecordProperty("host_bytes_per_stream", static_cast<int>(per_stream));
  engine.check_invariants();
}

TEST(StreamScaling, PolledStatsDoNotWalkStreams) {
  SimulatedDevice device;
  Engine engine(device);
  for (int s = 0; s < 1000; ++s) engine.free(engine.malloc(4096, static_cast<StreamId>(s)));
  const std::int64_t allocations = g_allocations.load();
  std::int64_t sum = 0;
  for (int i = 0; i < 1000; ++i) sum += engine.stats().allocated_bytes[kAllPools].peak;
  EXPECT_EQ(g_allocations.load(), allocations) << "stats() allocated host memory";
  EXPECT_EQ(sum, 1000 * 4096);
  // A malloc on the thousandth stream finds its arena without a scan of the others: no
  // allocation, and no device call, once the stream has memory cached.
  void* p = engine.malloc(4096, 999);
  engine.free(p);
  const std::int64_t before = g_allocations.load();
  const std::uint64_t calls =
      device.ledger().calls(DeviceCall::map) + device.ledger().calls(DeviceCall::create_chunk);
  for (int i = 0; i < 1000; ++i) engine.free(engine.malloc(4096, 999));
  EXPECT_EQ(g_allocations.load(), before);
  EXPECT_EQ(
      device.ledger().calls(DeviceCall::map) + device.ledger().calls(DeviceCall::create_chunk),
      calls);
}

}  // namespace
}  // namespace gmem
