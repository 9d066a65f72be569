// Replays with the GPU lagging behind the host (ReplayOptions::lag_us): modelled device time,
// handoffs between streams, and the steps a replay counts and names.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gmem/trace.hpp"
#include "replay_test_support.hpp"
#include "trace/replay.hpp"

namespace gmem::trace {
namespace {

// --- the GPU lagging behind the host (ReplayOptions::lag_us) ---

constexpr double kLagUs = 2000;

// Without a lag, stream work completes at once, as before the lag existed: the trace's
// timestamps change nothing, and the host never waits.
TEST(ReplayLag, ZeroLagIgnoresTheClock) {
  const Trace t = read_trace(data_file("two_streams.trace.csv.gz"));
  Trace stretched = t;  // the same program, a thousand times slower
  for (Event& e : stretched.events) e.time_us *= 1000;
  Trace instant = t;
  for (Event& e : instant.events) e.time_us = 0;
  for (std::size_t limit : {std::size_t{0}, std::size_t{800} << 20}) {  // lazily, and capped
    ReplayOptions options;
    options.engine.memory_limit = limit;
    ASSERT_EQ(options.lag_us, 0.0);  // the default
    const ReplayResult r = replay(t, options);
    ASSERT_FALSE(r.failed) << r.failure;
    EXPECT_EQ(r.host_wait_us, 0.0);
    EXPECT_GT(r.unmaps, 0u) << "pages move between the streams";
    for (const Trace* other : {&stretched, &instant}) {
      const ReplayResult o = replay(*other, options);
      EXPECT_EQ(o.peak_reserved, r.peak_reserved);
      EXPECT_EQ(o.creates, r.creates);
      EXPECT_EQ(o.maps, r.maps);
      EXPECT_EQ(o.unmaps, r.unmaps);
      EXPECT_EQ(o.late_device_calls, r.late_device_calls);
      EXPECT_EQ(o.device_call_us, r.device_call_us);
      EXPECT_EQ(o.host_wait_us, 0.0);
    }
  }
}

TEST(ReplayLag, ReportsModelledDeviceTime) {
  for (const char* file : {"two_streams.trace.csv.gz", "leak_losses.trace.csv.gz"}) {
    const Trace t = read_trace(data_file(file));
    ReplayOptions options;
    options.lag_us = kLagUs;
    const ReplayResult r = replay(t, options);
    ASSERT_FALSE(r.failed) << file << ": " << r.failure;
    EXPECT_EQ(r.lag_us, kLagUs);
    // At least the priced chunk calls the result counts (cuMemSetAccess and events come on top).
    EXPECT_GE(r.device_call_us, 15.0 * static_cast<double>(r.creates) + 2.0 * static_cast<double>(r.maps) +
                                    22.0 * static_cast<double>(r.unmaps)) << file;
    EXPECT_GT(r.device_call_us, 0.0) << file;
    EXPECT_LE(r.late_device_call_us, r.device_call_us) << file;
    EXPECT_LE(r.late_host_wait_us, r.host_wait_us) << file;
    EXPECT_EQ(r.late_device_call_us > 0, r.late_device_calls > 0) << file;
    // The host clock: the trace's span, plus whatever the host waited.
    std::int64_t first = -1, last = 0;
    for (const Event& e : t.events) {
      if (e.action != Action::alloc && e.action != Action::free_completed) continue;
      if (first < 0) first = e.time_us;
      last = e.time_us;
    }
    EXPECT_EQ(r.host_clock_us, static_cast<double>(last - first) + r.host_wait_us) << file;
  }
}

TEST(ReplayLag, MinCapacityReplaysUnderTheLag) {
  const Trace t = read_trace(data_file("two_streams.trace.csv.gz"));
  const std::size_t min_cap = min_capacity(t, kLagUs);
  ReplayOptions at;
  at.lag_us = kLagUs;
  at.capacity = min_cap;
  const ReplayResult r = replay(t, at);
  EXPECT_FALSE(r.failed) << r.failure;
  EXPECT_GE(min_cap, r.peak_allocated);
  at.capacity = min_cap - kGranule;
  EXPECT_TRUE(replay(t, at).failed);
}

class LagTrace : public WrittenTrace {};

// Two streams take turns with the whole device: each handoff waits for the GPU to catch up
// with the stream that freed the memory, and everything after a wait happens that much later.
TEST_F(LagTrace, HandoffsBetweenStreamsWaitForTheGpu) {
  write("alloc,4194304,4194304,1,0,,\n"
        "free_completed,4194304,4194304,1,10,,\n"
        "alloc,8388608,4194304,2,20,,\n"
        "free_completed,8388608,4194304,2,30,,\n"
        "alloc,12582912,4194304,1,5000,,\n");
  const Trace t = read_trace(path());
  ReplayOptions options;
  options.capacity = 4u << 20;  // room for one block: the other stream's pages must be reused
  options.lag_us = kLagUs;
  const ReplayResult r = replay(t, options);
  ASSERT_FALSE(r.failed) << r.failure;
  // Two handoffs, each made by the taking stream waiting on the GPU (a handover): the host does
  // not wait, and the memory moves without any created.
  EXPECT_EQ(r.stream_handovers, 2u);
  EXPECT_EQ(r.host_wait_us, 0.0);
  EXPECT_EQ(r.host_clock_us, 5000.0);
  EXPECT_EQ(r.creates, 2u);
  EXPECT_GT(r.device_call_us, 0.0);

  options.lag_us = 0;
  const ReplayResult at_once = replay(t, options);
  ASSERT_FALSE(at_once.failed) << at_once.failure;
  EXPECT_EQ(at_once.host_wait_us, 0.0);
  EXPECT_EQ(at_once.host_clock_us, 5000.0);
}

TEST_F(LagTrace, CountsTheStepsGiven) {
  std::string rows;
  for (int i = 0; i < 4; ++i) {  // events 2i (alloc) and 2i + 1 (free): one step each
    const std::string addr = std::to_string(4096 * (i + 1));
    rows += "alloc," + addr + ",512,0," + std::to_string(10 * i) + ",,\n";
    rows += "free_completed," + addr + ",512,0," + std::to_string(10 * i + 5) + ",,\n";
  }
  const Trace t = read_trace(write(rows));
  ReplayOptions options;
  options.step_ends = {1, 3, 5, 7};
  ReplayResult r = replay(t, options);
  EXPECT_EQ(r.steps, 4u);
  EXPECT_EQ(r.late_steps, 2u);  // the second half starts at event 4
  options.stop_at_event = 6;    // events 0-5: the second half starts at event 3
  r = replay(t, options);
  EXPECT_EQ(r.steps, 3u);
  EXPECT_EQ(r.late_steps, 2u);
  EXPECT_EQ(replay(t).steps, 0u);  // unknown
}

// --steps says which earlier step a step repeats: same sizes on the same streams, in order.
TEST_F(LagTrace, NamesTheStepAStepRepeats) {
  // Steps of requests A (1 MiB then 3 MiB), B (1 MiB, stream 7), A, A with its order swapped, A.
  const std::vector<std::vector<std::pair<int, int>>> steps = {
      {{1, 0}, {3, 0}}, {{1, 7}}, {{1, 0}, {3, 0}}, {{3, 0}, {1, 0}}, {{1, 0}, {3, 0}}};
  std::string rows;
  std::vector<std::size_t> ends;
  std::size_t event = 0;
  int time = 0;
  for (const auto& step : steps) {
    for (const auto& [mib, stream] : step) {
      const std::string size = std::to_string(mib << 20), addr = std::to_string((100 + event) << 22);
      rows += "alloc," + addr + "," + size + "," + std::to_string(stream) + "," + std::to_string(time++) + ",,\n";
      rows += "free_completed," + addr + "," + size + "," + std::to_string(stream) + "," +
              std::to_string(time++) + ",,\n";
      event += 2;
    }
    ends.push_back(event - 1);
  }
  const Trace t = read_trace(write(rows));
  ReplayOptions options;
  options.step_ends = ends;
  options.record_steps = true;
  const ReplayResult r = replay(t, options);
  ASSERT_EQ(r.per_step.size(), 5u);
  const std::size_t repeats[] = {0, 0, 1, 0, 1}, seen[] = {0, 0, 1, 0, 2};
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(r.per_step[i].repeats_step, repeats[i]) << "step " << i + 1;
    EXPECT_EQ(r.per_step[i].times_seen, seen[i]) << "step " << i + 1;
  }
}

}  // namespace
}  // namespace gmem::trace
