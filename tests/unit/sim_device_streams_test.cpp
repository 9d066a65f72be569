// SimulatedDevice's stream and event model: events and waits between streams, the GPU lagging
// behind the host clock, what calls cost (kDeviceCallPrices), and live events.
#include "gmem/sim_device.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "gmem/error.hpp"
#include "sim_device_test_support.hpp"

namespace gmem {
namespace {

TEST(SimDevice, EventsCompleteAtOnceByDefault) {
  SimulatedDevice device;
  const EventHandle event = device.create_event();
  device.streams().submit_work(1);
  device.record_event(event, 1);
  device.streams().submit_work(1);
  EXPECT_TRUE(device.query_event(event));
}

TEST(SimDevice, EventsWaitForWorkSubmittedBeforeThem) {
  SimDeviceOptions options;
  options.streams_complete_immediately = false;
  SimulatedDevice device(options);
  const StreamId stream = 0x1234;
  const StreamId other = 0x5678;
  const EventHandle never_recorded = device.create_event();
  EXPECT_TRUE(device.query_event(never_recorded));

  const EventHandle idle = device.create_event();
  device.record_event(idle, stream);  // nothing submitted yet
  EXPECT_TRUE(device.query_event(idle));

  device.streams().submit_work(stream);
  const EventHandle first = device.create_event();
  device.record_event(first, stream);
  device.streams().submit_work(stream);
  const EventHandle second = device.create_event();
  device.record_event(second, stream);
  const EventHandle elsewhere = device.create_event();
  device.streams().submit_work(other);
  device.record_event(elsewhere, other);
  EXPECT_FALSE(device.query_event(first));
  EXPECT_FALSE(device.query_event(second));

  // Synchronizing on `first` runs the stream up to it, not to `second`.
  device.synchronize_event(first);
  EXPECT_TRUE(device.query_event(first));
  EXPECT_FALSE(device.query_event(second));
  EXPECT_FALSE(device.query_event(elsewhere));

  device.streams().complete_stream(stream);
  EXPECT_TRUE(device.query_event(second));
  EXPECT_FALSE(device.query_event(elsewhere));

  // Re-recording moves the event to the stream's latest work.
  device.streams().submit_work(stream);
  device.record_event(first, stream);
  EXPECT_FALSE(device.query_event(first));
  EXPECT_TRUE(device.query_event(second));

  device.streams().complete_all_streams();
  EXPECT_TRUE(device.query_event(first));
  EXPECT_TRUE(device.query_event(elsewhere));
}

// cuStreamWaitEvent: the waiting stream's later work comes after the event's, and through it
// after what that stream waited for; a later record of the event changes nothing.
TEST(SimDevice, AStreamMadeToWaitComesAfterTheEvent) {
  SimDeviceOptions options;
  options.streams_complete_immediately = false;
  SimulatedDevice device(options);
  constexpr StreamId a = 1, b = 2, c = 3;
  const EventHandle on_a = device.create_event();
  const EventHandle on_b = device.create_event();
  const EventHandle never_recorded = device.create_event();
  device.wait_event(b, never_recorded);  // no wait
  EXPECT_FALSE(device.streams().ordered_after(b, a, 1));

  device.streams().submit_work(a);
  device.record_event(on_a, a);
  EXPECT_FALSE(device.streams().ordered_after(b, a, device.streams().submitted(a)));
  device.wait_event(b, on_a);
  EXPECT_TRUE(device.streams().ordered_after(b, a, 1));
  EXPECT_FALSE(device.streams().ordered_after(a, b, 1));  // not the other way
  device.streams().submit_work(a);
  device.record_event(on_a, a);  // recorded again: b still waits for the first record only
  EXPECT_FALSE(device.streams().ordered_after(b, a, 2));

  device.streams().submit_work(b);
  device.record_event(on_b, b);
  device.wait_event(c, on_b);  // c after b, and so after a's first kernel
  EXPECT_TRUE(device.streams().ordered_after(c, b, 1));
  EXPECT_TRUE(device.streams().ordered_after(c, a, 1));
  EXPECT_FALSE(device.streams().ordered_after(c, a, 2));

  // b's stream finishing means the work it waited for finished too (a's first kernel), not the
  // rest of a's.
  EXPECT_FALSE(device.query_event(on_b));
  device.streams().complete_stream(b);
  EXPECT_TRUE(device.query_event(on_b));
  EXPECT_TRUE(device.streams().ordered_after(a + 10, a, 1));  // done: any stream comes after it
  EXPECT_FALSE(device.query_event(on_a));
  EXPECT_EQ(device.ledger().calls(DeviceCall::wait_event), 3u);
  EXPECT_THROW(device.wait_event(a, 12345), DeviceError);
}

TEST(SimDeviceLag, AWaitingStreamsEventsCompleteNoEarlierThanTheEventWaitedFor) {
  SimDeviceOptions options;
  options.lag_us = 1000;
  SimulatedDevice device(options);
  const EventHandle slow = device.create_event();
  const EventHandle after = device.create_event();
  device.record_event(slow, 1);  // completes at 1000
  device.streams().set_lag(10);
  device.wait_event(2, slow);
  device.record_event(after, 2);  // 10 behind the host, but after `slow`
  device.ledger().set_host_time(500);
  EXPECT_FALSE(device.query_event(after));
  device.ledger().set_host_time(1000);
  EXPECT_TRUE(device.query_event(after));
}

// --- the host-ahead model: the GPU runs lag_us behind the host clock ---

SimulatedDevice lagging_device(double lag_us) {
  SimDeviceOptions options;
  options.lag_us = lag_us;
  return SimulatedDevice(options);
}

TEST(SimDeviceLag, EventsCompleteLagAfterTheirRecord) {
  SimulatedDevice device = lagging_device(100);
  EXPECT_EQ(device.streams().lag(), 100.0);
  device.ledger().set_host_time(1000);
  const EventHandle event = device.create_event();
  EXPECT_TRUE(device.query_event(event));  // never recorded: complete, as with cuEventQuery
  device.record_event(event, 7);
  EXPECT_FALSE(device.query_event(event));
  device.ledger().set_host_time(1099.5);
  EXPECT_FALSE(device.query_event(event));
  device.ledger().set_host_time(1100);
  EXPECT_TRUE(device.query_event(event));
  device.ledger().advance_host_time(5000);
  EXPECT_TRUE(device.query_event(event));
  // Re-recording moves it to the host's present.
  device.record_event(event, 7);
  EXPECT_FALSE(device.query_event(event));
  EXPECT_EQ(device.ledger().modelled_wait_us(), 0.0);  // queries never wait
}

TEST(SimDeviceLag, HostClockNeverRunsBackwards) {
  SimulatedDevice device = lagging_device(100);
  EXPECT_EQ(device.host_time(), 0.0);
  device.ledger().set_host_time(250);
  device.ledger().set_host_time(50);
  EXPECT_EQ(device.host_time(), 250.0);
  device.ledger().advance_host_time(-10);
  EXPECT_EQ(device.host_time(), 250.0);
  device.ledger().advance_host_time(25.5);
  EXPECT_EQ(device.host_time(), 275.5);
}

TEST(SimDeviceLag, SynchronizeMovesTheHostClockAndCountsTheWait) {
  SimulatedDevice device = lagging_device(100);
  device.ledger().set_host_time(1000);
  const EventHandle mine = device.create_event();
  const EventHandle other = device.create_event();
  device.record_event(mine, 1);
  device.record_event(other, 2);
  device.ledger().set_host_time(1030);
  device.synchronize_event(mine);
  EXPECT_EQ(device.host_time(), 1100.0);
  EXPECT_EQ(device.ledger().modelled_wait_us(), 70.0);
  EXPECT_TRUE(device.query_event(mine));
  EXPECT_TRUE(device.query_event(other));  // the other stream ran on meanwhile
  // Waiting on a complete event (or one never recorded) costs nothing.
  device.synchronize_event(mine);
  device.synchronize_event(device.create_event());
  EXPECT_EQ(device.host_time(), 1100.0);
  EXPECT_EQ(device.ledger().modelled_wait_us(), 70.0);
  // Waits add up.
  device.record_event(mine, 1);
  device.synchronize_event(mine);
  EXPECT_EQ(device.host_time(), 1200.0);
  EXPECT_EQ(device.ledger().modelled_wait_us(), 170.0);
}

TEST(SimDeviceLag, StreamsCompleteInOrder) {
  SimulatedDevice device = lagging_device(1000);
  const StreamId stream = 1, other = 2;
  const EventHandle early = device.create_event();
  const EventHandle late = device.create_event();
  const EventHandle elsewhere = device.create_event();
  device.record_event(early, stream);  // at 0: completes at 1000
  // The GPU catches up (a lighter phase): later events lag less, but not past earlier ones.
  device.streams().set_lag(10);
  device.ledger().set_host_time(100);
  device.record_event(late, stream);      // 110, held back to 1000 by `early`
  device.record_event(elsewhere, other);  // 110: another stream is not held back
  device.ledger().set_host_time(500);
  EXPECT_TRUE(device.query_event(elsewhere));
  EXPECT_FALSE(device.query_event(early));
  EXPECT_FALSE(device.query_event(late));
  device.synchronize_event(late);
  EXPECT_EQ(device.host_time(), 1000.0);
  EXPECT_TRUE(device.query_event(early));
  EXPECT_EQ(device.ledger().modelled_wait_us(), 500.0);
}

TEST(SimDeviceLag, ZeroLagCompletesEventsWhenRecorded) {
  SimulatedDevice device = lagging_device(0);
  device.ledger().set_host_time(1000);
  const EventHandle event = device.create_event();
  device.record_event(event, 3);
  EXPECT_TRUE(device.query_event(event));
  device.synchronize_event(event);
  EXPECT_EQ(device.host_time(), 1000.0);
  EXPECT_EQ(device.ledger().modelled_wait_us(), 0.0);
}

TEST(SimDeviceLag, CombinesWithWorkCompletedByHand) {
  SimDeviceOptions options;
  options.streams_complete_immediately = false;
  options.lag_us = 100;
  SimulatedDevice device(options);
  const StreamId stream = 9;
  device.streams().submit_work(stream);
  const EventHandle event = device.create_event();
  device.record_event(event, stream);
  device.ledger().set_host_time(200);
  EXPECT_FALSE(device.query_event(event));  // its time has come, its work is not done
  device.streams().complete_stream(stream);
  EXPECT_TRUE(device.query_event(event));

  device.streams().submit_work(stream);
  device.record_event(event, stream);  // at 200: completes at 300
  device.streams().complete_stream(stream);
  EXPECT_FALSE(device.query_event(event));  // the work is done, its time has not come
  device.synchronize_event(event);
  EXPECT_EQ(device.host_time(), 300.0);
  EXPECT_EQ(device.ledger().modelled_wait_us(), 100.0);
}

TEST(SimDeviceLag, RejectsBadLags) {
  for (double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    SimDeviceOptions options;
    options.lag_us = bad;
    EXPECT_THROW(SimulatedDevice{options}, Error) << bad;
    SimulatedDevice device;
    EXPECT_THROW(device.streams().set_lag(bad), Error) << bad;
  }
}

// --- what calls cost: kDeviceCallPrices ---

TEST(SimDevicePrices, TableHasTheMeasuredPrices) {
  auto price = [](DeviceCall call) { return kDeviceCallPrices[static_cast<int>(call)]; };
  // cuMem* per 2 MiB chunk or mapping as measured on an H100, and per further 2 MiB of one
  // (gpu/chunk_size_calls.cu); event calls estimated.
  EXPECT_EQ(price(DeviceCall::create_chunk).us, 15.0);
  EXPECT_EQ(price(DeviceCall::map).us, 2.0);
  EXPECT_EQ(price(DeviceCall::set_access).us, 38.0);
  EXPECT_EQ(price(DeviceCall::unmap).us, 22.0);
  EXPECT_EQ(price(DeviceCall::release_chunk).us, 16.0);
  EXPECT_EQ(price(DeviceCall::release_chunk).further_us, 0.76);
  for (DeviceCall call : {DeviceCall::create_chunk, DeviceCall::set_access, DeviceCall::unmap,
                          DeviceCall::release_chunk}) {
    // A larger chunk costs more, but far less than as many 2 MiB ones.
    EXPECT_GT(price(call).further_us, 0.0) << device_call_name(call);
    EXPECT_LT(price(call).further_us, price(call).us / 10) << device_call_name(call);
  }
  for (DeviceCall call : {DeviceCall::create_event, DeviceCall::record_event, DeviceCall::destroy_event}) {
    EXPECT_EQ(price(call).us, 1.0) << device_call_name(call);
    EXPECT_EQ(price(call).further_us, 0.0) << device_call_name(call);
  }
  EXPECT_EQ(price(DeviceCall::query_event).us, 0.5);
}

TEST(SimDevicePrices, CallsAccumulateTheirPrices) {
  SimulatedDevice device;
  EXPECT_EQ(device.ledger().modelled_call_us(), 0.0);
  const DevicePtr base = device.reserve_address(8 * kGranule, 0);
  device.mem_info();
  EXPECT_EQ(device.ledger().modelled_call_us(), 0.0);  // not priced

  double expected = 0;
  auto expect_total = [&](double added, const char* what) {
    expected += added;
    EXPECT_DOUBLE_EQ(device.ledger().modelled_call_us(), expected) << what;
  };
  const ChunkHandle one = device.create_chunk(kGranule);
  expect_total(15, "cuMemCreate, one granule");
  const ChunkHandle three = device.create_chunk(3 * kGranule);
  expect_total(15 + 2 * 0.04, "cuMemCreate, three granules: one chunk");
  device.map(base, kGranule, one);
  device.map(base + kGranule, 3 * kGranule, three);
  expect_total(2 + 2, "cuMemMap, per call");
  device.set_access(base, 4 * kGranule);  // across both mappings: priced per mapping
  expect_total(2 * 38 + 2 * 0.04, "cuMemSetAccess");
  EXPECT_THROW(device.map(base, kGranule, one), DeviceError);  // a failed call costs too
  expect_total(2, "failed cuMemMap");
  device.unmap(base, 4 * kGranule);
  expect_total(2 * 22 + 2 * 0.01, "cuMemUnmap");
  device.release_chunk(three);
  device.release_chunk(one);
  expect_total(16 + 2 * 0.76 + 16, "cuMemRelease");

  const EventHandle event = device.create_event();
  device.record_event(event, 1);
  device.query_event(event);
  device.query_event(event);
  device.synchronize_event(event);
  device.destroy_event(event);
  expect_total(1 + 1 + 0.5 + 0.5 + 1 + 1, "events");
  EXPECT_EQ(device.ledger().modelled_wait_us(), 0.0);  // no lag: nothing to wait for

  device.ledger().reset_call_counts();  // the account follows the counts
  EXPECT_EQ(device.ledger().modelled_call_us(), 0.0);
}

TEST(SimDevice, TracksLiveEvents) {
  SimulatedDevice device;
  const EventHandle a = device.create_event();
  const EventHandle b = device.create_event();
  EXPECT_NE(a, b);
  EXPECT_EQ(device.streams().live_events(), 2u);
  device.destroy_event(a);
  EXPECT_EQ(device.streams().live_events(), 1u);
  expect_device_error([&] { device.destroy_event(a); }, "cuEventDestroy");
  expect_device_error([&] { device.record_event(a, 0); }, "cuEventRecord");
  expect_device_error([&] { device.query_event(a); }, "cuEventQuery");
  expect_device_error([&] { device.synchronize_event(a); }, "cuEventSynchronize");
}

}  // namespace
}  // namespace gmem
