// SimulatedDevice: strict about misuse, exact call counts, injected failures, memory capacity
// and the stream/event model.
#include "gmem/sim_device.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>
#include <thread>
#include <vector>

#include "gmem/error.hpp"

namespace gmem {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGranule = 2 * kMiB;

// Runs `f`, expecting a DeviceError from the named CUDA call.
template <class F>
DeviceError expect_device_error(F&& f, const std::string& call) {
  try {
    f();
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.call(), call) << e.what();
    EXPECT_EQ(e.code(), Errc::device_error);
    return e;
  }
  ADD_FAILURE() << "expected a DeviceError from " << call;
  return DeviceError(call, 0, "none thrown");
}

TEST(SimDevice, ReservesAlignedDisjointHighAddresses) {
  SimulatedDevice device;
  const DevicePtr a = device.reserve_address(64 * kMiB, 0);
  const DevicePtr b = device.reserve_address(8 * kMiB, 1024 * kMiB);
  const DevicePtr c = device.reserve_address(kGranule, 0);
  EXPECT_GE(a, DevicePtr{1} << 40);  // looks like a device pointer, never 0
  EXPECT_EQ(a % kGranule, 0u);
  EXPECT_EQ(b % (1024 * kMiB), 0u);
  EXPECT_GE(b, a + 64 * kMiB);
  EXPECT_GE(c, b + 8 * kMiB);
  EXPECT_EQ(device.reserved_address_bytes(), 74 * kMiB);
  device.release_address(b, 8 * kMiB);
  EXPECT_EQ(device.reserved_address_bytes(), 66 * kMiB);
}

TEST(SimDevice, RejectsBadReservations) {
  SimulatedDevice device;
  expect_device_error([&] { device.reserve_address(0, 0); }, "cuMemAddressReserve");
  expect_device_error([&] { device.reserve_address(kGranule + 512, 0); }, "cuMemAddressReserve");
  expect_device_error([&] { device.reserve_address(kGranule, 3 * kMiB); }, "cuMemAddressReserve");
  const DevicePtr base = device.reserve_address(4 * kGranule, 0);
  expect_device_error([&] { device.release_address(base + kGranule, 3 * kGranule); },
                      "cuMemAddressFree");
  expect_device_error([&] { device.release_address(base, 2 * kGranule); }, "cuMemAddressFree");
  device.release_address(base, 4 * kGranule);
  expect_device_error([&] { device.release_address(base, 4 * kGranule); }, "cuMemAddressFree");
  EXPECT_EQ(device.reserved_address_bytes(), 0u);
}

TEST(SimDevice, RejectsBadOptions) {
  SimDeviceOptions options;
  options.granularity = 3 * kMiB;
  EXPECT_THROW(SimulatedDevice{options}, Error);
  options = {};
  options.used_by_others = options.capacity + 1;
  EXPECT_THROW(SimulatedDevice{options}, Error);
}

TEST(SimDevice, MapsWholeChunksInsideReservations) {
  SimulatedDevice device;
  const DevicePtr base = device.reserve_address(8 * kGranule, 0);
  const ChunkHandle one = device.create_chunk(kGranule);
  const ChunkHandle two = device.create_chunk(2 * kGranule);
  EXPECT_NE(one, 0u);
  EXPECT_NE(one, two);

  device.map(base + 3 * kGranule, 2 * kGranule, two);
  EXPECT_TRUE(device.is_mapped(base + 3 * kGranule));
  EXPECT_TRUE(device.is_mapped(base + 5 * kGranule - 1));
  EXPECT_FALSE(device.is_mapped(base + 5 * kGranule));
  EXPECT_EQ(device.chunk_at(base + 4 * kGranule + 12345), two);
  EXPECT_EQ(device.chunk_at(base), 0u);
  EXPECT_EQ(device.mapped_bytes(), 2 * kGranule);

  // Outside or straddling the reservation, misaligned, wrong size, unknown chunk, double map.
  expect_device_error([&] { device.map(base - kGranule, kGranule, one); }, "cuMemMap");
  expect_device_error([&] { device.map(base + 8 * kGranule, kGranule, one); }, "cuMemMap");
  expect_device_error([&] { device.map(base + 7 * kGranule, 2 * kGranule, two); }, "cuMemMap");
  expect_device_error([&] { device.map(base + 512, kGranule, one); }, "cuMemMap");
  expect_device_error([&] { device.map(base, 2 * kGranule, one); }, "cuMemMap");
  expect_device_error([&] { device.map(base, kGranule, 999); }, "cuMemMap");
  expect_device_error([&] { device.map(base + 4 * kGranule, kGranule, one); }, "cuMemMap");
  EXPECT_EQ(device.mapped_bytes(), 2 * kGranule);
  EXPECT_FALSE(device.is_mapped(base));

  // The same chunk may be mapped twice (CUDA allows aliases).
  device.map(base, kGranule, one);
  device.map(base + kGranule, kGranule, one);
  EXPECT_EQ(device.chunk_at(base + kGranule), one);
  EXPECT_EQ(device.mapped_bytes(), 4 * kGranule);
}

