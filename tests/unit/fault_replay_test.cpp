// Fault injection on real work: the captured traces of tests/data replayed through an Engine on
// a SimulatedDevice whose GPU lags 2 ms behind a host clock that follows the trace, while one
// kind of device call fails at its 1st, 3rd, 10th, 30th, 100th, 300th, 1000th call and every
// 1000th after (one failure armed at a time). Blocks are also used on side streams (record_stream), the cache is emptied, the limit
// lowered and a malloc made to run out of memory along the way, so that every device call the
// engine makes is reached: event calls, unmaps and releases included.
//
// After each failure: the error names the failed call (an OutOfMemoryError for the device's
// out-of-memory variant of cuMemCreate), invariants hold, the device's chunks are exactly what
// the engine counts as reserved, its address ranges one arena per stream that allocated, and the
// operation succeeds when retried once. At the end everything is freed, empty_cache() gives every
// chunk back, and the engine's destruction leaves no chunk, range or event behind.
//
// Faults during ~Engine (which cannot report them) are checked apart: what leaks is what the
// failed call held, nothing more. And the same under four threads, streams completing only when
// their thread says so (submit_work / complete_stream), faults re-armed as they fire.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fault_harness.hpp"
#include "gmem/engine.hpp"
#include "gmem/error.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/trace.hpp"

namespace gmem {
namespace {

using testing::all_faults;
using testing::Fault;
using testing::fault_name;

using testing::compile_trace;
using testing::kSanitized;
using testing::TraceProgram;

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t kGranule = 2 * MiB;
constexpr std::size_t kCapacity = std::size_t{80} << 30;  // also each arena's virtual size
constexpr StreamId kSide1 = 0x51de1, kSide2 = 0x51de2;

std::string data_file(const std::string& name) { return std::string(GMEM_TEST_DATA) + "/" + name; }


// Figures for README: per fault kind, summed over traces (printed at the end of the run).
struct Tally {
  std::uint64_t runs = 0, injected = 0, surfaced = 0, survived_runs = 0, ops = 0;
  std::uint64_t waits = 0, retries = 0;  // the engine's num_sync_all_streams, num_alloc_retries
  Tally& operator+=(const Tally& t) {
    runs += t.runs;
    injected += t.injected;
    surfaced += t.surfaced;
    survived_runs += t.survived_runs;
    ops += t.ops;
    waits += t.waits;
    retries += t.retries;
    return *this;
  }
};
std::mutex g_tally_mutex;
std::map<std::string, Tally> g_replay_tally, g_tight_tally, g_thread_tally;

class PrintTallies : public ::testing::Environment {
 public:
  void TearDown() override {
    auto print = [](const char* title, const std::map<std::string, Tally>& tally) {
      if (tally.empty()) return;
      std::printf("\n%s\n%-24s %6s %9s %9s %9s %10s %8s %8s\n", title, "fault", "runs", "injected",
                  "surfaced", "survived", "ops", "waits", "retries");
      auto row = [](const char* name, const Tally& t) {
        std::printf("%-24s %6llu %9llu %9llu %9llu %10llu %8llu %8llu\n", name,
                    static_cast<unsigned long long>(t.runs), static_cast<unsigned long long>(t.injected),
                    static_cast<unsigned long long>(t.surfaced),
                    static_cast<unsigned long long>(t.survived_runs), static_cast<unsigned long long>(t.ops),
                    static_cast<unsigned long long>(t.waits), static_cast<unsigned long long>(t.retries));
      };
      Tally sum;
      for (const auto& [name, t] : tally) {
        row(name.c_str(), t);
        sum += t;
      }
      row("total", sum);
    };
    std::lock_guard lock(g_tally_mutex);
    print("fault injection on trace replays (injected: failures fired; surfaced: reported to the caller)",
          g_replay_tally);
    print("fault injection on tight devices (two_streams 832 MiB, resnet50 5.6 GiB, gpt2 13 GiB, llama 11.25 GiB)",
          g_tight_tally);
    print("fault injection under 4 threads", g_thread_tally);
  }
};
const auto* const g_print = ::testing::AddGlobalTestEnvironment(new PrintTallies);

// A check that stops the run with a message saying where it stood.
struct Violation : std::logic_error {
  using std::logic_error::logic_error;
};
void require(bool ok, const std::string& what) {
  if (!ok) throw Violation(what);
}

// The call numbers at which a failure is armed, one after the other: the next is armed once the
// one before has fired. After the last, one every kEvery calls.
constexpr std::uint64_t kPoints[] = {1, 3, 10, 30, 100, 300, 1000};
constexpr std::uint64_t kEvery = 1000;
std::uint64_t point_call(std::size_t point) {
  constexpr std::size_t n = std::size(kPoints);
  return point < n ? kPoints[point] : kPoints[n - 1] + (point - n + 1) * kEvery;
}

// Whether `e` is what the injected fault should look like to the caller.
bool reads_as(const std::exception& e, const Fault& f) {
  if (f.oom) {
    const auto* oom = dynamic_cast<const OutOfMemoryError*>(&e);
    return oom != nullptr && oom->info().reason == "device";
  }
  const auto* de = dynamic_cast<const DeviceError*>(&e);
  const std::string name = device_call_name(f.call);
  return de != nullptr && de->call() == name && std::string(e.what()).find(name) != std::string::npos &&
         std::string(e.what()).find("injected failure") != std::string::npos;
}

class FaultyReplay {
 public:
  // `capacity`: the device's memory.
  FaultyReplay(const TraceProgram& program, Fault fault, std::size_t extra_checks,
               std::size_t capacity = kCapacity)
      : program_(program), fault_(fault), check_every_(extra_checks), capacity_(capacity) {
    SimDeviceOptions o;
    o.capacity = capacity;
    o.lag_us = 2000;  // the GPU runs 2 ms behind the host, whose clock follows the trace
    device_.emplace(o);
  }

