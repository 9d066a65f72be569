// PyTorch allocates on the main thread and frees on the autograd thread at the same time: two
// threads hammer one engine (run under ThreadSanitizer in CI).
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <random>
#include <thread>

#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"

namespace gmem {
namespace {

TEST(EngineThreadStress, MainThreadAllocatesWhileAutogradThreadFrees) {
  SimulatedDevice device;
  Engine engine(device);
  std::mutex mutex;
  std::condition_variable ready;
  std::deque<void*> handoff;
  bool done = false;
  constexpr int kOps = 20000;

  std::thread autograd([&] {
    std::mt19937 rng(2);
    for (;;) {
      void* p;
      {
        std::unique_lock lock(mutex);
        ready.wait(lock, [&] { return done || !handoff.empty(); });
        if (handoff.empty()) return;
        p = handoff.front();
        handoff.pop_front();
      }
      // The backward thread also allocates its own short-lived blocks.
      void* grad = engine.malloc(1 + rng() % (4 << 20));
      engine.free(grad);
      engine.free(p);
    }
  });
  std::mt19937 rng(1);
  for (int i = 0; i < kOps; ++i) {
    void* p = engine.malloc(1 + rng() % (8 << 20));
    if (i % 97 == 0) (void)engine.stats();  // readers too (a logger calling memory_stats())
    std::lock_guard lock(mutex);
    handoff.push_back(p);
    ready.notify_one();
  }
  {
    std::lock_guard lock(mutex);
    done = true;
  }
  ready.notify_one();
  autograd.join();
  engine.check_invariants();
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
  EXPECT_EQ(engine.stats().allocation[kAllPools].allocated, 2 * kOps);
}

// lagging: each stream finishes its work only when its thread says so (as a GPU that runs
// behind the host), so memory moving between the threads' streams waits on events.
void four_threads_churn(bool lagging) {
  SimDeviceOptions o;
  o.capacity = std::size_t{1} << 30;  // small enough that streams take each other's chunks
  o.streams_complete_immediately = !lagging;
  SimulatedDevice device(o);
  Engine engine(device);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&engine, &device, lagging, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::vector<void*> live;
      for (int i = 0; i < 5000; ++i) {
        if (lagging) {
          device.streams().submit_work(static_cast<StreamId>(t));
          if (i % 16 == 0) device.streams().complete_stream(static_cast<StreamId>(t));
        }
        if (!live.empty() && rng() % 2) {
          engine.free(live.back());
          live.pop_back();
        } else {
          live.push_back(engine.malloc(1 + rng() % (3 << 20), static_cast<StreamId>(t)));
        }
      }
      for (void* p : live) engine.free(p);
    });
  }
  for (auto& th : threads) th.join();
  engine.check_invariants();
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
}

TEST(EngineThreadStress, FourThreadsChurnOnTheirOwnStreams) { four_threads_churn(false); }
TEST(EngineThreadStress, FourThreadsChurnOnLaggingStreams) { four_threads_churn(true); }

}  // namespace
}  // namespace gmem