TEST(SimDevice, UnmapsOnlyWholeMappings) {
  SimulatedDevice device;
  const DevicePtr base = device.reserve_address(8 * kGranule, 0);
  const ChunkHandle big = device.create_chunk(2 * kGranule);
  const ChunkHandle small = device.create_chunk(kGranule);
  device.map(base, 2 * kGranule, big);
  device.map(base + 2 * kGranule, kGranule, small);

  expect_device_error([&] { device.unmap(base + 4 * kGranule, kGranule); }, "cuMemUnmap");
  expect_device_error([&] { device.unmap(base, kGranule); }, "cuMemUnmap");  // half of big
  expect_device_error([&] { device.unmap(base + kGranule, 2 * kGranule); }, "cuMemUnmap");
  expect_device_error([&] { device.unmap(base, 4 * kGranule); }, "cuMemUnmap");  // past the end
  EXPECT_EQ(device.mapped_bytes(), 3 * kGranule);

  device.unmap(base, 3 * kGranule);  // two whole mappings at once
  EXPECT_EQ(device.mapped_bytes(), 0u);
  EXPECT_FALSE(device.is_mapped(base + kGranule));
  expect_device_error([&] { device.unmap(base, 2 * kGranule); }, "cuMemUnmap");
  device.release_chunk(big);
  device.release_chunk(small);
  EXPECT_EQ(device.chunk_bytes(), 0u);
}

TEST(SimDevice, RefusesToReleaseWhatIsStillMapped) {
  SimulatedDevice device;
  const DevicePtr base = device.reserve_address(4 * kGranule, 0);
  const ChunkHandle chunk = device.create_chunk(kGranule);
  device.map(base + 2 * kGranule, kGranule, chunk);
  device.map(base + 3 * kGranule, kGranule, chunk);
  expect_device_error([&] { device.release_chunk(chunk); }, "cuMemRelease");
  expect_device_error([&] { device.release_address(base, 4 * kGranule); }, "cuMemAddressFree");
  device.unmap(base + 2 * kGranule, kGranule);
  expect_device_error([&] { device.release_chunk(chunk); }, "cuMemRelease");  // one alias left
  device.unmap(base + 3 * kGranule, kGranule);
  device.release_chunk(chunk);
  device.release_address(base, 4 * kGranule);
  expect_device_error([&] { device.release_chunk(chunk); }, "cuMemRelease");
  EXPECT_EQ(device.reserved_address_bytes(), 0u);
}

TEST(SimDevice, SetAccessNeedsMappedGranules) {
  SimulatedDevice device;
  const DevicePtr base = device.reserve_address(4 * kGranule, 0);
  const ChunkHandle a = device.create_chunk(kGranule);
  const ChunkHandle b = device.create_chunk(kGranule);
  device.map(base, kGranule, a);
  device.map(base + kGranule, kGranule, b);
  EXPECT_FALSE(device.is_accessible(base));
  expect_device_error([&] { device.set_access(base + kGranule, 2 * kGranule); }, "cuMemSetAccess");
  EXPECT_FALSE(device.is_accessible(base + kGranule));
  device.set_access(base, 2 * kGranule);  // spans two mappings
  EXPECT_TRUE(device.is_accessible(base + 100));
  EXPECT_TRUE(device.is_accessible(base + kGranule));
  EXPECT_FALSE(device.is_accessible(base + 2 * kGranule));
  // A fresh mapping is not accessible until set_access again.
  device.unmap(base, kGranule);
  device.map(base, kGranule, a);
  EXPECT_FALSE(device.is_accessible(base));
}

