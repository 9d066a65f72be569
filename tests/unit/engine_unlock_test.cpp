// A malloc that maps pages makes its device calls with the engine's lock released
// (Backing::map_missing: creating chunks, unmapping its clashing pages, waiting for its stream,
// and the MapJob: its maps and set_access calls): other threads' mallocs and frees from mapped
// pages go on meanwhile, a block that shares a page of such a malloc waits until it is mapped,
// and a call that fails unlocked is rolled back as one made under the lock. A device whose calls
// of one kind wait at a gate holds a malloc in the middle of its calls. (Named *Thread*:
// scripts/test runs these under ThreadSanitizer.)
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/error.hpp"
#include "gmem/forwarding_device.hpp"
#include "gmem/sim_device.hpp"
#include "map_ahead_settle.hpp"

namespace gmem {
namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr auto kPatience = std::chrono::seconds(20);  // far beyond any run, TSan's included

// Holds GatedDevice's SimulatedDevice: as a base listed before ForwardingDevice it is constructed
// before ForwardingDevice takes a reference to it, and destroyed after.
struct OwnsSim {
  explicit OwnsSim(SimDeviceOptions options) : sim(std::move(options)) {}
  SimulatedDevice sim;
};

// A SimulatedDevice whose calls of one kind wait while the gate is shut; a held map can be made
// to fail.
class GatedDevice final : private OwnsSim, public ForwardingDevice {
 public:
  explicit GatedDevice(SimDeviceOptions options = {})
      : OwnsSim(std::move(options)), ForwardingDevice(sim) {}
  using OwnsSim::sim;  // the device behind the gate: its counts, failures and streams

  void shut(DeviceCall call = DeviceCall::map) {
    std::lock_guard lock(mutex_);
    gated_ = call;
    shut_ = true;
    spared_.clear();
  }
  // Shut for every thread but the caller and those that call spare_this_thread() (so, for the
  // engine's own threads: map-ahead's).
  void shut_to_others(DeviceCall call) {
    shut(call);
    spare_this_thread();
  }
  void spare_this_thread() {
    std::lock_guard lock(mutex_);
    spared_.push_back(std::this_thread::get_id());
  }
  // Opens the gate; with `fail`, the calls held there throw (the device is not asked).
  void open(bool fail = false) {
    std::lock_guard lock(mutex_);
    shut_ = false;
    fail_held_ = fail;
    changed_.notify_all();
  }
  // Every gated kind of call yields the thread first: other threads get into the windows where a
  // malloc has released the engine's lock.
  void yield_in_calls() { yield_ = true; }
  void wait_until_a_call_is_held() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [this] { return held_ > 0; });
  }
  bool wait_until_a_call_is_held(std::chrono::milliseconds patience) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, patience, [this] { return held_ > 0; });
  }

  void map(DevicePtr va, std::size_t size, ChunkHandle chunk) override {
    pass(DeviceCall::map);
    sim.map(va, size, chunk);
  }
  void set_access(DevicePtr va, std::size_t size) override {
    pass(DeviceCall::set_access);
    sim.set_access(va, size);
  }
  void unmap(DevicePtr va, std::size_t size) override {
    pass(DeviceCall::unmap);
    sim.unmap(va, size);
  }
  ChunkHandle create_chunk(std::size_t size) override {
    pass(DeviceCall::create_chunk);
    return sim.create_chunk(size);
  }
  void synchronize_event(EventHandle event) override {
    pass(DeviceCall::synchronize_event);
    sim.synchronize_event(event);
  }
  std::string name() const override { return "gated " + sim.name(); }

 private:
  void pass(DeviceCall call) {
    if (yield_) std::this_thread::yield();
    std::unique_lock lock(mutex_);
    if (!shut_ || call != gated_) return;
    if (std::find(spared_.begin(), spared_.end(), std::this_thread::get_id()) != spared_.end()) return;
    ++held_;
    changed_.notify_all();
    changed_.wait(lock, [this] { return !shut_; });
    --held_;
    if (fail_held_) throw DeviceError(device_call_name(call), 2, "injected while held at the gate");
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  DeviceCall gated_ = DeviceCall::map;
  bool shut_ = false;
  std::vector<std::thread::id> spared_;  // threads the gate lets through
  bool fail_held_ = false;
  int held_ = 0;
  std::atomic<bool> yield_{false};
};

std::size_t page_of(const void* p, std::size_t granularity) {
  return reinterpret_cast<std::uintptr_t>(p) / granularity;
}

