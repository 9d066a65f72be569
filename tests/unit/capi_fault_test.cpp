// Fault injection through the C API: the real gmem_c.cpp and observe_c.cpp (status codes,
// gmem_last_error, tracking, OOM reports) over a test registry whose one device is a
// SimulatedDevice the test can make fail (libgmem.so's registry keeps its device to itself).
// A trace's mallocs and frees go through gmem_malloc / gmem_free / gmem_record_stream, with
// gmem_empty_cache and limit changes, tracking on, while one kind of device call fails at its
// 1st, 3rd, 10th, ... call. Each failure must come back as a status (GMEM_ERROR_DEVICE, or
// GMEM_ERROR_OUT_OF_MEMORY when the device said so) with a message naming the function and the
// failed call; the engine's stats must match what the caller holds, and the call must succeed
// when made again.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "capi/registry.hpp"
#include "fault_harness.hpp"
#include "gmem/error.hpp"
#include "gmem/gmem.h"
#include "gmem/gmem_observe.h"
#include "gmem/sim_device.hpp"

// The test registry: one context over a SimulatedDevice, replaced for each run.
namespace gmem::capi {
namespace {
std::unique_ptr<DeviceContext> g_context;
}  // namespace

DeviceContext& context(int device) {
  if (device != 0 && device != -1) throw Error(Errc::invalid_argument, "device " + std::to_string(device) + " does not exist");
  return *g_context;
}
gmem_engine* owner(const void*) { return g_context ? &g_context->handle : nullptr; }
gmem_engine* likely_owner(const void* ptr) { return owner(ptr); }
void for_each_context(const std::function<void(DeviceContext&)>& visit) {
  if (g_context) visit(*g_context);
}
}  // namespace gmem::capi

