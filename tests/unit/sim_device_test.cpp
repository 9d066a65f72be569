// SimulatedDevice: strict about misuse, exact call counts, injected failures, memory capacity
// and the stream/event model.
#include "gmem/sim_device.hpp"

#include <gtest/gtest.h>

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
  EXPECT_EQ(device.calls(DeviceCall::release_chunk), std::uint64_t{kThreads * kRounds});
  EXPECT_EQ(device.chunk_bytes(), 0u);
  EXPECT_EQ(device.mapped_bytes(), 0u);
  EXPECT_EQ(device.live_events(), 0u);
}

}  // namespace
}  // namespace gmem