  Tally run() {
    Tally t;
    t.runs = 1;
    arm(0);
    // The constructor asks the device its size (cuMemGetInfo): it may fail there too.
    // Each arena a whole 80 GiB of address space, on a small device too: one per stream.
    EngineOptions eo;
    eo.address_space = kCapacity;
    try {
      engine_.emplace(*device_, eo);
    } catch (const Error& e) {
      on_fault(e, "Engine()");
      engine_.emplace(*device_, eo);
    }
    after_op();
    std::vector<void*> blocks(program_.slots, nullptr);
    const auto& ops = program_.ops;
    for (i_ = 0; i_ < ops.size(); ++i_) {
      const testing::TraceOp& op = ops[i_];
      device_->advance_host_time(op.host_advance_us);
      if (op.malloc) {
        blocks[op.slot] = malloc_retrying(op.size, op.stream);
        // Some blocks are used on side streams too: their frees wait for events there.
        if (i_ % 5 == 0) engine_->record_stream(blocks[op.slot], kSide1);
        // A block used on two side streams gets two events when freed (a failed destroy of the
        // second once left the first, destroyed, pending: FailedEventDestroyLeavesNoDestroyedEvent).
        if (i_ % 11 == 0) engine_->record_stream(blocks[op.slot], kSide2);
      } else {
        free_retrying(blocks[op.slot]);
        blocks[op.slot] = nullptr;
      }
      if (i_ % 1500 == 1499) retrying("empty_cache", [&] { engine_->empty_cache(); });
      // (On a tight device the probe could run out for real, which reads as the device.)
      if (i_ % 2500 == 1249 && capacity_ == kCapacity) oom_probe(op.stream);
      if (i_ % 3000 == 2999) squeeze();
      if (check_every_ && i_ % check_every_ == 0) check("periodic check");
      after_op();
    }
    // Everything freed and the cache emptied: the device holds nothing for gmem any more.
    for (void* p : blocks)
      if (p != nullptr) free_retrying(p);
    retrying("empty_cache at the end", [&] { engine_->empty_cache(); });
    check("after freeing everything");
    require(engine_->stats().allocated_bytes[kAllPools].current == 0, where("allocated after freeing all"));
    require(device_->chunk_bytes() == 0, where("chunks left after empty_cache: " +
                                              std::to_string(device_->chunk_bytes())));
    t.injected = fired_points();
    t.waits = static_cast<std::uint64_t>(engine_->stats().num_sync_all_streams);
    t.retries = static_cast<std::uint64_t>(engine_->stats().num_alloc_retries);
    device_->fail_call(fault_.call, 0);  // faults at destruction: FaultAtDestruction below
    engine_.reset();
    require(device_->chunk_bytes() == 0, where("chunks left after ~Engine"));
    require(device_->reserved_address_bytes() == 0, where("address ranges left after ~Engine"));
    require(device_->live_events() == 0, where("events left after ~Engine: " +
                                              std::to_string(device_->live_events())));
    t.surfaced = surfaced_;
    t.ops = ops.size();
    t.survived_runs = 1;
    return t;
  }