// Holds `slow_malloc` at the gate for `gated` and checks that another thread's mallocs and frees
// from mapped pages (stream 1, its own arena) go on meanwhile; returns the slow block.
void* expect_others_go_on_while_held(GatedDevice& device, Engine& engine, DeviceCall gated,
                                     const std::function<void*()>& slow_malloc) {
  void* keep = engine.malloc(4 * KiB, 1);  // a slab, and a range taken twice: mapped
  engine.free(engine.malloc(1 * MiB, 1));
  const std::uint64_t gated_before = device.sim.ledger().calls(gated);
  const std::uint64_t maps_before = device.sim.ledger().calls(DeviceCall::map);

  device.shut(gated);
  auto slow = std::async(std::launch::async, slow_malloc);
  device.wait_until_a_call_is_held();
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
  const bool slow_held = slow.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
  const std::uint64_t maps_meanwhile = device.sim.ledger().calls(DeviceCall::map) - maps_before;
  device.open();
  other.get();
  void* block = slow.get();
  EXPECT_TRUE(finished) << "another thread's mallocs waited for a malloc's "
                        << device_call_name(gated);
  EXPECT_TRUE(slow_held);
  EXPECT_GT(device.sim.ledger().calls(gated), gated_before);
  if (gated == DeviceCall::map) EXPECT_EQ(maps_meanwhile, 0u);  // the other thread mapped nothing
  engine.check_invariants();
  engine.free(keep);
  return block;
}

// The calls of a malloc's slow path made without the lock (each test below holds one of them).
const auto kUnlockedCalls =
    ::testing::Values(DeviceCall::map, DeviceCall::set_access, DeviceCall::create_chunk);
std::string call_name(const ::testing::TestParamInfo<DeviceCall>& info) {
  return device_call_name(info.param);
}

class EngineThreadUnlock : public ::testing::TestWithParam<DeviceCall> {};

TEST_P(EngineThreadUnlock, OthersGoOnWhileAMallocMapsNewPages) {
  GatedDevice device;
  Engine engine(device);
  void* big = expect_others_go_on_while_held(device, engine, GetParam(),
                                             [&] { return engine.malloc(8 * MiB, 0); });
  engine.free(big);
  engine.check_invariants();
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
}

INSTANTIATE_TEST_SUITE_P(Calls, EngineThreadUnlock, kUnlockedCalls, call_name);

// A page whose chunk is busy through another alias is remapped: the clash unmap, and before it
// the wait for the page's last use on the stream, are made without the lock too.
void others_go_on_while_a_malloc_remaps(DeviceCall gated) {
  SimDeviceOptions o;
  o.streams_complete_immediately = false;  // work on stream 0 stays pending until waited for
  GatedDevice device(o);
  Engine engine(device);
  void* first = engine.malloc(2 * MiB);   // page 0
  void* second = engine.malloc(2 * MiB);  // page 1: keeps page 0's range from merging
  engine.free(first);
  device.sim.streams().submit_work(0);              // page 0's last use is still running
  // 32 MiB goes to the top of the free range; one of its pages steals page 0's chunk (an alias).
  void* big = engine.malloc(32 * MiB);
  ASSERT_EQ(device.sim.ledger().calls(DeviceCall::unmap), 0u);
  // Page 0 again: its chunk is busy through the big block, so it is remapped.
  void* again = expect_others_go_on_while_held(device, engine, gated,
                                               [&] { return engine.malloc(2 * MiB); });
  EXPECT_EQ(again, first);
  EXPECT_EQ(device.sim.ledger().calls(DeviceCall::unmap), 1u);
  for (void* p : {again, second, big}) engine.free(p);
  engine.check_invariants();
}

TEST(EngineThreadUnlockRemap, OthersGoOnWhileAMallocUnmapsAClashingPage) {
  others_go_on_while_a_malloc_remaps(DeviceCall::unmap);
}
TEST(EngineThreadUnlockRemap, OthersGoOnWhileAMallocWaitsForItsStream) {
  others_go_on_while_a_malloc_remaps(DeviceCall::synchronize_event);
}

// The map-ahead tests below: an engine with the thread on (and `limit` as its memory limit), and
// a marked step of two blocks, 6 * len MiB held at once.
EngineOptions with_map_ahead(std::size_t limit = 0) {
  EngineOptions options;
  options.map_ahead = true;
  options.memory_limit = limit;
  return options;
}
void two_block_step(Engine& engine, std::size_t len) {
  void* a = engine.malloc(len * 4 * MiB);
  void* b = engine.malloc(len * 2 * MiB);
  engine.free(a);
  engine.free(b);
  engine.mark_step();
}

