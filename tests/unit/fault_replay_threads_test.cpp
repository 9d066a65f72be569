// Fault injection on real work under four threads: each replays a trace on a stream of its own
// that completes only when its thread says so, while faults of one kind are re-armed as they fire.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fault_harness.hpp"
#include "fault_replay_test_support.hpp"
#include "gmem/engine.hpp"
#include "gmem/error.hpp"
#include "gmem/sim_device.hpp"

namespace gmem {
namespace {

using testing::Fault;
using testing::fault_name;

using testing::kSanitized;
using testing::TraceProgram;

// Four threads replay a trace's allocations and frees, each on its own stream (one that
// completes its work only when its thread says so), lending blocks to the next thread's stream;
// a controller arms one failure of the kind at a time and re-arms it as soon as it fires.
TEST_P(FaultReplay, ThreadsReplayingTracesSurviveInjectedFailures) {
  const Fault fault = GetParam();
  constexpr int kThreads = 4;
  const TraceProgram& program = programs()[0];  // resnet50
  const std::size_t ops = std::min<std::size_t>(program.ops.size(), kSanitized ? 1500 : 6000);
  SimDeviceOptions o;
  o.capacity = kCapacity;
  o.streams_complete_immediately = false;
  SimulatedDevice device(o);
  std::optional<Engine> engine;
  engine.emplace(device);

  std::atomic<int> running{kThreads};
  std::atomic<std::uint64_t> ops_done{0};
  std::atomic<std::uint64_t> surfaced{0};
  std::mutex failures_mutex;
  std::vector<std::string> failures;
  auto fail = [&](const std::string& what) {
    std::lock_guard lock(failures_mutex);
    if (failures.size() < 8) failures.push_back(what);
  };
  std::vector<std::vector<void*>> leftovers(kThreads);

  auto worker = [&](int t) {
    const auto stream = static_cast<StreamId>(0x1000 + t);
    const auto next = static_cast<StreamId>(0x1000 + (t + 1) % kThreads);
    std::vector<void*> blocks(program.slots, nullptr);
    // A failed call is retried until it succeeds: the controller may arm the next failure
    // between a failure and its retry, so a few in a row are possible, each of the kind armed.
    auto attempt = [&](const char* what, auto&& f) {
      int faults = 0;
      for (int tries = 0;; ++tries) {
        try {
          f();
          return true;
        } catch (const OutOfMemoryError& e) {
          // Thread 1 lowers the limit for a moment: another thread's malloc may not fit under it.
          if (reads_as(e, fault)) {
            surfaced.fetch_add(1);
          } else if (e.info().reason != "limit" || tries > 100000) {
            fail(std::string(what) + " ran out of memory: " + e.what());
            return false;
          }
          std::this_thread::yield();
        } catch (const std::exception& e) {
          if (!reads_as(e, fault)) {
            fail(std::string(what) + " failed, but not as injected: " + e.what());
            return false;
          }
          surfaced.fetch_add(1);
          if (++faults > 20) {
            fail(std::string(what) + " kept failing: " + e.what());
            return false;
          }
        }
      }
    };
    for (std::size_t i = 0; i < ops; ++i) {
      const testing::TraceOp& op = program.ops[i];
      device.streams().submit_work(stream);  // a kernel: events recorded from now on wait for it
      bool ok;
      if (op.malloc) {
        ok = attempt("malloc", [&] { blocks[op.slot] = engine->malloc(op.size, stream); });
        if (ok && i % 7 == 0) engine->record_stream(blocks[op.slot], next);
      } else {
        ok = attempt("free", [&] { engine->free(blocks[op.slot]); });
        if (ok) blocks[op.slot] = nullptr;
      }
      if (!ok) break;
      ops_done.fetch_add(1);
      // This thread's GPU work caught up.
      if (i % 64 == 63) device.streams().complete_stream(stream);
      if (t == 0 && i % 1000 == 999) attempt("empty_cache", [&] { engine->empty_cache(); });
      if (t == 1 && i % 1000 == 499) {
        const auto reserved = static_cast<std::size_t>(engine->stats().reserved_bytes[kAllPools].current);
        attempt("set_memory_limit", [&] { engine->set_memory_limit(reserved / 2 / kGranule * kGranule + kGranule); });
        attempt("set_memory_limit(0)", [&] { engine->set_memory_limit(0); });
      }
    }
    for (void* p : blocks)
      if (p != nullptr) leftovers[t].push_back(p);
    running.fetch_sub(1);
  };

  std::uint64_t injected = 0;
  std::thread controller([&] {
    std::uint64_t armed_at = 0;
    std::uint64_t nth = 1;
    std::uint64_t fired_at_op = 0;
    bool fired = false;
    while (running.load() > 0) {
      const std::uint64_t calls = device.ledger().calls(fault.call);
      if (!fired && armed_at != 0 && calls >= armed_at) {
        fired = true;
        fired_at_op = ops_done.load();
        ++injected;
      }
      // The next failure once the threads have made some progress since the last one (a call
      // made a hundred times a malloc, like cuEventQuery, would otherwise fail every retry).
      if (armed_at == 0 || (fired && ops_done.load() >= fired_at_op + 32)) {
        fired = false;
        device.ledger().fail_call(fault.call, nth, fault.oom);
        armed_at = calls + nth;
        nth = nth >= 64 ? 1 : nth * 4;  // 1st, 4th, 16th, 64th call from now, and again
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (!fired && armed_at != 0 && device.ledger().calls(fault.call) >= armed_at) ++injected;
    device.ledger().fail_call(fault.call, 0);
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  controller.join();
  for (const std::string& f : failures) ADD_FAILURE() << fault_name(fault) << ": " << f;
  ASSERT_TRUE(failures.empty());

  engine->check_invariants();
  testing::expect_no_chunk_lost(device, *engine, "after the threads");
  device.streams().complete_all_streams();
  for (auto& blocks : leftovers)
    for (void* p : blocks) engine->free(p);
  engine->empty_cache();
  engine->check_invariants();
  EXPECT_EQ(engine->stats().allocated_bytes[kAllPools].current, 0);
  EXPECT_EQ(device.memory().chunk_bytes(), 0u);
  // One arena per stream.
  EXPECT_EQ(device.memory().reserved_address_bytes(), kThreads * kCapacity);
  engine.reset();
  EXPECT_EQ(device.memory().chunk_bytes(), 0u);
  EXPECT_EQ(device.memory().reserved_address_bytes(), 0u);
  EXPECT_EQ(device.streams().live_events(), 0u);

  Tally t;
  t.runs = 1;
  t.injected = injected;
  t.surfaced = surfaced.load();
  t.survived_runs = ::testing::Test::HasFailure() ? 0 : 1;
  t.ops = kThreads * ops;
  add_tally(g_thread_tally, fault_name(fault), t);
}

}  // namespace
}  // namespace gmem