// What the CUDA driver did on an H100 when one thread unmapped an alias of a chunk between
// another thread's cuMemMap and cuMemSetAccess of that chunk: the chunk's next map failed with
// CUDA_ERROR_UNKNOWN. The simulated device breaks the chunk the same way, from any thread.
TEST(SimDevice, UnmappingAnAliasWhileAnotherAwaitsAccessBreaksTheChunk) {
  SimulatedDevice device;
  const DevicePtr base = device.reserve_address(8 * kGranule, 0);
  const ChunkHandle safe = device.create_chunk(kGranule);
  const ChunkHandle broken = device.create_chunk(kGranule);
  // The safe order: the new alias gets its access before the old one goes.
  device.map(base, kGranule, safe);
  device.set_access(base, kGranule);
  device.map(base + kGranule, kGranule, safe);
  device.set_access(base + kGranule, kGranule);
  device.unmap(base, kGranule);
  device.map(base + 2 * kGranule, kGranule, safe);
  // Unmapping the alias that awaits access itself (a failed malloc's rollback) is safe too.
  device.unmap(base + 2 * kGranule, kGranule);
  device.map(base + 2 * kGranule, kGranule, safe);
  EXPECT_EQ(device.unsafe_alias_unmaps(), 0u);
  // The unsafe order.
  device.map(base + 4 * kGranule, kGranule, broken);
  device.set_access(base + 4 * kGranule, kGranule);
  device.map(base + 5 * kGranule, kGranule, broken);
  device.unmap(base + 4 * kGranule, kGranule);
  EXPECT_EQ(device.unsafe_alias_unmaps(), 1u);
  device.set_access(base + 5 * kGranule, kGranule);  // too late
  const DeviceError e =
      expect_device_error([&] { device.map(base + 6 * kGranule, kGranule, broken); }, "cuMemMap");
  EXPECT_EQ(e.result(), 999) << e.what();
  EXPECT_FALSE(device.is_mapped(base + 6 * kGranule));
  // Other chunks map on, and the broken one can still be unmapped and released.
  device.map(base + 6 * kGranule, kGranule, device.create_chunk(kGranule));
  device.unmap(base + 5 * kGranule, kGranule);
  device.release_chunk(broken);
  EXPECT_EQ(device.unsafe_alias_unmaps(), 1u);
  EXPECT_EQ(device.chunk_at(base + 5 * kGranule), 0u);
}

TEST(SimDevice, RunsOutOfMemoryAtCapacity) {
  SimDeviceOptions options;
  options.capacity = 10 * kGranule;
  options.used_by_others = 3 * kGranule;
  SimulatedDevice device(options);
  EXPECT_EQ(device.mem_info().total, 10 * kGranule);
  EXPECT_EQ(device.mem_info().free, 7 * kGranule);

  std::vector<ChunkHandle> chunks;
  for (int i = 0; i < 3; ++i) chunks.push_back(device.create_chunk(2 * kGranule));
  EXPECT_EQ(device.mem_info().free, kGranule);
  const DeviceError error = expect_device_error([&] { device.create_chunk(2 * kGranule); },
                                                "cuMemCreate");
  EXPECT_TRUE(error.device_out_of_memory());
  EXPECT_EQ(error.result(), 2);
  EXPECT_EQ(device.chunk_bytes(), 6 * kGranule);  // the failed call changed nothing

  chunks.push_back(device.create_chunk(kGranule));  // exactly fills the device
  EXPECT_EQ(device.mem_info().free, 0u);
  device.release_chunk(chunks.front());
  EXPECT_EQ(device.mem_info().free, 2 * kGranule);
  EXPECT_EQ(device.chunk_bytes(), 5 * kGranule);
  expect_device_error([&] { device.create_chunk(kGranule / 2); }, "cuMemCreate");
}