// Steps marked, each beginning a new shape: from the third on, the engine's map-ahead thread
// maps the plan region early, as aliases of the chunks free as the step begins, each held busy
// while its batch is in flight. A malloc whose pages share such a chunk waits for the batch to
// land (a millisecond on a GPU) rather than remap them: no unmap, no new chunk.
TEST(EngineThreadUnlockMapAhead, AMallocWhoseChunkAnEarlyMapHoldsWaitsForIt) {
  GatedDevice device;
  Engine engine(device, with_map_ahead());
  engine.mark_step();
  for (const std::size_t len : {3, 7}) two_block_step(engine, len);  // 18 and 42 MiB at once
  const std::uint64_t unmaps = device.sim.ledger().calls(DeviceCall::unmap);
  const std::uint64_t creates = device.sim.ledger().calls(DeviceCall::create_chunk);
  device.shut(DeviceCall::map);
  // A third new shape: its first block takes 10 of the 21 mapped pages, and the thread books
  // the other 11 chunks for the region (21 pages wanted) and is held at its first map.
  void* first = engine.malloc(5 * 4 * MiB);
  if (!device.wait_until_a_call_is_held(std::chrono::milliseconds(5000))) {
    device.open();
    FAIL() << "no map-ahead batch was made early";
  }
  auto second = std::async(std::launch::async, [&] { return engine.malloc(5 * 2 * MiB); });
  const bool waited = second.wait_for(std::chrono::milliseconds(200)) != std::future_status::ready;
  EXPECT_EQ(device.sim.ledger().calls(DeviceCall::unmap), unmaps)
      << "a page was remapped meanwhile";
  device.open();
  void* block = second.get();
  EXPECT_TRUE(waited) << "the block did not wait for the early batch";
  EXPECT_EQ(device.sim.ledger().calls(DeviceCall::unmap), unmaps);
  EXPECT_EQ(device.sim.ledger().calls(DeviceCall::create_chunk), creates);
  EXPECT_GT(engine.stats().num_maps_ahead, 0);
  engine.free(block);
  engine.free(first);
  engine.mark_step();
  engine.check_invariants();
}

// At the memory limit, a malloc on another stream finds the chunks it could take held by an early
// batch in flight: it ends the round and waits for the batch to land rather than fail with free
// memory about to come back (in replays at the smallest cap, such OOMs moved the cap up to 1.127
// of peak, with the thread's timing).
TEST(EngineThreadUnlockMapAhead, AMallocAtTheLimitWaitsForTheChunksMapAheadHolds) {
  GatedDevice device;
  Engine engine(device, with_map_ahead(42 * MiB));  // the 21 chunks the records below hold at once
  engine.mark_step();
  for (const std::size_t len : {3, 7}) two_block_step(engine, len);
  device.shut(DeviceCall::map);
  // The third new shape's first block takes 10 pages; the thread books most of the other 11
  // chunks for the plan region and is held at its first map.
  void* first = engine.malloc(5 * 4 * MiB);
  if (!device.wait_until_a_call_is_held(std::chrono::milliseconds(5000))) {
    device.open();
    FAIL() << "no map-ahead batch was made early";
  }
  // Another stream's arena has no page mapped: 8 MiB needs four chunks, and none can be made.
  auto other = std::async(std::launch::async, [&] { return engine.malloc(8 * MiB, 1); });
  const bool waited = other.wait_for(std::chrono::milliseconds(200)) != std::future_status::ready;
  device.open();
  void* block = nullptr;
  try {
    block = other.get();
  } catch (const OutOfMemoryError& e) {
    ADD_FAILURE() << "OOM with the chunks an early batch held: " << e.what();
  }
  EXPECT_TRUE(waited) << "the malloc did not wait for the early batch";
  EXPECT_LE(engine.stats().reserved_bytes[kAllPools].current, 42 * static_cast<std::int64_t>(MiB));
  if (block) engine.free(block);
  engine.free(first);
  engine.mark_step();
  engine.check_invariants();
}