namespace gmem {
namespace {

using testing::all_faults;
using testing::Fault;
using testing::fault_name;

constexpr std::size_t kCapacity = std::size_t{80} << 30;
constexpr std::uint64_t kPoints[] = {1, 3, 10, 30, 100, 300, 1000, 3000};


std::int64_t stat(const char* name) {
  std::int64_t value = -1;
  EXPECT_EQ(gmem_stat(0, name, &value), GMEM_OK) << gmem_last_error();
  return value;
}

class CApiFault : public ::testing::TestWithParam<Fault> {};

TEST_P(CApiFault, TraceThroughTheCApiSurvivesEveryInjectedFailure) {
  const Fault fault = GetParam();
  const trace::Trace t = trace::read_trace(std::string(GMEM_TEST_DATA) + "/two_streams.trace.csv.gz");
  const testing::TraceProgram program = testing::compile_trace(t);

  SimDeviceOptions o;
  o.capacity = kCapacity;
  o.lag_us = 2000;
  auto sim = std::make_unique<SimulatedDevice>(o);
  SimulatedDevice& device = *sim;
  capi::g_context = std::make_unique<capi::DeviceContext>();
  capi::g_context->device = std::move(sim);
  capi::g_context->engine = std::make_unique<Engine>(device);
  capi::g_context->handle.context = capi::g_context.get();
  capi::g_context->handle.engine = capi::g_context->engine.get();
  ASSERT_EQ(gmem_tracking_enable(0, 0, 0), GMEM_OK) << gmem_last_error();

  std::size_t point = 0;
  std::uint64_t armed_at = 0;
  auto arm = [&] {
    if (point >= std::size(kPoints)) return;
    const std::uint64_t calls = device.ledger().calls(fault.call);
    armed_at = std::max(kPoints[point], calls + 1);
    device.ledger().fail_call(fault.call, armed_at - calls, fault.oom);
  };
  arm();
  std::uint64_t injected = 0, surfaced = 0;
  std::int64_t held = 0;  // bytes the caller holds, rounded as the engine counts them
  std::string where;

  // A failed call: a status, a message naming the function and the device call; then the state
  // is consistent and the same call succeeds.
  auto call = [&](const char* function, const std::function<gmem_status_t()>& f) {
    const gmem_status_t status = f();
    if (status == GMEM_OK) return;
    const std::string message = gmem_last_error();
    ++surfaced;
    EXPECT_EQ(message.rfind(std::string(function) + ": ", 0), 0u) << where << message;
    if (fault.oom) {
      EXPECT_EQ(status, GMEM_ERROR_OUT_OF_MEMORY) << where << message;
      EXPECT_NE(message.find("out of memory"), std::string::npos) << where << message;
      EXPECT_NE(message.find("(device)"), std::string::npos) << where << message;
    } else {
      EXPECT_EQ(status, GMEM_ERROR_DEVICE) << where << message;
      EXPECT_NE(message.find(device_call_name(fault.call)), std::string::npos) << where << message;
    }
    capi::g_context->engine->check_invariants();
    EXPECT_EQ(stat("allocated_bytes.all.current"), held) << where;
    EXPECT_EQ(static_cast<std::int64_t>(device.memory().chunk_bytes()),
              stat("reserved_bytes.all.current"))
        << where;
    ASSERT_EQ(f(), GMEM_OK) << where << "retried after: " << message << "; now: " << gmem_last_error();
  };

  std::vector<void*> blocks(program.slots, nullptr);
  std::vector<std::int64_t> sizes(program.slots, 0);
  for (std::size_t i = 0; i < program.ops.size() && !HasFatalFailure(); ++i) {
    const testing::TraceOp& op = program.ops[i];
    where = fault_name(fault) + " at call " + std::to_string(armed_at) + ", op " + std::to_string(i) + ": ";
    device.ledger().advance_host_time(op.host_advance_us);
    if (op.malloc) {
      call("gmem_malloc", [&] { return gmem_malloc(&blocks[op.slot], op.size, 0, op.stream); });
      sizes[op.slot] = static_cast<std::int64_t>((op.size + 511) / 512 * 512);
      held += sizes[op.slot];
      if (i % 5 == 0) EXPECT_EQ(gmem_record_stream(blocks[op.slot], 0x51d0), GMEM_OK);
    } else {
      call("gmem_free", [&] { return gmem_free(blocks[op.slot]); });
      held -= sizes[op.slot];
      blocks[op.slot] = nullptr;
    }
    if (i % 300 == 299) call("gmem_empty_cache", [&] { return gmem_empty_cache(0); });
    if (i % 400 == 199) {
      call("gmem_set_memory_limit", [&] {
        return gmem_set_memory_limit(0, static_cast<std::size_t>(stat("reserved_bytes.all.current")) / 2);
      });
      call("gmem_set_memory_limit", [&] { return gmem_set_memory_limit(0, 0); });
    }
    if (point < std::size(kPoints) && device.ledger().calls(fault.call) >= armed_at) {
      ++injected;
      ++point;
      arm();
    }
  }
  where = fault_name(fault) + " at call " + std::to_string(armed_at) + ", freeing what is left: ";
  for (std::size_t slot = 0; slot < blocks.size(); ++slot) {
    if (blocks[slot] == nullptr) continue;
    call("gmem_free", [&] { return gmem_free(blocks[slot]); });
    held -= sizes[slot];
  }
  call("gmem_empty_cache", [&] { return gmem_empty_cache(0); });
  if (point < std::size(kPoints) && device.ledger().calls(fault.call) >= armed_at) ++injected;
  device.ledger().fail_call(fault.call, 0);

  EXPECT_EQ(stat("allocated_bytes.all.current"), 0);
  EXPECT_EQ(device.memory().chunk_bytes(), 0u);
  std::size_t needed = 0;
  EXPECT_EQ(gmem_snapshot_json(0, nullptr, 0, &needed), GMEM_OK) << gmem_last_error();
  EXPECT_EQ(gmem_memory_summary(0, nullptr, 0, &needed), GMEM_OK) << gmem_last_error();
  capi::g_context->engine->check_invariants();
  ASSERT_EQ(gmem_tracking_disable(0), GMEM_OK);
  capi::g_context->engine.reset();
  EXPECT_EQ(device.memory().chunk_bytes(), 0u);
  EXPECT_EQ(device.memory().reserved_address_bytes(), 0u);
  EXPECT_EQ(device.streams().live_events(), 0u);
  capi::g_context.reset();
  // cuMemAddressFree is made only when an engine is destroyed, cuMemGetInfo when one starts or
  // runs out of memory: neither happens while this trace runs.
  if (fault.call != DeviceCall::release_address && fault.call != DeviceCall::mem_info)
    EXPECT_GT(injected, 0u);
  std::printf("C API, %s: %llu failures injected, %llu returned as a status\n", fault_name(fault).c_str(),
              static_cast<unsigned long long>(injected), static_cast<unsigned long long>(surfaced));
}

INSTANTIATE_TEST_SUITE_P(EveryCall, CApiFault, ::testing::ValuesIn(all_faults()),
                         [](const auto& info) { return fault_name(info.param); });

}  // namespace
}  // namespace gmem