  std::string where(const std::string& what) const {
    return program_.name + ", " + fault_name(fault_) + " failing at call " +
           std::to_string(armed_at_) + " (point " + std::to_string(point_) + "), op " +
           std::to_string(i_) + ": " + what;
  }

 private:
  void arm(std::size_t point) {
    point_ = point;
    const std::uint64_t calls = device_->calls(fault_.call);
    armed_at_ = std::max(point_call(point), calls + 1);
    device_->fail_call(fault_.call, armed_at_ - calls, fault_.oom);
  }
  bool armed_fired() const { return armed_at_ != ~std::uint64_t{0} && device_->calls(fault_.call) >= armed_at_; }
  std::uint64_t fired_points() const { return point_ + (armed_fired() ? 1 : 0); }
  // Once the armed failure has fired (and been dealt with), arm the next.
  void after_op() {
    if (armed_fired()) arm(point_ + 1);
  }

  void check(const std::string& what) {
    try {
      engine_->check_invariants();
    } catch (const std::logic_error& e) {
      throw Violation(where(what + ": " + e.what()));
    }
    const auto reserved = engine_->stats().reserved_bytes[kAllPools].current;
    require(static_cast<std::int64_t>(device_->chunk_bytes()) == reserved,
            where(what + ": device holds " + std::to_string(device_->chunk_bytes()) +
                  " B of chunks, the engine counts " + std::to_string(reserved)));
    // One arena (a whole device of address space) per stream that allocated; a stream whose
    // first malloc failed after its arena was reserved keeps it too.
    const std::size_t ranges = device_->reserved_address_bytes();
    require(ranges % kCapacity == 0 && ranges / kCapacity >= streams_served_.size() &&
                ranges / kCapacity <= streams_tried_.size(),
            where(what + ": " + std::to_string(ranges / kCapacity) + " arenas reserved for " +
                  std::to_string(streams_served_.size()) + " streams served (" +
                  std::to_string(streams_tried_.size()) + " tried)"));
  }

  void on_fault(const std::exception& e, const std::string& op) {
    require(fired_points() > points_at_last_error_,
            where(op + " failed with no new injected failure behind it: " + e.what()));
    require(reads_as(e, fault_), where(op + " failed, but not as injected: " + e.what()));
    points_at_last_error_ = fired_points();
    ++surfaced_;
    if (engine_) check("after the failure of " + op);
  }

  template <class F>
  void retrying(const std::string& op, F&& f) {
    try {
      f();
    } catch (const Error& e) {
      on_fault(e, op);
      try {
        f();
      } catch (const std::exception& again) {
        throw Violation(where(op + " failed again when retried: " + again.what()));
      }
    }
  }

  void* malloc_retrying(std::size_t size, StreamId stream) {
    void* p = nullptr;
    streams_tried_.insert(stream);
    retrying("malloc(" + std::to_string(size) + ")", [&] { p = engine_->malloc(size, stream); });
    streams_served_.insert(stream);
    return p;
  }
  void free_retrying(void* p) { retrying("free", [&] { engine_->free(p); }); }