TEST(SimDevice, CountsEveryCall) {
  SimulatedDevice device;
  const DevicePtr base = device.reserve_address(2 * kGranule, 0);
  const ChunkHandle chunk = device.create_chunk(kGranule);
  device.map(base, kGranule, chunk);
  device.set_access(base, kGranule);
  EXPECT_THROW(device.map(base, kGranule, chunk), DeviceError);  // failed calls count too
  device.unmap(base, kGranule);
  device.release_chunk(chunk);
  device.mem_info();
  const EventHandle event = device.create_event();
  device.record_event(event, 7);
  device.query_event(event);
  device.synchronize_event(event);
  device.wait_event(8, event);
  device.destroy_event(event);

  EXPECT_EQ(device.calls(DeviceCall::reserve_address), 1u);
  EXPECT_EQ(device.calls(DeviceCall::create_chunk), 1u);
  EXPECT_EQ(device.calls(DeviceCall::map), 2u);
  EXPECT_EQ(device.calls(DeviceCall::set_access), 1u);
  EXPECT_EQ(device.calls(DeviceCall::unmap), 1u);
  EXPECT_EQ(device.calls(DeviceCall::release_chunk), 1u);
  EXPECT_EQ(device.calls(DeviceCall::release_address), 0u);
  EXPECT_EQ(device.calls(DeviceCall::mem_info), 1u);
  EXPECT_EQ(device.calls(DeviceCall::create_event), 1u);
  EXPECT_EQ(device.calls(DeviceCall::record_event), 1u);
  EXPECT_EQ(device.calls(DeviceCall::query_event), 1u);
  EXPECT_EQ(device.calls(DeviceCall::synchronize_event), 1u);
  EXPECT_EQ(device.calls(DeviceCall::wait_event), 1u);
  EXPECT_EQ(device.calls(DeviceCall::destroy_event), 1u);

  device.reset_call_counts();
  for (int i = 0; i < static_cast<int>(DeviceCall::count_); ++i) {
    EXPECT_EQ(device.calls(static_cast<DeviceCall>(i)), 0u) << i;
  }
}

TEST(SimDevice, FailsTheNthCall) {
  SimulatedDevice device;
  const DevicePtr base = device.reserve_address(8 * kGranule, 0);
  device.fail_call(DeviceCall::map, 3);
  std::vector<ChunkHandle> chunks;
  for (int i = 0; i < 5; ++i) chunks.push_back(device.create_chunk(kGranule));
  device.map(base, kGranule, chunks[0]);
  device.map(base + kGranule, kGranule, chunks[1]);
  const DeviceError error =
      expect_device_error([&] { device.map(base + 2 * kGranule, kGranule, chunks[2]); }, "cuMemMap");
  EXPECT_EQ(error.result(), 999);
  EXPECT_FALSE(error.device_out_of_memory());
  EXPECT_FALSE(device.is_mapped(base + 2 * kGranule));
  // Only once: the retry and later calls succeed.
  device.map(base + 2 * kGranule, kGranule, chunks[2]);
  device.map(base + 3 * kGranule, kGranule, chunks[3]);
  EXPECT_EQ(device.calls(DeviceCall::map), 5u);

  // Out-of-memory flavour, counted from the call after fail_call.
  device.fail_call(DeviceCall::create_chunk, 1, /*out_of_memory=*/true);
  const DeviceError oom = expect_device_error([&] { device.create_chunk(kGranule); }, "cuMemCreate");
  EXPECT_TRUE(oom.device_out_of_memory());
  EXPECT_EQ(oom.result(), 2);
  EXPECT_EQ(device.chunk_bytes(), 5 * kGranule);

  // nth = 0 cancels; other calls are unaffected by a failure set on one kind.
  device.fail_call(DeviceCall::unmap, 1);
  device.fail_call(DeviceCall::unmap, 0);
  device.unmap(base, kGranule);
  device.fail_call(DeviceCall::release_chunk, 2);
  device.release_chunk(chunks[0]);
  expect_device_error([&] { device.release_chunk(chunks[4]); }, "cuMemRelease");
  device.release_chunk(chunks[4]);
}

TEST(SimDevice, PendingFailureSurvivesCountReset) {
  SimulatedDevice device;
  device.mem_info();
  device.mem_info();
  device.fail_call(DeviceCall::mem_info, 2);
  device.reset_call_counts();
  device.mem_info();
  expect_device_error([&] { device.mem_info(); }, "cuMemGetInfo");
  device.mem_info();
  EXPECT_EQ(device.calls(DeviceCall::mem_info), 3u);
}

