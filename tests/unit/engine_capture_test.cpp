// The engine's behaviour on the simulated device (engine_test.cpp): CUDA graph captures and
// pools with stable pages.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"
#include "engine_test_support.hpp"
#include "sim_calls.hpp"

namespace gmem {
namespace {

TEST(Engine, CapturesMakeNoEventCallsAndHoldSharedFreesUntilTheyEnd) {
  // Under CUDA graph capture an event query invalidates the capture (gmem.torch's pools failed
  // so on the H100 when a block used on a captured side stream was freed inside the capture).
  SimulatedDevice device(device_of(1 * GiB, /*immediate=*/false));
  Engine engine(device);
  constexpr StreamId compute = 0, side = 5;
  void* p = engine.malloc(8 * MiB, compute);
  engine.record_stream(p, side);
  device.streams().submit_work(side);
  engine.set_capturing(true);
  const std::uint64_t before = event_calls(device);
  engine.free(p);
  void* q = engine.malloc(8 * MiB, compute);
  device.streams().complete_stream(side);  // caught up, but no event says so during the capture
  void* r = engine.malloc(8 * MiB, compute);
  EXPECT_NE(q, p);
  EXPECT_NE(r, p);
  EXPECT_EQ(event_calls(device), before) << "an event call during a capture";
  EXPECT_EQ(engine.stats().active_bytes[kAllPools].current, static_cast<std::int64_t>(24 * MiB));
  engine.check_invariants();
  engine.set_capturing(false);
  engine.free(q);
  engine.free(r);
  void* t = engine.malloc(MiB, compute);  // the held free gets its event on the side stream
  EXPECT_GT(event_calls(device), before);
  device.streams().complete_stream(side);
  void* u = engine.malloc(MiB, compute);  // ... which has completed: the block goes
  EXPECT_EQ(engine.stats().active_bytes[kAllPools].current, static_cast<std::int64_t>(2 * MiB));
  engine.free(t);
  engine.free(u);
  engine.check_invariants();
}

// During a capture no event is recorded or queried on the captured stream (it would be a node
// of the graph, and its query invalidates the capture: gpu/unmap_in_capture.cu). Memory that
// stream freed and is not known to be done with is then not taken: a malloc on another stream
// gets a new chunk, or fails as out of memory, with no event call. Other streams are waited for
// as ever.
TEST(Engine, CapturesTakeNoMemoryFreedOnTheCapturedStreamNotKnownToBeDone) {
  SimulatedDevice device(device_of(1 * GiB, /*immediate=*/false));
  Engine engine(device, EngineOptions{.memory_limit = 64 * MiB});
  constexpr StreamId captured = 1, other = 2, third = 3;
  void* a = engine.malloc(48 * MiB, captured);
  device.streams().submit_work(captured);
  engine.free(a);
  device.streams().set_capturing(captured, true);
  engine.set_capturing(true);
  const std::uint64_t before = event_calls(device);
  EXPECT_THROW(engine.malloc(48 * MiB, other), OutOfMemoryError);  // only by waiting for it
  void* small = engine.malloc(8 * MiB, other);                      // new chunks, within the limit
  EXPECT_EQ(event_calls(device), before) << "an event call on the captured stream";
  engine.check_invariants();

  // A stream not captured is waited for meanwhile: its freed memory serves another stream.
  engine.free(small);
  device.streams().submit_work(other);
  EXPECT_THROW(engine.malloc(56 * MiB, third), OutOfMemoryError);  // no: 48 MiB are the capture's
  void* from_other = engine.malloc(16 * MiB, third);  // 8 MiB of them once `other` is done
  EXPECT_GT(event_calls(device), before);
  engine.free(from_other);
  engine.check_invariants();

  device.streams().set_capturing(captured, false);
  engine.set_capturing(false);
  void* b = engine.malloc(48 * MiB, other);  // waits for the captured stream now
  engine.free(b);
  engine.check_invariants();
}

// The same for a page of the malloc's own stream whose chunk is busy at another page: it must be
// unmapped before its new chunk is mapped, which waits until the stream is done with it. While
// that stream is captured, that cannot be asked: the malloc fails, saying why, and nothing is
// left half done.
TEST(Engine, CapturesDoNotUnmapAPageTheirStreamMayStillUse) {
  SimulatedDevice device(device_of(1 * GiB, /*immediate=*/false));
  Engine engine(device, EngineOptions{.memory_limit = 8 * MiB});
  constexpr StreamId stream = 1;
  void* x = engine.malloc(2 * MiB, stream);
  void* fence = engine.malloc(2 * MiB, stream);  // x's range stays a hole of its own
  device.streams().submit_work(stream);                    // a kernel on x, not done
  engine.free(x);
  void* y = engine.malloc(4 * MiB, stream);  // beyond the fence: x's chunk mapped there too
  ASSERT_EQ(engine.stats().chunks_held, 3);
  const std::uint64_t maps = device.ledger().calls(DeviceCall::map);
  device.streams().set_capturing(stream, true);
  engine.set_capturing(true);
  const std::uint64_t events = event_calls(device);
  try {
    engine.malloc(2 * MiB, stream);  // x's range again: its page's chunk is busy in y
    FAIL() << "the page was unmapped while its stream may still use it";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA graph is being captured"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(event_calls(device), events);
  EXPECT_EQ(device.ledger().calls(DeviceCall::map), maps);
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, static_cast<std::int64_t>(6 * MiB));
  engine.check_invariants();
  device.streams().set_capturing(stream, false);
  engine.set_capturing(false);
  void* again = engine.malloc(2 * MiB, stream);  // waits for the stream, then remaps the page
  EXPECT_EQ(again, x);
  for (void* p : {again, y, fence}) engine.free(p);
  engine.check_invariants();
}

// A pool keeps its pages' chunks because graphs were captured against them, but only pages
// under a block live during a capture can be in a graph. cudagraph trees first run a function
// eagerly in the pool (a warm-up), then capture it: the warm-up's freed pages give their chunks
// to the capture's new pages, and pages the capture may use keep theirs.
TEST(Engine, APoolCapturesIntoTheChunksOfPagesNoCaptureUsed) {
  SimulatedDevice device(device_of(1 * GiB, /*immediate=*/false));
  Engine pool(device, EngineOptions{.stable_pages = true});
  constexpr StreamId stream = 7;
  pool.set_capturing(true);  // a warm-up: allocating to the pool, no capture
  std::vector<void*> kept, warm_up;  // the warm-up's blocks in holes of 8 MiB between kept ones
  for (int i = 0; i < 6; ++i) {
    warm_up.push_back(pool.malloc(8 * MiB, stream));
    kept.push_back(pool.malloc(2 * MiB, stream));  // live on: a graph may use them
  }
  device.streams().submit_work(stream);
  for (void* p : warm_up) pool.free(p);
  pool.set_capturing(false);
  device.streams().complete_stream(stream);
  const std::int64_t held = pool.stats().chunks_held;
  const std::uint64_t creates = device.ledger().calls(DeviceCall::create_chunk);

  pool.set_capturing(true);  // the capture: it begins after this (PyTorch's order)
  device.streams().set_capturing(stream, true);
  std::vector<void*> captured;  // too large for the warm-up's holes: on pages of their own
  for (int i = 0; i < 4; ++i) captured.push_back(pool.malloc(12 * MiB, stream));
  EXPECT_EQ(device.ledger().calls(DeviceCall::create_chunk), creates)
      << "chunks created for the capture";
  EXPECT_EQ(pool.stats().chunks_held, held);
  EXPECT_EQ(event_calls(device) > 0, true);
  pool.check_invariants();
  device.streams().set_capturing(stream, false);
  pool.set_capturing(false);

  // What the graph may use keeps its chunk: a second capture releases nothing of it.
  const std::uint64_t unmaps = device.ledger().calls(DeviceCall::unmap);
  for (void* p : captured) pool.free(p);
  device.streams().complete_stream(stream);
  pool.set_capturing(true);
  device.streams().set_capturing(stream, true);
  void* again = pool.malloc(12 * MiB, stream);
  EXPECT_EQ(device.ledger().calls(DeviceCall::unmap), unmaps)
      << "a page a graph may use was unmapped";
  device.streams().set_capturing(stream, false);
  pool.set_capturing(false);
  pool.free(again);
  for (void* p : kept) pool.free(p);
  pool.check_invariants();
}

// cudagraph trees put a pool back to the checkpoint of a recorded graph before recording the
// next: the blocks that graph left live are allocated again at their addresses (the first may
// have been freed since, and its memory used by blocks freed in turn), small ones included.
TEST(Engine, APoolPutsBlocksBackAtTheirAddresses) {
  SimulatedDevice device(device_of(1 * GiB));
  Engine pool(device, EngineOptions{.stable_pages = true});
  constexpr StreamId stream = 3;
  void* small = pool.malloc(4, stream);  // a graph's scalar output
  void* large = pool.malloc(6 * MiB + 1000, stream);
  void* kept = pool.malloc(3 * MiB, stream);
  pool.free(small);
  pool.free(large);
  void* later = pool.malloc(8 * MiB, stream);  // the next recording reuses what they held
  pool.free(later);
  EXPECT_EQ(pool.malloc_at(large, 6 * MiB + 1000), large);
  EXPECT_EQ(pool.malloc_at(small, 4), small);
  const BlockInfo info = pool.block_info(large);
  EXPECT_EQ(info.requested, 6 * MiB + 1000);
  EXPECT_EQ(info.stream, stream);
  EXPECT_EQ(pool.stats().allocated_bytes[kAllPools].current,
            static_cast<std::int64_t>(512 + (6 * MiB + 1024) + 3 * MiB));
  pool.check_invariants();
  // Where the range is not free, or not the pool's, nothing changes.
  for (auto [ptr, size] : {std::pair{static_cast<char*>(kept) + 512, std::size_t{512}},
                           std::pair{static_cast<char*>(large) - 512, std::size_t{1024}},
                           std::pair{static_cast<char*>(nullptr) + 4096, std::size_t{512}}}) {
    try {
      pool.malloc_at(ptr, size);
      ADD_FAILURE() << "malloc_at over a block in use or outside the pool succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("not free"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(pool.malloc_at(static_cast<char*>(kept) + 100, 8), Error);  // not aligned
  pool.check_invariants();
  for (void* p : {small, large, kept}) pool.free(p);
  pool.check_invariants();
  // A device's engine has slabs, whose slots cannot be promised back: it refuses.
  Engine engine(device);
  void* p = engine.malloc(4 * MiB);
  engine.free(p);
  EXPECT_THROW(engine.malloc_at(p, 4 * MiB), Error);
}

}  // namespace
}  // namespace gmem