  // A malloc bound to run out of memory under a limit just above what is held: the pressure
  // path (waits for streams, pending frees, spare slabs) and the OOM report (cuMemGetInfo).
  void oom_probe(StreamId stream) {
    const MemoryStats s = engine_->stats();
    const auto limit = static_cast<std::size_t>(s.reserved_bytes[kAllPools].current) + 8 * kGranule;
    retrying("set_memory_limit", [&] { engine_->set_memory_limit(limit); });
    const std::size_t size = limit - static_cast<std::size_t>(s.allocated_bytes[kAllPools].current) + 32 * MiB;
    try {
      void* p = engine_->malloc(size, stream);
      engine_->free(p);
      throw Violation(where("a malloc of " + std::to_string(size) + " B fit under a limit of " +
                            std::to_string(limit)));
    } catch (const OutOfMemoryError& e) {
      if (e.info().reason == "device") on_fault(e, "malloc under pressure");
      else check("after an OOM under pressure");
    } catch (const DeviceError& e) {
      on_fault(e, "malloc under pressure");
    }
    retrying("set_memory_limit(0)", [&] { engine_->set_memory_limit(0); });
  }

  // The limit lowered below what is held (trimming: unmaps, releases, waits), then lifted.
  void squeeze() {
    const MemoryStats s = engine_->stats();
    const auto allocated = static_cast<std::size_t>(s.allocated_bytes[kAllPools].current);
    const auto reserved = static_cast<std::size_t>(s.reserved_bytes[kAllPools].current);
    const std::size_t target = std::max((allocated + kGranule - 1) / kGranule * kGranule + kGranule,
                                        reserved / 4 * 3 / kGranule * kGranule);
    try {
      engine_->set_memory_limit(target);
    } catch (const Error& e) {
      on_fault(e, "set_memory_limit(" + std::to_string(target) + ")");
    }
    retrying("set_memory_limit(0)", [&] { engine_->set_memory_limit(0); });
  }

