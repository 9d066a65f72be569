// StreamTracker (src/engine/stream_tracker.hpp): how long the host waits for a stream. A page
// must be unmapped only once the GPU is done with it, but no later: waiting for a free made a
// while ago stops at the first event after it (marks, recorded every kMarkEvery frees once the
// stream has been waited for), not at the end of all work submitted since.
#include <gtest/gtest.h>

#include "engine/stream_tracker.hpp"
#include "gmem/sim_device.hpp"

namespace gmem::detail {
namespace {

constexpr double kLagUs = 10'000;  // the GPU 10 ms behind the host
constexpr double kFreeGapUs = 50;  // between two frees

struct Fixture {
  SimulatedDevice device{SimDeviceOptions{.lag_us = kLagUs}};
  StreamTracker tracker{device};
  std::uint32_t stream = tracker.add(7);
  // `n` frees kFreeGapUs apart; returns the first one's stamp.
  std::uint64_t frees(int n) {
    std::uint64_t first = 0;
    for (int i = 0; i < n; ++i) {
      device.ledger().advance_host_time(kFreeGapUs);
      const std::uint64_t seq = tracker.stamp(stream);
      if (i == 0) first = seq;
    }
    return first;
  }
  double wait_us(std::uint64_t seq) {
    const double before = device.host_time();
    EXPECT_TRUE(tracker.wait_for(stream, seq));
    EXPECT_TRUE(tracker.done(stream, seq));
    return device.host_time() - before;
  }
};

TEST(StreamTracker, AFirstWaitRunsToTheEndOfTheStream) {
  Fixture f;
  const std::uint64_t old = f.frees(200);  // 10 ms of frees: the first one's work is due now
  EXPECT_FALSE(f.tracker.done(f.stream, old));
  EXPECT_NEAR(f.wait_us(old), kLagUs, 1);  // no mark yet: an event recorded now
}

TEST(StreamTracker, OnceWaitedForAWaitStopsAtTheFirstMarkAfterTheFree) {
  Fixture f;
  f.wait_us(f.frees(10));  // marking starts
  const std::uint64_t old = f.frees(1);
  f.frees(2 * static_cast<int>(StreamTracker::kMarkEvery) + 40);  // 6.4 ms later
  // The first mark after `old` was recorded at most kMarkEvery frees after it: the GPU reaches
  // it at most (kMarkEvery + 1) free gaps after the free's own time plus the lag.
  const double waited = f.wait_us(old);
  EXPECT_LE(waited, kLagUs - (StreamTracker::kMarkEvery + 40) * kFreeGapUs + 1);
  EXPECT_GT(waited, 0);
  // Freed over kLagUs ago, behind a mark: done without a wait.
  const std::uint64_t older = f.frees(1);
  f.frees(static_cast<int>(kLagUs / kFreeGapUs) + 2 * static_cast<int>(StreamTracker::kMarkEvery));
  EXPECT_EQ(f.wait_us(older), 0);
}

TEST(StreamTracker, MarkingStopsWhenNoWaitComesAndMarksStayBounded) {
  Fixture f;
  f.wait_us(f.frees(10));
  const std::uint64_t records = f.device.ledger().calls(DeviceCall::record_event);
  f.frees(static_cast<int>(StreamTracker::kMarkEvery * StreamTracker::kMarksWithoutWait));
  const std::uint64_t while_marking = f.device.ledger().calls(DeviceCall::record_event) - records;
  EXPECT_EQ(while_marking, StreamTracker::kMarksWithoutWait);  // then it stops
  f.frees(10 * static_cast<int>(StreamTracker::kMarkEvery));
  // Settled: none.
  EXPECT_EQ(f.device.ledger().calls(DeviceCall::record_event) - records, while_marking);
  EXPECT_LE(f.device.ledger().calls(DeviceCall::create_event), StreamTracker::kMaxMarks + 1);
}

}  // namespace
}  // namespace gmem::detail
