// Fault injection on real work, one thread: trace replays on roomy and on tight devices survive
// every injected failure, faults during ~Engine leak only what the failed call held.
//
// How: the captured traces of tests/data are replayed through an Engine on a SimulatedDevice
// whose GPU lags 2 ms behind a host clock that follows the trace, while one kind of device call
// fails at its 1st, 3rd, 10th, 30th, 100th, 300th, 1000th call and every 1000th after (one
// failure armed at a time). Blocks are also used on side streams (record_stream), the cache is
// emptied, the limit lowered and a malloc made to run out of memory along the way, so that every
// device call the engine makes is reached: event calls, unmaps and releases included.
//
// After each failure: the error names the failed call (an OutOfMemoryError for the device's
// out-of-memory variant of cuMemCreate), invariants hold, the device's chunks are exactly what
// the engine counts as reserved, its address ranges one arena per stream that allocated, and the
// operation succeeds when retried once. At the end everything is freed, empty_cache() gives every
// chunk back, and the engine's destruction leaves no chunk, range or event behind.
//
// Faults during ~Engine (which cannot report them) are checked apart: what leaks is what the
// failed call held, nothing more.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "fault_harness.hpp"
#include "fault_replay_test_support.hpp"
#include "gmem/engine.hpp"
#include "gmem/error.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/trace.hpp"

namespace gmem {
namespace {

using testing::all_faults;
using testing::Fault;
using testing::fault_name;

using testing::kSanitized;
using testing::TraceProgram;

constexpr StreamId kSide1 = 0x51de1, kSide2 = 0x51de2;

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
      device_->ledger().advance_host_time(op.host_advance_us);
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
    require(device_->memory().chunk_bytes() == 0, where("chunks left after empty_cache: " +
                                              std::to_string(device_->memory().chunk_bytes())));
    t.injected = fired_points();
    t.waits = static_cast<std::uint64_t>(engine_->stats().num_sync_all_streams);
    t.retries = static_cast<std::uint64_t>(engine_->stats().num_alloc_retries);
    device_->ledger().fail_call(fault_.call, 0);  // faults at destruction: FaultAtDestruction below
    engine_.reset();
    require(device_->memory().chunk_bytes() == 0, where("chunks left after ~Engine"));
    require(device_->memory().reserved_address_bytes() == 0,
            where("address ranges left after ~Engine"));
    require(device_->streams().live_events() == 0, where("events left after ~Engine: " +
                                              std::to_string(device_->streams().live_events())));
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
    const std::uint64_t calls = device_->ledger().calls(fault_.call);
    armed_at_ = std::max(point_call(point), calls + 1);
    device_->ledger().fail_call(fault_.call, armed_at_ - calls, fault_.oom);
  }
  bool armed_fired() const {
    return armed_at_ != ~std::uint64_t{0} && device_->ledger().calls(fault_.call) >= armed_at_;
  }
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
    require(static_cast<std::int64_t>(device_->memory().chunk_bytes()) == reserved,
            where(what + ": device holds " + std::to_string(device_->memory().chunk_bytes()) +
                  " B of chunks, the engine counts " + std::to_string(reserved)));
    // One arena (a whole device of address space) per stream that allocated; a stream whose
    // first malloc failed after its arena was reserved keeps it too.
    const std::size_t ranges = device_->memory().reserved_address_bytes();
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
        device.ledger().advance_host_time(op.host_advance_us);
        if (op.malloc) {
          blocks[op.slot] = engine.malloc(op.size, op.stream);
          if (i % 5 == 0) engine.record_stream(blocks[op.slot], kSide1);
        } else {
          engine.free(blocks[op.slot]);
        }
      }
      ASSERT_GT(device.memory().reserved_address_bytes(), kCapacity);  // two arenas at least
      ASSERT_GT(device.streams().live_events(), 0u);
      device.ledger().fail_call(call, 1);
    }  // ~Engine, with live blocks and pending frees
    const std::size_t ranges = device.memory().reserved_address_bytes();
    const std::size_t chunks = device.memory().chunk_bytes();
    const std::size_t events = device.streams().live_events();
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
        EXPECT_EQ(device.memory().mapped_bytes(), kGranule);
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
  device.ledger().fail_call(DeviceCall::destroy_event, 2);
  EXPECT_THROW(engine.malloc(512), DeviceError);  // the first event destroyed, the second not
  // The failure is spent: the engine serves again (it failed: "cuEventQuery failed (code 400):
  // unknown event 1", on this malloc and every one after it).
  void* q = nullptr;
  EXPECT_NO_THROW(q = engine.malloc(512));
  if (q != nullptr) engine.free(q);
  EXPECT_NO_THROW(engine.empty_cache());
  engine.check_invariants();
}

}  // namespace
}  // namespace gmem
