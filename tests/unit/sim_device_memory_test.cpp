// SimulatedDevice's memory calls: strict about misuse, exact call counts, injected failures,
// memory capacity, CUDA's call names, and exact bookkeeping under threads.
#include "gmem/sim_device.hpp"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmem/error.hpp"
#include "sim_device_test_support.hpp"

namespace gmem {
namespace {

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
  EXPECT_EQ(device.memory().reserved_address_bytes(), 74 * kMiB);
  device.release_address(b, 8 * kMiB);
  EXPECT_EQ(device.memory().reserved_address_bytes(), 66 * kMiB);
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
  EXPECT_EQ(device.memory().reserved_address_bytes(), 0u);
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
  EXPECT_TRUE(device.memory().is_mapped(base + 3 * kGranule));
  EXPECT_TRUE(device.memory().is_mapped(base + 5 * kGranule - 1));
  EXPECT_FALSE(device.memory().is_mapped(base + 5 * kGranule));
  EXPECT_EQ(device.memory().chunk_at(base + 4 * kGranule + 12345), two);
  EXPECT_EQ(device.memory().chunk_at(base), 0u);
  EXPECT_EQ(device.memory().mapped_bytes(), 2 * kGranule);

  // Outside or straddling the reservation, misaligned, wrong size, unknown chunk, double map.
  expect_device_error([&] { device.map(base - kGranule, kGranule, one); }, "cuMemMap");
  expect_device_error([&] { device.map(base + 8 * kGranule, kGranule, one); }, "cuMemMap");
  expect_device_error([&] { device.map(base + 7 * kGranule, 2 * kGranule, two); }, "cuMemMap");
  expect_device_error([&] { device.map(base + 512, kGranule, one); }, "cuMemMap");
  expect_device_error([&] { device.map(base, 2 * kGranule, one); }, "cuMemMap");
  expect_device_error([&] { device.map(base, kGranule, 999); }, "cuMemMap");
  expect_device_error([&] { device.map(base + 4 * kGranule, kGranule, one); }, "cuMemMap");
  EXPECT_EQ(device.memory().mapped_bytes(), 2 * kGranule);
  EXPECT_FALSE(device.memory().is_mapped(base));

  // The same chunk may be mapped twice (CUDA allows aliases).
  device.map(base, kGranule, one);
  device.map(base + kGranule, kGranule, one);
  EXPECT_EQ(device.memory().chunk_at(base + kGranule), one);
  EXPECT_EQ(device.memory().mapped_bytes(), 4 * kGranule);
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
  EXPECT_EQ(device.memory().mapped_bytes(), 3 * kGranule);

  device.unmap(base, 3 * kGranule);  // two whole mappings at once
  EXPECT_EQ(device.memory().mapped_bytes(), 0u);
  EXPECT_FALSE(device.memory().is_mapped(base + kGranule));
  expect_device_error([&] { device.unmap(base, 2 * kGranule); }, "cuMemUnmap");
  device.release_chunk(big);
  device.release_chunk(small);
  EXPECT_EQ(device.memory().chunk_bytes(), 0u);
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
  EXPECT_EQ(device.memory().reserved_address_bytes(), 0u);
}

TEST(SimDevice, SetAccessNeedsMappedGranules) {
  SimulatedDevice device;
  const DevicePtr base = device.reserve_address(4 * kGranule, 0);
  const ChunkHandle a = device.create_chunk(kGranule);
  const ChunkHandle b = device.create_chunk(kGranule);
  device.map(base, kGranule, a);
  device.map(base + kGranule, kGranule, b);
  EXPECT_FALSE(device.memory().is_accessible(base));
  expect_device_error([&] { device.set_access(base + kGranule, 2 * kGranule); }, "cuMemSetAccess");
  EXPECT_FALSE(device.memory().is_accessible(base + kGranule));
  device.set_access(base, 2 * kGranule);  // spans two mappings
  EXPECT_TRUE(device.memory().is_accessible(base + 100));
  EXPECT_TRUE(device.memory().is_accessible(base + kGranule));
  EXPECT_FALSE(device.memory().is_accessible(base + 2 * kGranule));
  // A fresh mapping is not accessible until set_access again.
  device.unmap(base, kGranule);
  device.map(base, kGranule, a);
  EXPECT_FALSE(device.memory().is_accessible(base));
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
  EXPECT_EQ(device.memory().unsafe_alias_unmaps(), 0u);
  // The unsafe order.
  device.map(base + 4 * kGranule, kGranule, broken);
  device.set_access(base + 4 * kGranule, kGranule);
  device.map(base + 5 * kGranule, kGranule, broken);
  device.unmap(base + 4 * kGranule, kGranule);
  EXPECT_EQ(device.memory().unsafe_alias_unmaps(), 1u);
  device.set_access(base + 5 * kGranule, kGranule);  // too late
  const DeviceError e =
      expect_device_error([&] { device.map(base + 6 * kGranule, kGranule, broken); }, "cuMemMap");
  EXPECT_EQ(e.result(), 999) << e.what();
  EXPECT_FALSE(device.memory().is_mapped(base + 6 * kGranule));
  // Other chunks map on, and the broken one can still be unmapped and released.
  device.map(base + 6 * kGranule, kGranule, device.create_chunk(kGranule));
  device.unmap(base + 5 * kGranule, kGranule);
  device.release_chunk(broken);
  EXPECT_EQ(device.memory().unsafe_alias_unmaps(), 1u);
  EXPECT_EQ(device.memory().chunk_at(base + 5 * kGranule), 0u);
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
  EXPECT_EQ(device.memory().chunk_bytes(), 6 * kGranule);  // the failed call changed nothing

  chunks.push_back(device.create_chunk(kGranule));  // exactly fills the device
  EXPECT_EQ(device.mem_info().free, 0u);
  device.release_chunk(chunks.front());
  EXPECT_EQ(device.mem_info().free, 2 * kGranule);
  EXPECT_EQ(device.memory().chunk_bytes(), 5 * kGranule);
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

  EXPECT_EQ(device.ledger().calls(DeviceCall::reserve_address), 1u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::create_chunk), 1u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::map), 2u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::set_access), 1u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::unmap), 1u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::release_chunk), 1u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::release_address), 0u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::mem_info), 1u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::create_event), 1u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::record_event), 1u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::query_event), 1u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::synchronize_event), 1u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::wait_event), 1u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::destroy_event), 1u);

  device.ledger().reset_call_counts();
  for (int i = 0; i < static_cast<int>(DeviceCall::count_); ++i) {
    EXPECT_EQ(device.ledger().calls(static_cast<DeviceCall>(i)), 0u) << i;
  }
}