// A step that leaves its new plan while a batch mapped ahead for the plan's later blocks is in
// flight: the round ends at once, and the batch gives its pages' chunks back when it lands (kept,
// they stayed busy until some later step's block took the page, whatever the memory limit).
TEST(EngineThreadUnlockMapAhead, ARoundEndedWhileItsBatchIsInFlightGivesItsPagesBackOnLanding) {
  GatedDevice device;
  Engine engine(device, with_map_ahead());
  engine.mark_step();
  const auto step = [&](std::size_t len) {
    two_block_step(engine, len);
    let_map_ahead_settle(engine);
  };
  for (const std::size_t len : {3, 5, 4, 16}) step(len);
  for (const std::size_t len : {3, 5, 4}) step(len);
  const std::int64_t ahead_before = engine.stats().num_maps_ahead;
  // Length 16 is first laid out from its plan now: its first block, on this thread, starts the
  // round, whose first batch (the second block's pages, beyond those mapped early) is held.
  // The block is made on a thread of its own: when the batch took its turn first, the block's
  // own maps wait behind the batch's (mapping_calls_) until the gate opens.
  device.shut_to_others(DeviceCall::map);
  auto starting = std::async(std::launch::async, [&] {
    device.spare_this_thread();
    return engine.malloc(16 * 4 * MiB);
  });
  if (!device.wait_until_a_call_is_held(std::chrono::milliseconds(5000))) {
    device.open();
    starting.get();
    FAIL() << "no batch was mapped ahead for the plan";
  }
  // Not the plan's: the step leaves it (and then may wait for the batch, to remap a page).
  // Asked once the first block has been asked for (ordinal 0), whether or not it is mapped yet.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto leaving = std::async(std::launch::async, [&] {
    device.spare_this_thread();
    return engine.malloc(9 * MiB + 3 * KiB);
  });
  leaving.wait_for(std::chrono::milliseconds(200));
  device.open();
  void* first = starting.get();
  void* online = leaving.get();
  let_map_ahead_settle(engine);
  EXPECT_GT(engine.stats().num_maps_ahead, ahead_before);
  engine.check_invariants();  // every page mapped ahead is booked by a round that is under way
  engine.free(online);
  engine.free(first);
  engine.mark_step();
  engine.check_invariants();
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
}

// Held while it creates its chunks, maps them or sets their access: its pages are claimed
// throughout. A set-access failing undoes the maps already made (MapJob), with nothing left
// mapped that the books do not know of.
class EngineThreadUnlockNeighbour : public ::testing::TestWithParam<DeviceCall> {};

TEST_P(EngineThreadUnlockNeighbour, ABlockOnAPageInFlightWaitsUntilItIsMapped) {
  GatedDevice device;
  Engine engine(device);
  const std::size_t granularity = device.granularity();
  device.shut(GetParam());
  auto mapping = std::async(std::launch::async, [&] { return engine.malloc(3 * MiB); });
  device.wait_until_a_call_is_held();
  // 200 KiB is a range (not a slab), placed right after the 3 MiB block: on its last page.
  auto neighbour = std::async(std::launch::async, [&] { return engine.malloc(200 * KiB); });
  const bool waited = neighbour.wait_for(std::chrono::milliseconds(200)) != std::future_status::ready;
  device.open();
  void* big = mapping.get();
  void* next = neighbour.get();
  EXPECT_TRUE(waited) << "a block was handed out on a page whose map had not been made";
  ASSERT_EQ(page_of(next, granularity),
            page_of(static_cast<char*>(big) + 3 * MiB - 1, granularity));
  EXPECT_EQ(device.sim.ledger().calls(DeviceCall::map), 2u);  // the neighbour's page, mapped once
  engine.check_invariants();
  engine.free(next);
  engine.free(big);
  engine.check_invariants();
}

TEST_P(EngineThreadUnlockNeighbour, ACallFailingUnlockedIsRolledBackWhileOthersWork) {
  GatedDevice device;
  {
    Engine engine(device);
    void* keep = engine.malloc(4 * KiB, 1);
    device.shut(GetParam());
    auto failing = std::async(std::launch::async, [&] { return engine.malloc(3 * MiB); });
    device.wait_until_a_call_is_held();
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
    EXPECT_EQ(static_cast<std::int64_t>(device.sim.memory().chunk_bytes()),
              engine.stats().reserved_bytes[kAllPools].current);
    engine.free(next);
    void* again = engine.malloc(3 * MiB);  // the engine works on
    engine.check_invariants();
    engine.free(again);
    engine.free(keep);
    engine.empty_cache();
    engine.check_invariants();
    EXPECT_EQ(device.sim.memory().chunk_bytes(), 0u) << "chunks leaked";
  }
  EXPECT_EQ(device.sim.memory().reserved_address_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Calls, EngineThreadUnlockNeighbour, kUnlockedCalls, call_name);

}  // namespace
}  // namespace gmem