TEST(SimDevice, EventsCompleteAtOnceByDefault) {
  SimulatedDevice device;
  const EventHandle event = device.create_event();
  device.submit_work(1);
  device.record_event(event, 1);
  device.submit_work(1);
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

  device.submit_work(stream);
  const EventHandle first = device.create_event();
  device.record_event(first, stream);
  device.submit_work(stream);
  const EventHandle second = device.create_event();
  device.record_event(second, stream);
  const EventHandle elsewhere = device.create_event();
  device.submit_work(other);
  device.record_event(elsewhere, other);
  EXPECT_FALSE(device.query_event(first));
  EXPECT_FALSE(device.query_event(second));

  // Synchronizing on `first` runs the stream up to it, not to `second`.
  device.synchronize_event(first);
  EXPECT_TRUE(device.query_event(first));
  EXPECT_FALSE(device.query_event(second));
  EXPECT_FALSE(device.query_event(elsewhere));

  device.complete_stream(stream);
  EXPECT_TRUE(device.query_event(second));
  EXPECT_FALSE(device.query_event(elsewhere));

  // Re-recording moves the event to the stream's latest work.
  device.submit_work(stream);
  device.record_event(first, stream);
  EXPECT_FALSE(device.query_event(first));
  EXPECT_TRUE(device.query_event(second));

  device.complete_all_streams();
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
  EXPECT_FALSE(device.ordered_after(b, a, 1));

  device.submit_work(a);
  device.record_event(on_a, a);
  EXPECT_FALSE(device.ordered_after(b, a, device.submitted(a)));
  device.wait_event(b, on_a);
  EXPECT_TRUE(device.ordered_after(b, a, 1));
  EXPECT_FALSE(device.ordered_after(a, b, 1));  // not the other way
  device.submit_work(a);
  device.record_event(on_a, a);  // recorded again: b still waits for the first record only
  EXPECT_FALSE(device.ordered_after(b, a, 2));

  device.submit_work(b);
  device.record_event(on_b, b);
  device.wait_event(c, on_b);  // c after b, and so after a's first kernel
  EXPECT_TRUE(device.ordered_after(c, b, 1));
  EXPECT_TRUE(device.ordered_after(c, a, 1));
  EXPECT_FALSE(device.ordered_after(c, a, 2));

  // b's stream finishing means the work it waited for finished too (a's first kernel), not the
  // rest of a's.
  EXPECT_FALSE(device.query_event(on_b));
  device.complete_stream(b);
  EXPECT_TRUE(device.query_event(on_b));
  EXPECT_TRUE(device.ordered_after(a + 10, a, 1));  // done: any stream comes after it
  EXPECT_FALSE(device.query_event(on_a));
  EXPECT_EQ(device.calls(DeviceCall::wait_event), 3u);
  EXPECT_THROW(device.wait_event(a, 12345), DeviceError);
}

TEST(SimDeviceLag, AWaitingStreamsEventsCompleteNoEarlierThanTheEventWaitedFor) {
  SimDeviceOptions options;
  options.lag_us = 1000;
  SimulatedDevice device(options);
  const EventHandle slow = device.create_event();
  const EventHandle after = device.create_event();
  device.record_event(slow, 1);  // completes at 1000
  device.set_lag(10);
  device.wait_event(2, slow);
  device.record_event(after, 2);  // 10 behind the host, but after `slow`
  device.set_host_time(500);
  EXPECT_FALSE(device.query_event(after));
  device.set_host_time(1000);
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
  EXPECT_EQ(device.lag(), 100.0);
  device.set_host_time(1000);
  const EventHandle event = device.create_event();
  EXPECT_TRUE(device.query_event(event));  // never recorded: complete, as with cuEventQuery
  device.record_event(event, 7);
  EXPECT_FALSE(device.query_event(event));
  device.set_host_time(1099.5);
  EXPECT_FALSE(device.query_event(event));
  device.set_host_time(1100);
  EXPECT_TRUE(device.query_event(event));
  device.advance_host_time(5000);
  EXPECT_TRUE(device.query_event(event));
  // Re-recording moves it to the host's present.
  device.record_event(event, 7);
  EXPECT_FALSE(device.query_event(event));
  EXPECT_EQ(device.modelled_wait_us(), 0.0);  // queries never wait
}