TEST(SimDevice, FailsTheNthCall) {
  SimulatedDevice device;
  const DevicePtr base = device.reserve_address(8 * kGranule, 0);
  device.ledger().fail_call(DeviceCall::map, 3);
  std::vector<ChunkHandle> chunks;
  for (int i = 0; i < 5; ++i) chunks.push_back(device.create_chunk(kGranule));
  device.map(base, kGranule, chunks[0]);
  device.map(base + kGranule, kGranule, chunks[1]);
  const DeviceError error =
      expect_device_error([&] { device.map(base + 2 * kGranule, kGranule, chunks[2]); }, "cuMemMap");
  EXPECT_EQ(error.result(), 999);
  EXPECT_FALSE(error.device_out_of_memory());
  EXPECT_FALSE(device.memory().is_mapped(base + 2 * kGranule));
  // Only once: the retry and later calls succeed.
  device.map(base + 2 * kGranule, kGranule, chunks[2]);
  device.map(base + 3 * kGranule, kGranule, chunks[3]);
  EXPECT_EQ(device.ledger().calls(DeviceCall::map), 5u);

  // Out-of-memory flavour, counted from the call after fail_call.
  device.ledger().fail_call(DeviceCall::create_chunk, 1, /*out_of_memory=*/true);
  const DeviceError oom = expect_device_error([&] { device.create_chunk(kGranule); }, "cuMemCreate");
  EXPECT_TRUE(oom.device_out_of_memory());
  EXPECT_EQ(oom.result(), 2);
  EXPECT_EQ(device.memory().chunk_bytes(), 5 * kGranule);

  // nth = 0 cancels; other calls are unaffected by a failure set on one kind.
  device.ledger().fail_call(DeviceCall::unmap, 1);
  device.ledger().fail_call(DeviceCall::unmap, 0);
  device.unmap(base, kGranule);
  device.ledger().fail_call(DeviceCall::release_chunk, 2);
  device.release_chunk(chunks[0]);
  expect_device_error([&] { device.release_chunk(chunks[4]); }, "cuMemRelease");
  device.release_chunk(chunks[4]);
}

TEST(SimDevice, PendingFailureSurvivesCountReset) {
  SimulatedDevice device;
  device.mem_info();
  device.mem_info();
  device.ledger().fail_call(DeviceCall::mem_info, 2);
  device.ledger().reset_call_counts();
  device.mem_info();
  expect_device_error([&] { device.mem_info(); }, "cuMemGetInfo");
  device.mem_info();
  EXPECT_EQ(device.ledger().calls(DeviceCall::mem_info), 3u);
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
        device.streams().submit_work(static_cast<StreamId>(t + 1));
        device.record_event(event, static_cast<StreamId>(t + 1));
        EXPECT_TRUE(device.query_event(event));
        device.destroy_event(event);
        device.unmap(mine, 2 * kGranule);
        device.release_chunk(chunk);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(device.ledger().calls(DeviceCall::map), std::uint64_t{kThreads * kRounds});
  // Per round: create, map, set access, unmap and release one chunk of 2 granules (priced per
  // chunk and per further granule); four event calls.
  const double round_us = (15 + 0.04) + 2 + (38 + 0.04) + (22 + 0.01) + (16 + 0.76) + (1 + 1 + 0.5 + 1);
  EXPECT_NEAR(device.ledger().modelled_call_us(), kThreads * kRounds * round_us, 1e-6);
  EXPECT_EQ(device.ledger().calls(DeviceCall::release_chunk), std::uint64_t{kThreads * kRounds});
  EXPECT_EQ(device.memory().chunk_bytes(), 0u);
  EXPECT_EQ(device.memory().mapped_bytes(), 0u);
  EXPECT_EQ(device.streams().live_events(), 0u);
}

}  // namespace
}  // namespace gmem
