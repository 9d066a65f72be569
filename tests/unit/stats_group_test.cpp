// StatsGroup: engines read as one device (a device's engine and its pools), with peaks of their
// sum rather than sums of their peaks.
#include <gtest/gtest.h>

#include <memory>
#include <thread>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/stats_group.hpp"

namespace gmem {
namespace {

constexpr std::int64_t MiB = std::int64_t{1} << 20;

MemoryStats read(const StatsGroup& group) {
  MemoryStats s;
  group.read(s);
  return s;
}

// What a graph pool does: it holds its blocks during the capture, the device engine holds
// others later. The sum never held both at once.
TEST(StatsGroup, PeaksAreThoseOfTheSumNotTheSumOfPeaks) {
  SimulatedDevice device;
  Engine engine(device);
  Engine pool(device, EngineOptions{.stable_pages = true});
  auto group = std::make_shared<StatsGroup>();
  engine.join_stats_group(group);
  pool.join_stats_group(group);

  void* in_pool = pool.malloc(40 * MiB);
  pool.free(in_pool);
  void* in_engine = engine.malloc(30 * MiB);
  MemoryStats sum = read(*group);
  EXPECT_EQ(sum.allocated_bytes[kAllPools].current, 30 * MiB);
  EXPECT_EQ(sum.allocated_bytes[kAllPools].peak, 40 * MiB);  // the engines' peaks add to 70
  EXPECT_EQ(sum.allocated_bytes[kLargePool].peak, 40 * MiB);
  EXPECT_EQ(sum.allocation[kAllPools].peak, 1);
  EXPECT_EQ(sum.allocation[kAllPools].allocated, 2);
  EXPECT_EQ(sum.allocation[kAllPools].freed, 1);
  EXPECT_EQ(sum.reserved_bytes[kAllPools].current,
            engine.stats().reserved_bytes[kAllPools].current +
                pool.stats().reserved_bytes[kAllPools].current);

  // Both at once: the sum's peak follows.
  void* again = pool.malloc(20 * MiB);
  sum = read(*group);
  EXPECT_EQ(sum.allocated_bytes[kAllPools].current, 50 * MiB);
  EXPECT_EQ(sum.allocated_bytes[kAllPools].peak, 50 * MiB);
  EXPECT_EQ(sum.active[kAllPools].peak, 2);

  // Small blocks count in the small pool, summed the same way.
  void* small = engine.malloc(4096);
  sum = read(*group);
  EXPECT_EQ(sum.allocated_bytes[kSmallPool].current, 4096);
  EXPECT_EQ(sum.reserved_bytes[kSmallPool].current,
            engine.stats().reserved_bytes[kSmallPool].current +
                pool.stats().reserved_bytes[kSmallPool].current);

  group->reset_peaks();
  for (void* p : {in_engine, small}) engine.free(p);
  pool.free(again);
  sum = read(*group);
  EXPECT_EQ(sum.allocated_bytes[kAllPools].current, 0);
  EXPECT_EQ(sum.allocated_bytes[kAllPools].peak, 50 * MiB + 4096);
  group->reset_accumulated();
  EXPECT_EQ(read(*group).allocation[kAllPools].allocated, 0);
  EXPECT_EQ(read(*group).allocated_bytes[kAllPools].current, 0);  // currents stay
}

// The first member brings its peak (the device's, until then); a member that goes takes what it
// still holds out of the sum, and leaves what it counted in the running totals.
TEST(StatsGroup, MembersJoinWithTheirPastAndLeaveWithWhatTheyHold) {
  SimulatedDevice device;
  Engine engine(device);
  void* early = engine.malloc(64 * MiB);
  engine.free(early);
  void* kept = engine.malloc(8 * MiB);

  auto group = std::make_shared<StatsGroup>();
  engine.join_stats_group(group);
  EXPECT_EQ(read(*group).allocated_bytes[kAllPools].current, 8 * MiB);
  EXPECT_EQ(read(*group).allocated_bytes[kAllPools].peak, 64 * MiB);
  EXPECT_EQ(read(*group).allocation[kAllPools].allocated, 2);
  {
    Engine pool(device, EngineOptions{.stable_pages = true});
    pool.join_stats_group(group);
    void* p = pool.malloc(6 * MiB);
    EXPECT_EQ(read(*group).reserved_bytes[kAllPools].current,
              engine.stats().reserved_bytes[kAllPools].current +
                  pool.stats().reserved_bytes[kAllPools].current);
    pool.free(p);
  }  // destroyed holding its chunks: they leave the sum with it
  const MemoryStats sum = read(*group);
  EXPECT_EQ(sum.reserved_bytes[kAllPools].current, engine.stats().reserved_bytes[kAllPools].current);
  EXPECT_EQ(sum.segment[kAllPools].current, engine.stats().segment[kAllPools].current);
  EXPECT_EQ(sum.allocation[kAllPools].allocated, 3);  // the pool's block still counted

  engine.join_stats_group(nullptr);  // leaves: the group no longer sees it
  void* later = engine.malloc(100 * MiB);
  EXPECT_EQ(read(*group).allocated_bytes[kAllPools].current, 0);
  EXPECT_EQ(read(*group).allocated_bytes[kAllPools].peak, 64 * MiB);
  for (void* p : {kept, later}) engine.free(p);
}

// Engines change the group from their own threads under their own locks: the sum stays exact.
TEST(StatsGroup, EnginesOnThreadsKeepTheSumExact) {
  SimulatedDevice device;
  auto group = std::make_shared<StatsGroup>();
  std::vector<std::unique_ptr<Engine>> engines;
  for (int i = 0; i < 4; ++i) {
    engines.push_back(std::make_unique<Engine>(device));
    engines.back()->join_stats_group(group);
  }
  std::vector<std::thread> threads;
  for (auto& engine : engines) {
    threads.emplace_back([&engine] {
      std::vector<void*> live;
      for (int i = 0; i < 2000; ++i) {
        live.push_back(engine->malloc(static_cast<std::size_t>(512 + (i % 7) * 70000)));
        if (live.size() > 5) {
          engine->free(live.front());
          live.erase(live.begin());
        }
      }
      for (void* p : live) engine->free(p);
    });
  }
  for (std::thread& t : threads) t.join();
  const MemoryStats sum = read(*group);
  std::int64_t reserved = 0, peak_bound = 0;
  for (auto& engine : engines) {
    reserved += engine->stats().reserved_bytes[kAllPools].current;
    peak_bound += engine->stats().allocated_bytes[kAllPools].peak;
  }
  EXPECT_EQ(sum.allocated_bytes[kAllPools].current, 0);
  EXPECT_EQ(sum.allocation[kAllPools].allocated, 4 * 2000);
  EXPECT_EQ(sum.allocation[kAllPools].freed, 4 * 2000);
  EXPECT_EQ(sum.reserved_bytes[kAllPools].current, reserved);
  EXPECT_GT(sum.allocated_bytes[kAllPools].peak, 0);
  EXPECT_LE(sum.allocated_bytes[kAllPools].peak, peak_bound);
}

TEST(StatsGroup, AddEngineSumsCountsButNotTheDevice) {
  MemoryStats a, b;
  a.allocated_bytes[kAllPools] = Stat{10, 30, 50, 40};
  b.allocated_bytes[kAllPools] = Stat{5, 7, 9, 4};
  a.num_maps = 3;
  b.num_maps = 4;
  a.device_call_us = b.device_call_us = 100;  // one Device: its driver time is counted once
  a.memory_limit = b.memory_limit = 1 << 30;
  a.largest_free_range = 6;
  b.largest_free_range = 9;
  a.device_total_bytes = b.device_total_bytes = 1000;
  a.device_free_bytes = b.device_free_bytes = 600;
  a.reserved_bytes[kAllPools].current = 100;
  b.reserved_bytes[kAllPools].current = 50;
  a.add_engine(b);
  EXPECT_EQ(a.allocated_bytes[kAllPools].current, 15);
  EXPECT_EQ(a.allocated_bytes[kAllPools].peak, 37);  // an upper bound: the group knows better
  EXPECT_EQ(a.allocated_bytes[kAllPools].allocated, 59);
  EXPECT_EQ(a.num_maps, 7);
  EXPECT_EQ(a.device_call_us, 100);
  EXPECT_EQ(a.memory_limit, 1 << 30);
  EXPECT_EQ(a.largest_free_range, 9);
  EXPECT_EQ(a.outside_bytes, 1000 - 600 - 150);
}

}  // namespace
}  // namespace gmem
