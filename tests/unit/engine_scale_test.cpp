// Concurrency at scale: 16 threads on 64 streams make a million mallocs, frees and
// record_streams on one engine (a GPU lagging behind a shared host clock), while another thread
// empties the cache, changes the memory limit and resets peaks, and another reads stats. Each
// thread keeps a model of its live blocks; at quiescent points (every thread parked at a barrier)
// the engine must agree with the models: allocated bytes and counts equal their totals, the same
// blocks live, none overlapping, reserved >= allocated, invariants intact.
//
// Under sanitizers (scripts/test's ASan and TSan builds) the run is 100k operations;
// GMEM_SCALE_OPS sets another total by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "fault_harness.hpp"
#include "gmem/engine.hpp"
#include "gmem/error.hpp"
#include "gmem/sim_device.hpp"

namespace gmem {
namespace {

constexpr std::size_t KiB = 1024, MiB = KiB * 1024, GiB = MiB * 1024;
constexpr int kThreads = 16;
constexpr int kStreamsPerThread = 4;  // 64 streams
constexpr std::size_t kMaxLive = 96;  // blocks per thread
constexpr int kQuiescentPoints = 10;

StreamId stream_id(int index) { return static_cast<StreamId>(0x10000 + 0x100 * index); }

struct Block {
  void* ptr;
  std::size_t size;  // rounded, as the engine counts it
};

// Sizes log-uniform within three bands: 70% small (slabs), 25% medium, 5% large (stitching).
std::size_t draw_size(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double band = unit(rng);
  double lo, hi;
  if (band < 0.70) lo = 1, hi = 128.0 * KiB;
  else if (band < 0.95) lo = 128.0 * KiB, hi = 4.0 * MiB;
  else lo = 4.0 * MiB, hi = 64.0 * MiB;
  return static_cast<std::size_t>(std::exp(std::log(lo) + unit(rng) * (std::log(hi) - std::log(lo))));
}

TEST(EngineScaleStress, SixteenThreadsSixtyFourStreamsAgainstAModel) {
  const std::uint64_t total_ops =
      testing::count_from_env("GMEM_SCALE_OPS", testing::kSanitized ? 100000 : 1000000);
  const std::uint64_t per_thread = total_ops / kThreads;
  const std::uint64_t phase = std::max<std::uint64_t>(1, per_thread / kQuiescentPoints);
  constexpr unsigned kSeed = 20261123;

  SimDeviceOptions o;
  o.lag_us = 200;  // events complete 200 us (of the shared host clock) after they are recorded
  SimulatedDevice device(o);
  Engine engine(device);

  std::vector<std::vector<Block>> models(kThreads);
  std::atomic<bool> stop{false};
  std::mutex failures_mutex;
  std::vector<std::string> failures;
  auto fail = [&](const std::string& what) {
    std::lock_guard lock(failures_mutex);
    if (failures.size() < 10) failures.push_back(what);
    stop = true;
  };
  std::atomic<std::uint64_t> mallocs{0}, frees{0}, records{0}, ooms{0}, empty_caches{0},
      limit_changes{0}, stat_reads{0}, checks{0};

  // At each quiescent point (every worker waiting here; the chaos and stats threads still run):
  // the engine against the models.
  auto check_models = [&]() noexcept {
    try {
      std::int64_t bytes = 0, count = 0;
      std::unordered_map<void*, std::size_t> expected;
      std::vector<Block> all;
      for (const auto& model : models)
        for (const Block& b : model) {
          bytes += static_cast<std::int64_t>(b.size);
          ++count;
          expected.emplace(b.ptr, b.size);
          all.push_back(b);
        }
      const MemoryStats s = engine.stats();
      if (s.allocated_bytes[kAllPools].current != bytes || s.allocation[kAllPools].current != count)
        fail("engine counts " + std::to_string(s.allocated_bytes[kAllPools].current) + " B in " +
             std::to_string(s.allocation[kAllPools].current) + " blocks, the models " +
             std::to_string(bytes) + " B in " + std::to_string(count));
      if (s.reserved_bytes[kAllPools].current < s.allocated_bytes[kAllPools].current) fail("reserved < allocated");
      std::size_t seen = 0;
      engine.for_each_block([&](const BlockInfo& info) {
        ++seen;
        auto it = expected.find(info.ptr);
        if (it == expected.end() || it->second != info.size) fail("a live block no model has");
      });
      if (seen != expected.size()) fail("the engine lists " + std::to_string(seen) + " blocks");
      std::sort(all.begin(), all.end(), [](const Block& a, const Block& b) { return a.ptr < b.ptr; });
      for (std::size_t i = 1; i < all.size(); ++i)
        if (static_cast<char*>(all[i - 1].ptr) + all[i - 1].size > static_cast<char*>(all[i].ptr))
          fail("two live blocks overlap");
      engine.check_invariants();
      ++checks;
    } catch (const std::exception& e) {
      fail(std::string("at a quiescent point: ") + e.what());
    }
  };
  std::barrier quiescent(kThreads, check_models);

  auto worker = [&](int t) {
    std::mt19937_64 rng(kSeed + static_cast<unsigned>(t));
    std::vector<Block>& live = models[t];
    for (std::uint64_t i = 0; i < per_thread; ++i) {
      if (!stop) {
        try {
          device.ledger().advance_host_time(1.0);
          const bool alloc = live.size() < 8 || (live.size() < kMaxLive && rng() % 2 == 0);
          if (alloc) {
            const std::size_t size = draw_size(rng);
            const StreamId stream = stream_id(t * kStreamsPerThread + static_cast<int>(rng() % kStreamsPerThread));
            try {
              void* p = engine.malloc(size, stream);
              live.push_back(Block{p, (size + kAlignment - 1) / kAlignment * kAlignment});
              ++mallocs;
              if (rng() % 16 == 0) {  // used on some other stream too, maybe another thread's
                engine.record_stream(p, stream_id(static_cast<int>(rng() % (kThreads * kStreamsPerThread))));
                ++records;
              }
            } catch (const OutOfMemoryError&) {
              ++ooms;  // under a lowered limit: the model stays as it was
            }
          } else {
            const std::size_t k = rng() % live.size();
            engine.free(live[k].ptr);
            live[k] = live.back();
            live.pop_back();
            ++frees;
          }
        } catch (const std::exception& e) {
          fail("thread " + std::to_string(t) + ", op " + std::to_string(i) + ": " + e.what());
        }
      }
      if ((i + 1) % phase == 0) quiescent.arrive_and_wait();
    }
  };

  std::atomic<int> workers_left{kThreads};
  std::thread chaos([&] {
    std::mt19937 rng(kSeed);
    const std::size_t limits[] = {0, 2 * GiB, 3 * GiB, 6 * GiB};
    while (workers_left > 0) {
      try {
        switch (rng() % 4) {
          case 0:
            engine.empty_cache();
            ++empty_caches;
            break;
          case 1:
          case 2:
            engine.set_memory_limit(limits[rng() % 4]);
            ++limit_changes;
            break;
          default:
            engine.reset_peak_stats();
        }
      } catch (const std::exception& e) {
        fail(std::string("chaos thread: ") + e.what());
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100 + rng() % 400));
    }
  });
  std::thread reader([&] {
    std::uint64_t n = 0;
    while (workers_left > 0) {
      const MemoryStats s = ++n % 64 == 0 ? engine.detailed_stats() : engine.stats();
      if (s.reserved_bytes[kAllPools].current < s.allocated_bytes[kAllPools].current ||
          s.allocated_bytes[kAllPools].current < 0 || s.allocation[kAllPools].current < 0)
        fail("stats read inconsistent");
      ++stat_reads;
      std::this_thread::yield();
    }
  });

  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      worker(t);
      --workers_left;
    });
  for (auto& th : threads) th.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  chaos.join();
  reader.join();
  for (const std::string& f : failures) ADD_FAILURE() << f;
  ASSERT_TRUE(failures.empty());

  // The end: everything freed, the cache emptied, nothing left with the device.
  engine.set_memory_limit(0);
  check_models();
  for (auto& model : models)
    for (const Block& b : model) engine.free(b.ptr);
  engine.empty_cache();
  engine.check_invariants();
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
  EXPECT_EQ(device.memory().chunk_bytes(), 0u);
  EXPECT_EQ(device.memory().reserved_address_bytes(), kThreads * kStreamsPerThread * o.capacity);
  EXPECT_GE(checks.load(), static_cast<std::uint64_t>(kQuiescentPoints));
  EXPECT_GT(ooms.load() + mallocs.load(), 0u);

  const MemoryStats s = engine.stats();
  std::printf(
      "scale run: %d threads, %d streams, %llu ops in %.2f s (%.0f ns/op): %llu mallocs, %llu frees, "
      "%llu record_streams, %llu OOMs under a lowered limit, %llu empty_cache, %llu limit changes, "
      "%llu stats reads, %llu quiescent checks; peak reserved %.2f GiB, device calls: %lld creates, "
      "%lld maps, %lld unmaps, %lld waits for streams\n",
      kThreads, kThreads * kStreamsPerThread, static_cast<unsigned long long>(per_thread * kThreads),
      seconds, seconds * 1e9 / static_cast<double>(per_thread * kThreads),
      static_cast<unsigned long long>(mallocs.load()), static_cast<unsigned long long>(frees.load()),
      static_cast<unsigned long long>(records.load()), static_cast<unsigned long long>(ooms.load()),
      static_cast<unsigned long long>(empty_caches.load()),
      static_cast<unsigned long long>(limit_changes.load()),
      static_cast<unsigned long long>(stat_reads.load()), static_cast<unsigned long long>(checks.load()),
      static_cast<double>(s.reserved_bytes[kAllPools].peak) / GiB,
      static_cast<long long>(s.num_device_alloc), static_cast<long long>(s.num_maps),
      static_cast<long long>(s.num_unmaps), static_cast<long long>(s.num_sync_all_streams));
}

}  // namespace
}  // namespace gmem