namespace gmem {
namespace {

// Four threads on one stream (their blocks share boundary pages) on a device small enough that
// pages are stitched, while maps, set_access calls and creates fail now and then and a fifth
// thread checks the invariants: every failure is reported and rolled back, nothing leaks.
TEST(EngineThreadUnlockStress, FourThreadsShareAStreamWhileDeviceCallsFail) {
  SimDeviceOptions o;
  o.capacity = 256 * MiB;
  GatedDevice device(o);
  device.yield_in_calls();
  {
    Engine engine(device);
    std::atomic<bool> done{false};
    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(static_cast<unsigned>(t) + 7);
        std::vector<void*> live;
        for (int i = 0; i < 3000; ++i) {
          if (t == 0 && i % 50 == 0) {
            const DeviceCall calls[] = {DeviceCall::map, DeviceCall::set_access, DeviceCall::create_chunk};
            device.sim.ledger().fail_call(calls[(i / 50) % 3], 1 + rng() % 8);
          }
          if (!live.empty() && (rng() % 2 || live.size() > 24)) {
            engine.free(live.back());
            live.pop_back();
            continue;
          }
          try {
            live.push_back(engine.malloc(200 * KiB + rng() % (3 * MiB)));
          } catch (const Error&) {  // injected, or out of memory
            failures.fetch_add(1, std::memory_order_relaxed);
          }
        }
        for (void* p : live) engine.free(p);
      });
    }
    std::thread checker([&] {
      while (!done.load()) engine.check_invariants();
    });
    for (auto& th : threads) th.join();
    done = true;
    checker.join();
    device.sim.ledger().fail_call(DeviceCall::map, 0);
    device.sim.ledger().fail_call(DeviceCall::set_access, 0);
    device.sim.ledger().fail_call(DeviceCall::create_chunk, 0);
    engine.check_invariants();
    EXPECT_GT(failures.load(), 0);
    // A failed job undoes its maps before another thread's unmap can land beside them.
    EXPECT_EQ(device.sim.memory().unsafe_alias_unmaps(), 0u);
    EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
    EXPECT_EQ(static_cast<std::int64_t>(device.sim.memory().chunk_bytes()),
              engine.stats().reserved_bytes[kAllPools].current);
    engine.free(engine.malloc(64 * MiB));  // works on
    engine.empty_cache();
    EXPECT_EQ(device.sim.memory().chunk_bytes(), 0u) << "chunks leaked";
  }
  EXPECT_EQ(device.sim.memory().reserved_address_bytes(), 0u);
}

// Four threads on two streams stitch at once, as gpu/gpu_tests.cu's
// ThreadsStitchAtOnceAndKeepTheirData does on an H100: chunks move between the streams' arenas
// (aliases), and a malloc whose page's chunk is busy elsewhere unmaps that alias without the
// lock. Such an unmap must never land inside another thread's MapJob, between its map and
// set_access of the same chunk: the H100's driver then broke the chunk (its next map failed with
// CUDA_ERROR_UNKNOWN), and the simulated device does the same.
TEST(EngineThreadUnlockStress, ThreadsOnTwoStreamsNeverUnmapAnAliasInsideAMapJob) {
  SimDeviceOptions o;
  o.capacity = 192 * MiB;
  GatedDevice device(o);
  device.yield_in_calls();
  {
    Engine engine(device);
    std::atomic<int> errors{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        const StreamId stream = static_cast<StreamId>(t % 2);
        std::mt19937 rng(static_cast<unsigned>(t) + 1);
        std::vector<void*> live;
        for (int i = 0; i < 2000; ++i) {
          if (live.size() >= 10) {
            engine.free(live.front());
            live.erase(live.begin());
          }
          try {
            live.push_back(engine.malloc(200 * KiB + rng() % (4 * MiB), stream));
          } catch (const Error& e) {
            if (errors.fetch_add(1) == 0) ADD_FAILURE() << e.what();
          }
        }
        for (void* p : live) engine.free(p);
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(errors.load(), 0);
    EXPECT_EQ(device.sim.memory().unsafe_alias_unmaps(), 0u);
    EXPECT_GT(engine.stats().num_stitches, 0);
    EXPECT_GT(device.sim.ledger().calls(DeviceCall::unmap), 0u);
    engine.check_invariants();
    EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
  }
  EXPECT_EQ(device.sim.memory().reserved_address_bytes(), 0u);
}

}  // namespace
}  // namespace gmem