TEST(SimDeviceLag, HostClockNeverRunsBackwards) {
  SimulatedDevice device = lagging_device(100);
  EXPECT_EQ(device.host_time(), 0.0);
  device.set_host_time(250);
  device.set_host_time(50);
  EXPECT_EQ(device.host_time(), 250.0);
  device.advance_host_time(-10);
  EXPECT_EQ(device.host_time(), 250.0);
  device.advance_host_time(25.5);
  EXPECT_EQ(device.host_time(), 275.5);
}

TEST(SimDeviceLag, SynchronizeMovesTheHostClockAndCountsTheWait) {
  SimulatedDevice device = lagging_device(100);
  device.set_host_time(1000);
  const EventHandle mine = device.create_event();
  const EventHandle other = device.create_event();
  device.record_event(mine, 1);
  device.record_event(other, 2);
  device.set_host_time(1030);
  device.synchronize_event(mine);
  EXPECT_EQ(device.host_time(), 1100.0);
  EXPECT_EQ(device.modelled_wait_us(), 70.0);
  EXPECT_TRUE(device.query_event(mine));
  EXPECT_TRUE(device.query_event(other));  // the other stream ran on meanwhile
  // Waiting on a complete event (or one never recorded) costs nothing.
  device.synchronize_event(mine);
  device.synchronize_event(device.create_event());
  EXPECT_EQ(device.host_time(), 1100.0);
  EXPECT_EQ(device.modelled_wait_us(), 70.0);
  // Waits add up.
  device.record_event(mine, 1);
  device.synchronize_event(mine);
  EXPECT_EQ(device.host_time(), 1200.0);
  EXPECT_EQ(device.modelled_wait_us(), 170.0);
}

TEST(SimDeviceLag, StreamsCompleteInOrder) {
  SimulatedDevice device = lagging_device(1000);
  const StreamId stream = 1, other = 2;
  const EventHandle early = device.create_event();
  const EventHandle late = device.create_event();
  const EventHandle elsewhere = device.create_event();
  device.record_event(early, stream);  // at 0: completes at 1000
  // The GPU catches up (a lighter phase): later events lag less, but not past earlier ones.
  device.set_lag(10);
  device.set_host_time(100);
  device.record_event(late, stream);      // 110, held back to 1000 by `early`
  device.record_event(elsewhere, other);  // 110: another stream is not held back
  device.set_host_time(500);
  EXPECT_TRUE(device.query_event(elsewhere));
  EXPECT_FALSE(device.query_event(early));
  EXPECT_FALSE(device.query_event(late));
  device.synchronize_event(late);
  EXPECT_EQ(device.host_time(), 1000.0);
  EXPECT_TRUE(device.query_event(early));
  EXPECT_EQ(device.modelled_wait_us(), 500.0);
}

TEST(SimDeviceLag, ZeroLagCompletesEventsWhenRecorded) {
  SimulatedDevice device = lagging_device(0);
  device.set_host_time(1000);
  const EventHandle event = device.create_event();
  device.record_event(event, 3);
  EXPECT_TRUE(device.query_event(event));
  device.synchronize_event(event);
  EXPECT_EQ(device.host_time(), 1000.0);
  EXPECT_EQ(device.modelled_wait_us(), 0.0);
}

TEST(SimDeviceLag, CombinesWithWorkCompletedByHand) {
  SimDeviceOptions options;
  options.streams_complete_immediately = false;
  options.lag_us = 100;
  SimulatedDevice device(options);
  const StreamId stream = 9;
  device.submit_work(stream);
  const EventHandle event = device.create_event();
  device.record_event(event, stream);
  device.set_host_time(200);
  EXPECT_FALSE(device.query_event(event));  // its time has come, its work is not done
  device.complete_stream(stream);
  EXPECT_TRUE(device.query_event(event));

  device.submit_work(stream);
  device.record_event(event, stream);  // at 200: completes at 300
  device.complete_stream(stream);
  EXPECT_FALSE(device.query_event(event));  // the work is done, its time has not come
  device.synchronize_event(event);
  EXPECT_EQ(device.host_time(), 300.0);
  EXPECT_EQ(device.modelled_wait_us(), 100.0);
}

