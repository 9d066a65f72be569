// A driver call can fail anywhere (a map in the middle of a stitch, an event record in a free):
// inject a failure at every kind of device call and check that the engine reports it and
// keeps every invariant, loses no memory, and goes on working.
#include <gtest/gtest.h>

#include <vector>

#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"
#include "sim_calls.hpp"

namespace gmem {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

// Exercises creates, maps, set_access, stitching (unmaps), events, trims and releases.
int run_workload(SimulatedDevice& device, Engine& engine) {
  int errors = 0;
  std::vector<void*> live;
  auto attempt = [&](auto&& op) {
    try {
      op();
    } catch (const Error&) {
      ++errors;
    }
    engine.check_invariants();
    EXPECT_EQ(engine.stats().reserved_bytes[kAllPools].current,
              static_cast<std::int64_t>(device.memory().chunk_bytes()));
  };
  for (int round = 0; round < 3; ++round) {
    for (std::size_t size : {6 * MiB, std::size_t{300 * 1024 + 5}, std::size_t{4097}, 10 * MiB, 2 * MiB})
      attempt([&] { live.push_back(engine.malloc(size, round % 2)); });
    if (!live.empty()) attempt([&] { engine.record_stream(live.front(), 9); });
    while (live.size() > 2) {
      void* p = live.back();
      live.pop_back();
      attempt([&] {
        try {
          engine.free(p);
        } catch (const Error&) {
          live.insert(live.begin(), p);  // a failed free leaves p live: free it later
          throw;
        }
      });
    }
    attempt([&] { live.push_back(engine.malloc(24 * MiB, 1 - round % 2)); });  // must stitch
    attempt([&] { engine.set_memory_limit(24 * MiB); });
    attempt([&] { engine.set_memory_limit(0); });
    attempt([&] { engine.empty_cache(); });
  }
  for (void* p : live) attempt([&] { engine.free(p); });
  return errors;
}

class EngineFailure : public ::testing::TestWithParam<DeviceCall> {};

TEST_P(EngineFailure, EveryInjectedFailureIsReportedAndRecoveredFrom) {
  const DeviceCall call = GetParam();
  int reported = 0;
  for (std::uint64_t nth : {1, 2, 3, 5, 8, 13, 21}) {
    SimDeviceOptions o;
    o.capacity = 48 * MiB;
    SimulatedDevice device(o);
    std::uint64_t before = 0;
    try {
      Engine engine(device);
      device.ledger().fail_call(call, nth);
      before = device.ledger().calls(call);
      reported += run_workload(device, engine);
      // The injected failure is spent: the engine works normally again.
      device.ledger().fail_call(call, 0);
      void* p = engine.malloc(40 * MiB);
      engine.free(p);
      engine.empty_cache();
      engine.check_invariants();
    } catch (const DeviceError&) {
      ++reported;  // the constructor's mem_info() failed: nothing to recover
    }
    EXPECT_EQ(device.memory().chunk_bytes(), 0u)
        << "chunks leaked, call " << device_call_name(call);
    EXPECT_EQ(device.memory().reserved_address_bytes(), 0u);
    (void)before;
  }
  EXPECT_GT(reported, 0) << device_call_name(call) << " was never made to fail";
}

INSTANTIATE_TEST_SUITE_P(
    AllCalls, EngineFailure,
    ::testing::Values(DeviceCall::reserve_address, DeviceCall::create_chunk,
                      DeviceCall::release_chunk, DeviceCall::map, DeviceCall::unmap,
                      DeviceCall::set_access, DeviceCall::create_event, DeviceCall::record_event),
    [](const auto& param_info) { return std::string(device_call_name(param_info.param)); });

TEST(EngineFailure, DeviceOutOfMemoryDuringGrowthFallsBackToStitching) {
  SimDeviceOptions o;
  o.capacity = 64 * MiB;
  SimulatedDevice device(o);
  Engine engine(device);
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(engine.malloc(4 * MiB));
  for (int i = 0; i < 8; i += 2) engine.free(blocks[i]);
  device.ledger().fail_call(DeviceCall::create_chunk, 1, /*out_of_memory=*/true);
  void* p = engine.malloc(12 * MiB);  // creation fails: the freed chunks are remapped instead
  EXPECT_GT(engine.stats().num_stitches, 0);
  engine.free(p);
  engine.check_invariants();
}

}  // namespace
}  // namespace gmem

namespace gmem {
namespace {

// A held free handed back to its stream (record_stream, the device full): should the stream's
// wait for the other stream fail, the malloc reports it, the free stays held, nothing leaks, and
// the next malloc hands it over.
TEST(EngineFailure, AFailedWaitLeavesAHeldFreeHeld) {
  SimDeviceOptions o;
  o.capacity = 8 * MiB;
  o.streams_complete_immediately = false;
  SimulatedDevice device(o);
  Engine engine(device);
  constexpr StreamId compute = 0, side = 5;
  free_held_by(device, engine, 8 * MiB, compute, side);
  device.ledger().fail_call(DeviceCall::wait_event, 1);
  EXPECT_THROW(engine.malloc(8 * MiB, compute), DeviceError);
  engine.check_invariants();
  EXPECT_EQ(engine.stats().pending_free_bytes, static_cast<std::int64_t>(8 * MiB));
  void* q = engine.malloc(8 * MiB, compute);
  EXPECT_TRUE(device.streams().ordered_after(compute, side, device.streams().submitted(side)));
  EXPECT_EQ(engine.stats().pending_free_bytes, 0);
  engine.free(q);
  engine.empty_cache();
  EXPECT_EQ(device.memory().chunk_bytes(), 0u);
  engine.check_invariants();
}

}  // namespace
}  // namespace gmem
