// A malloc that maps pages makes its device calls with the engine's lock released
// (Backing::map_missing): other threads' mallocs and frees from mapped pages go on meanwhile,
// a block that shares a page being mapped waits until it is, and a map that fails unlocked is
// rolled back as one made under the lock. A device whose maps wait at a gate holds a malloc
// in the middle of its calls. (Named *Thread*: scripts/test runs these under ThreadSanitizer.)
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "gmem/engine.hpp"
#include "gmem/error.hpp"
#include "gmem/sim_device.hpp"

namespace gmem {
namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr auto kPatience = std::chrono::seconds(20);  // far beyond any run, TSan's included

// A SimulatedDevice whose maps wait while the gate is shut; a held map can be made to fail.
class GatedDevice final : public Device {
 public:
  SimulatedDevice sim;

  void shut() {
    std::lock_guard lock(mutex_);
    shut_ = true;
  }
  // Opens the gate; with `fail`, the maps held there throw (the device is not asked).
  void open(bool fail = false) {
    std::lock_guard lock(mutex_);
    shut_ = false;
    fail_held_ = fail;
    changed_.notify_all();
  }
  void wait_until_a_map_is_held() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [this] { return held_ > 0; });
  }

  void map(DevicePtr va, std::size_t size, ChunkHandle chunk) override {
    {
      std::unique_lock lock(mutex_);
      if (shut_) {
        ++held_;
        changed_.notify_all();
        changed_.wait(lock, [this] { return !shut_; });
        --held_;
        if (fail_held_) throw DeviceError("cuMemMap", 2, "injected while held at the gate");
      }
    }
    sim.map(va, size, chunk);
  }

  std::size_t granularity() const override { return sim.granularity(); }
  DeviceMemInfo mem_info() override { return sim.mem_info(); }
  std::string name() const override { return "gated " + sim.name(); }
  DevicePtr reserve_address(std::size_t size, std::size_t alignment) override {
    return sim.reserve_address(size, alignment);
  }
  void release_address(DevicePtr base, std::size_t size) override { sim.release_address(base, size); }
  ChunkHandle create_chunk(std::size_t size) override { return sim.create_chunk(size); }
  void release_chunk(ChunkHandle chunk) override { sim.release_chunk(chunk); }
  void unmap(DevicePtr va, std::size_t size) override { sim.unmap(va, size); }
  void set_access(DevicePtr va, std::size_t size) override { sim.set_access(va, size); }
  EventHandle create_event() override { return sim.create_event(); }
  void destroy_event(EventHandle event) override { sim.destroy_event(event); }
  void record_event(EventHandle event, StreamId stream) override { sim.record_event(event, stream); }
  bool query_event(EventHandle event) override { return sim.query_event(event); }
  void synchronize_event(EventHandle event) override { sim.synchronize_event(event); }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool shut_ = false;
  bool fail_held_ = false;
  int held_ = 0;
};

std::size_t page_of(const void* p, std::size_t granularity) {
  return reinterpret_cast<std::uintptr_t>(p) / granularity;
}

TEST(EngineThreadUnlock, OtherThreadsAllocateAndFreeWhileAMallocMaps) {
  GatedDevice device;
  Engine engine(device);
  // Stream 1's pages are mapped before the gate shuts: a slab, and a range taken twice.
  void* keep = engine.malloc(4 * KiB, 1);
  engine.free(engine.malloc(1 * MiB, 1));
  const std::uint64_t maps_before = device.sim.calls(DeviceCall::map);

  device.shut();
  auto mapping = std::async(std::launch::async, [&] { return engine.malloc(8 * MiB, 0); });
  device.wait_until_a_map_is_held();
  auto other = std::async(std::launch::async, [&] {
    for (int i = 0; i < 1000; ++i) {
      void* small = engine.malloc(4 * KiB, 1);
      void* range = engine.malloc(1 * MiB, 1);
      engine.free(range);
      engine.free(small);
      if (i % 100 == 0) (void)engine.stats();
    }
  });
  const bool finished = other.wait_for(kPatience) == std::future_status::ready;
  const bool mapping_waited = mapping.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
  device.open();
  other.get();
  void* big = mapping.get();
  EXPECT_TRUE(finished) << "the other thread's mallocs waited for the mapping malloc's device calls";
  EXPECT_TRUE(mapping_waited);
  EXPECT_EQ(device.sim.calls(DeviceCall::map), maps_before + 4);  // the 8 MiB block's pages only
  engine.check_invariants();
  engine.free(big);
  engine.free(keep);
  engine.check_invariants();
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
}

TEST(EngineThreadUnlock, ABlockOnAPageInFlightWaitsUntilItIsMapped) {
  GatedDevice device;
  Engine engine(device);
  const std::size_t granularity = device.granularity();
  device.shut();
  auto mapping = std::async(std::launch::async, [&] { return engine.malloc(3 * MiB); });
  device.wait_until_a_map_is_held();
  // 200 KiB is a range (not a slab), placed right after the 3 MiB block: on its last page.
  auto neighbour = std::async(std::launch::async, [&] { return engine.malloc(200 * KiB); });
  const bool waited = neighbour.wait_for(std::chrono::milliseconds(200)) != std::future_status::ready;
  device.open();
  void* big = mapping.get();
  void* next = neighbour.get();
  EXPECT_TRUE(waited) << "a block was handed out on a page whose map had not been made";
  ASSERT_EQ(page_of(next, granularity),
            page_of(static_cast<char*>(big) + 3 * MiB - 1, granularity));
  EXPECT_EQ(device.sim.calls(DeviceCall::map), 2u);  // the neighbour's page was mapped once
  engine.check_invariants();
  engine.free(next);
  engine.free(big);
  engine.check_invariants();
}

TEST(EngineThreadUnlock, AMapFailingUnlockedIsRolledBackWhileOthersWork) {
  GatedDevice device;
  {
    Engine engine(device);
    void* keep = engine.malloc(4 * KiB, 1);
    device.shut();
    auto failing = std::async(std::launch::async, [&] { return engine.malloc(3 * MiB); });
    device.wait_until_a_map_is_held();
    auto neighbour = std::async(std::launch::async, [&] { return engine.malloc(200 * KiB); });
    auto other = std::async(std::launch::async, [&] {
      for (int i = 0; i < 1000; ++i) engine.free(engine.malloc(4 * KiB, 1));
    });
    const bool other_finished = other.wait_for(kPatience) == std::future_status::ready;
    device.open(/*fail=*/true);
    other.get();
    EXPECT_TRUE(other_finished);
    EXPECT_THROW(failing.get(), DeviceError);
    // The neighbour's page was the failed malloc's: it maps it itself once the failure landed.
    void* next = neighbour.get();
    engine.check_invariants();  // its page among them: a used page is mapped
    EXPECT_EQ(static_cast<std::int64_t>(device.sim.chunk_bytes()),
              engine.stats().reserved_bytes[kAllPools].current);
    engine.free(next);
    void* again = engine.malloc(3 * MiB);  // the engine works on
    engine.check_invariants();
    engine.free(again);
    engine.free(keep);
    engine.empty_cache();
    engine.check_invariants();
    EXPECT_EQ(device.sim.chunk_bytes(), 0u) << "chunks leaked";
  }
  EXPECT_EQ(device.sim.reserved_address_bytes(), 0u);
}

}  // namespace
}  // namespace gmem