TEST(SimDeviceLag, RejectsBadLags) {
  for (double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    SimDeviceOptions options;
    options.lag_us = bad;
    EXPECT_THROW(SimulatedDevice{options}, Error) << bad;
    SimulatedDevice device;
    EXPECT_THROW(device.set_lag(bad), Error) << bad;
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
  EXPECT_EQ(device.modelled_call_us(), 0.0);
  const DevicePtr base = device.reserve_address(8 * kGranule, 0);
  device.mem_info();
  EXPECT_EQ(device.modelled_call_us(), 0.0);  // not priced

  double expected = 0;
  auto expect_total = [&](double added, const char* what) {
    expected += added;
    EXPECT_DOUBLE_EQ(device.modelled_call_us(), expected) << what;
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
  EXPECT_EQ(device.modelled_wait_us(), 0.0);  // no lag: nothing to wait for

  device.reset_call_counts();  // the account follows the counts
  EXPECT_EQ(device.modelled_call_us(), 0.0);
}

TEST(SimDevice, TracksLiveEvents) {
  SimulatedDevice device;
  const EventHandle a = device.create_event();
  const EventHandle b = device.create_event();
  EXPECT_NE(a, b);
  EXPECT_EQ(device.live_events(), 2u);
  device.destroy_event(a);
  EXPECT_EQ(device.live_events(), 1u);
  expect_device_error([&] { device.destroy_event(a); }, "cuEventDestroy");
  expect_device_error([&] { device.record_event(a, 0); }, "cuEventRecord");
  expect_device_error([&] { device.query_event(a); }, "cuEventQuery");
  expect_device_error([&] { device.synchronize_event(a); }, "cuEventSynchronize");
}

TEST(SimDevice, NamesCallsAfterCuda) {
  EXPECT_STREQ(device_call_name(DeviceCall::map), "cuMemMap");
  EXPECT_STREQ(device_call_name(DeviceCall::create_chunk), "cuMemCreate");
  std::set<std::string> names;
  for (int i = 0; i < static_cast<int>(DeviceCall::count_); ++i) {
    names.insert(device_call_name(static_cast<DeviceCall>(i)));
  }
  EXPECT_EQ(names.size(), static_cast<std::size_t>(DeviceCall::count_));
}

// Several threads map, unmap and count at once: totals must come out exact (and TSan clean).
TEST(SimDeviceThreads, ConcurrentCallsKeepBookkeepingExact) {
  SimulatedDevice device;
  constexpr int kThreads = 4;
  constexpr int kRounds = 200;
  const DevicePtr base = device.reserve_address(kThreads * 4 * kGranule, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const DevicePtr mine = base + static_cast<std::size_t>(t) * 4 * kGranule;
      for (int round = 0; round < kRounds; ++round) {
        const ChunkHandle chunk = device.create_chunk(2 * kGranule);
        device.map(mine, 2 * kGranule, chunk);
        device.set_access(mine, 2 * kGranule);
        const EventHandle event = device.create_event();
        device.submit_work(static_cast<StreamId>(t + 1));
        device.record_event(event, static_cast<StreamId>(t + 1));
        EXPECT_TRUE(device.query_event(event));
        device.destroy_event(event);
        device.unmap(mine, 2 * kGranule);
        device.release_chunk(chunk);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(device.calls(DeviceCall::map), std::uint64_t{kThreads * kRounds});
  // Per round: create, map, set access, unmap and release one chunk of 2 granules (priced per
  // chunk and per further granule); four event calls.
  const double round_us = (15 + 0.04) + 2 + (38 + 0.04) + (22 + 0.01) + (16 + 0.76) + (1 + 1 + 0.5 + 1);
  EXPECT_NEAR(device.modelled_call_us(), kThreads * kRounds * round_us, 1e-6);
  EXPECT_EQ(device.calls(DeviceCall::release_chunk), std::uint64_t{kThreads * kRounds});
  EXPECT_EQ(device.chunk_bytes(), 0u);
  EXPECT_EQ(device.mapped_bytes(), 0u);
  EXPECT_EQ(device.live_events(), 0u);
}

}  // namespace
}  // namespace gmem