  const TraceProgram& program_;
  const Fault fault_;
  const std::size_t check_every_;
  const std::size_t capacity_;
  std::optional<SimulatedDevice> device_;
  std::optional<Engine> engine_;  // destroyed before the device
  std::size_t point_ = 0;
  std::uint64_t armed_at_ = 0;
  std::uint64_t points_at_last_error_ = 0;
  std::uint64_t surfaced_ = 0;
  std::size_t i_ = 0;
  std::set<StreamId> streams_tried_, streams_served_;
};

// The traces, cut to keep the suite quick (the sanitizer builds take a shorter cut).
struct TraceCut {
  const char* file;
  std::size_t max_ops;
};
const TraceCut kTraces[] = {
    {"resnet50.trace.csv.gz", 0},                   // 6.7k mallocs and frees, one stream
    {"gpt2.trace.csv.gz", 0},                       // 13.6k, one stream
    {"two_streams.trace.csv.gz", 0},                // two streams taking memory from each other
    {"llama_ckpt_varlen.trace.csv.gz", 0},          // 84k, lengths taking turns: stitching, unmaps
};

const std::vector<TraceProgram>& programs() {
  static const std::vector<TraceProgram> all = [] {
    std::vector<TraceProgram> out;
    for (const TraceCut& cut : kTraces) {
      std::size_t max_ops = cut.max_ops;
      if (kSanitized) max_ops = max_ops == 0 ? 6000 : std::min<std::size_t>(max_ops, 6000);
      out.push_back(compile_trace(trace::read_trace(data_file(cut.file)), max_ops));
    }
    return out;
  }();
  return all;
}

void add_tally(std::map<std::string, Tally>& tally, const std::string& name, const Tally& t) {
  std::lock_guard lock(g_tally_mutex);
  tally[name] += t;
}

// Runs a replay; a violated check or an unexpected exception fails the test and counts as a run.
Tally run_reporting_failures(FaultyReplay& replay) {
  Tally t;
  try {
    t = replay.run();
  } catch (const Violation& v) {
    ADD_FAILURE() << v.what();
    t.runs = 1;
  } catch (const std::exception& e) {
    ADD_FAILURE() << replay.where(std::string("unexpected exception: ") + e.what());
    t.runs = 1;
  }
  return t;
}

class FaultReplay : public ::testing::TestWithParam<Fault> {};

TEST_P(FaultReplay, RealTracesSurviveEveryInjectedFailure) {
  const Fault fault = GetParam();
  std::uint64_t injected = 0;
  for (const TraceProgram& program : programs()) {
    FaultyReplay replay(program, fault, kSanitized ? 0 : 5000);
    const Tally t = run_reporting_failures(replay);
    injected += t.injected;
    add_tally(g_replay_tally, fault_name(fault), t);
  }
  // Every kind of call the engine makes while it runs is reached; release_address is made only
  // by ~Engine (FaultAtDestruction), and cuMemGetInfo only when an engine starts or runs out.
  if (fault.call != DeviceCall::release_address) EXPECT_GT(injected, 0u) << fault_name(fault);
}

// The same on devices barely larger than the traces need (gmem's minimum capacity under the lag,
// README's table, plus 2-8%): mallocs wait for other streams, steal their chunks and run the
// pressure path for real, with failures injected inside.
TEST_P(FaultReplay, TightDevicesSurviveEveryInjectedFailure) {
  const Fault fault = GetParam();
  const std::pair<std::size_t, std::size_t> tight[] = {
      {2, 832 * MiB}, {0, 5760 * MiB}, {1, 13312 * MiB}, {3, 11520 * MiB}};
  std::uint64_t injected = 0;
  for (const auto& [index, capacity] : tight) {
    FaultyReplay replay(programs()[index], fault, 0, capacity);
    const Tally t = run_reporting_failures(replay);
    injected += t.injected;
    add_tally(g_tight_tally, fault_name(fault), t);
  }
  if (fault.call != DeviceCall::release_address) EXPECT_GT(injected, 0u) << fault_name(fault);
}

INSTANTIATE_TEST_SUITE_P(EveryCall, FaultReplay, ::testing::ValuesIn(all_faults()),
                         [](const auto& info) { return fault_name(info.param); });

// ~Engine cannot report a failure: it goes on giving back everything else. What stays with the
// device is what the failed call held: a range whose cuMemAddressFree failed, a chunk whose
// cuMemRelease failed, an event whose cuEventDestroy failed; a page whose cuMemUnmap failed
// keeps its chunk mapped, so that chunk and its arena's range stay too.
TEST(FaultAtDestruction, WhatLeaksIsWhatTheFailedCallHeld) {
  const TraceProgram& program = programs()[2];  // two_streams: two arenas, events pending
  for (DeviceCall call : {DeviceCall::release_address, DeviceCall::release_chunk, DeviceCall::unmap,
                          DeviceCall::destroy_event}) {
    SCOPED_TRACE(device_call_name(call));
    SimDeviceOptions o;
    o.capacity = kCapacity;
    o.lag_us = 2000;
    SimulatedDevice device(o);
    {
      Engine engine(device);
      std::vector<void*> blocks(program.slots, nullptr);
      for (std::size_t i = 0; i < program.ops.size(); ++i) {
        const testing::TraceOp& op = program.ops[i];
        device.advance_host_time(op.host_advance_us);
        if (op.malloc) {
          blocks[op.slot] = engine.malloc(op.size, op.stream);
          if (i % 5 == 0) engine.record_stream(blocks[op.slot], kSide1);
        } else {
          engine.free(blocks[op.slot]);
        }
      }
      ASSERT_GT(device.reserved_address_bytes(), kCapacity);  // two arenas at least
      ASSERT_GT(device.live_events(), 0u);
      device.fail_call(call, 1);
    }  // ~Engine, with live blocks and pending frees
    const std::size_t ranges = device.reserved_address_bytes(), chunks = device.chunk_bytes();
    const std::size_t events = device.live_events();
    switch (call) {
      case DeviceCall::release_address:
        EXPECT_EQ(ranges, kCapacity);
        EXPECT_EQ(chunks, 0u);
        EXPECT_EQ(events, 0u);
        break;
      case DeviceCall::release_chunk:
        EXPECT_EQ(ranges, 0u);
        EXPECT_EQ(chunks, kGranule);
        EXPECT_EQ(events, 0u);
        break;
      case DeviceCall::unmap:
        EXPECT_EQ(ranges, kCapacity);
        EXPECT_EQ(chunks, kGranule);
        EXPECT_EQ(device.mapped_bytes(), kGranule);
        EXPECT_EQ(events, 0u);
        break;
      default:  // destroy_event
        EXPECT_EQ(ranges, 0u);
        EXPECT_EQ(chunks, 0u);
        EXPECT_EQ(events, 1u);
        break;
    }
  }
}

// Found by RealTracesSurviveEveryInjectedFailure/cuEventDestroy on two_streams and
// llama_ckpt_varlen (fault at the 10th cuEventDestroy): process_pending destroyed a pending
// free's events one by one and, when the second destroy failed, left the first (destroyed) in
// the list; every later malloc then polled it and failed, and the block's memory never came back
// (on a GPU, querying a destroyed event is undefined behaviour). The smallest reproduction:
TEST(FaultBugs, FailedEventDestroyLeavesNoDestroyedEventPending) {
  SimulatedDevice device;  // events complete when recorded
  Engine engine(device);
  void* p = engine.malloc(1 * MiB);
  engine.record_stream(p, 1);
  engine.record_stream(p, 2);
  engine.free(p);  // pending, with an event on stream 1 and one on stream 2
  device.fail_call(DeviceCall::destroy_event, 2);
  EXPECT_THROW(engine.malloc(512), DeviceError);  // the first event destroyed, the second not
  // The failure is spent: the engine serves again (it failed: "cuEventQuery failed (code 400):
  // unknown event 1", on this malloc and every one after it).
  void* q = nullptr;
  EXPECT_NO_THROW(q = engine.malloc(512));
  if (q != nullptr) engine.free(q);
  EXPECT_NO_THROW(engine.empty_cache());
  engine.check_invariants();
}

// --- under threads ---------------------------------------------------------------------------

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
      device.submit_work(stream);  // a kernel: events recorded from now on wait for it
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
      if (i % 64 == 63) device.complete_stream(stream);  // this thread's GPU work caught up
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
      const std::uint64_t calls = device.calls(fault.call);
      if (!fired && armed_at != 0 && calls >= armed_at) {
        fired = true;
        fired_at_op = ops_done.load();
        ++injected;
      }
      // The next failure once the threads have made some progress since the last one (a call
      // made a hundred times a malloc, like cuEventQuery, would otherwise fail every retry).
      if (armed_at == 0 || (fired && ops_done.load() >= fired_at_op + 32)) {
        fired = false;
        device.fail_call(fault.call, nth, fault.oom);
        armed_at = calls + nth;
        nth = nth >= 64 ? 1 : nth * 4;  // 1st, 4th, 16th, 64th call from now, and again
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (!fired && armed_at != 0 && device.calls(fault.call) >= armed_at) ++injected;
    device.fail_call(fault.call, 0);
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  controller.join();
  for (const std::string& f : failures) ADD_FAILURE() << fault_name(fault) << ": " << f;
  ASSERT_TRUE(failures.empty());

  engine->check_invariants();
  testing::expect_no_chunk_lost(device, *engine, "after the threads");
  device.complete_all_streams();
  for (auto& blocks : leftovers)
    for (void* p : blocks) engine->free(p);
  engine->empty_cache();
  engine->check_invariants();
  EXPECT_EQ(engine->stats().allocated_bytes[kAllPools].current, 0);
  EXPECT_EQ(device.chunk_bytes(), 0u);
  EXPECT_EQ(device.reserved_address_bytes(), kThreads * kCapacity);  // one arena per stream
  engine.reset();
  EXPECT_EQ(device.chunk_bytes(), 0u);
  EXPECT_EQ(device.reserved_address_bytes(), 0u);
  EXPECT_EQ(device.live_events(), 0u);

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
