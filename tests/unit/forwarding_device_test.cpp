// ForwardingDevice: every call of Device reaches the inner device, with its arguments, and comes
// back with the inner device's answer (Device's defaults included: none may fall back to them),
// and an engine runs on a ForwardingDevice exactly as on the device under it.
#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/forwarding_device.hpp"
#include "gmem/sim_device.hpp"
#include "engine_test_support.hpp"

namespace gmem {
namespace {

// Answers every call with a value of its own, none of them Device's defaults, and writes down
// each call it gets with its arguments.
class ScriptedDevice final : public Device {
 public:
  // The calls since the last take(), one line each ("map 1 2 3"), and forgets them.
  std::string take() { return std::exchange(log_, ""); }

  std::size_t granularity() const override {
    note("granularity");
    return 3 * MiB;
  }
  DeviceMemInfo mem_info() override {
    note("mem_info");
    return {5, 7};
  }
  std::string name() const override {
    note("name");
    return "scripted";
  }
  int index() const override {
    note("index");
    return 4;
  }
  DevicePtr reserve_address(std::size_t size, std::size_t alignment) override {
    note("reserve_address", size, alignment);
    return 0x1000;
  }
  void release_address(DevicePtr base, std::size_t size) override {
    note("release_address", base, size);
  }
  ChunkHandle create_chunk(std::size_t size) override {
    note("create_chunk", size);
    return 11;
  }
  void release_chunk(ChunkHandle chunk) override { note("release_chunk", chunk); }
  void map(DevicePtr va, std::size_t size, ChunkHandle chunk) override {
    note("map", va, size, chunk);
  }
  void unmap(DevicePtr va, std::size_t size) override { note("unmap", va, size); }
  void set_access(DevicePtr va, std::size_t size) override { note("set_access", va, size); }
  EventHandle create_event() override {
    note("create_event");
    return 13;
  }
  void destroy_event(EventHandle event) override { note("destroy_event", event); }
  void record_event(EventHandle event, StreamId stream) override {
    note("record_event", event, stream);
  }
  bool query_event(EventHandle event) override {
    note("query_event", event);
    return true;
  }
  void synchronize_event(EventHandle event) override { note("synchronize_event", event); }
  void wait_event(StreamId stream, EventHandle event) override {
    note("wait_event", stream, event);
  }
  bool stream_capturing(StreamId stream) override {
    note("stream_capturing", stream);
    return true;
  }
  double host_time() const override {
    note("host_time");
    return 17.5;
  }
  CallTimes call_times() const override {
    note("call_times");
    return {19, 23};
  }

 private:
  template <typename... Args>
  void note(const char* call, Args... args) const {
    log_ += call;
    ((log_ += ' ', log_ += std::to_string(args)), ...);
    log_ += '\n';
  }
  mutable std::string log_;
};

TEST(ForwardingDevice, EveryCallReachesTheInnerDeviceAndReturnsItsAnswer) {
  ScriptedDevice inner;
  ForwardingDevice device(inner);
  EXPECT_EQ(&device.inner(), &inner);
  EXPECT_EQ(&std::as_const(device).inner(), &inner);

  EXPECT_EQ(device.granularity(), 3 * MiB);
  EXPECT_EQ(inner.take(), "granularity\n");
  const DeviceMemInfo info = device.mem_info();
  EXPECT_EQ(info.free, 5u);
  EXPECT_EQ(info.total, 7u);
  EXPECT_EQ(inner.take(), "mem_info\n");
  EXPECT_EQ(device.name(), "scripted");
  EXPECT_EQ(inner.take(), "name\n");
  EXPECT_EQ(device.index(), 4);  // Device's default: 0
  EXPECT_EQ(inner.take(), "index\n");

  EXPECT_EQ(device.reserve_address(64, 8), 0x1000u);
  EXPECT_EQ(inner.take(), "reserve_address 64 8\n");
  device.release_address(0x1000, 64);
  EXPECT_EQ(inner.take(), "release_address 4096 64\n");
  EXPECT_EQ(device.create_chunk(32), 11u);
  EXPECT_EQ(inner.take(), "create_chunk 32\n");
  device.release_chunk(11);
  EXPECT_EQ(inner.take(), "release_chunk 11\n");
  device.map(1, 2, 3);
  EXPECT_EQ(inner.take(), "map 1 2 3\n");
  device.unmap(4, 5);
  EXPECT_EQ(inner.take(), "unmap 4 5\n");
  device.set_access(6, 7);
  EXPECT_EQ(inner.take(), "set_access 6 7\n");

  EXPECT_EQ(device.create_event(), 13u);
  EXPECT_EQ(inner.take(), "create_event\n");
  device.destroy_event(13);
  EXPECT_EQ(inner.take(), "destroy_event 13\n");
  device.record_event(13, 2);
  EXPECT_EQ(inner.take(), "record_event 13 2\n");
  EXPECT_TRUE(device.query_event(13));
  EXPECT_EQ(inner.take(), "query_event 13\n");
  device.synchronize_event(13);
  EXPECT_EQ(inner.take(), "synchronize_event 13\n");
  device.wait_event(2, 13);  // Device's default: synchronize_event 13, a host wait
  EXPECT_EQ(inner.take(), "wait_event 2 13\n");
  EXPECT_TRUE(device.stream_capturing(2));  // Device's default: false
  EXPECT_EQ(inner.take(), "stream_capturing 2\n");
  EXPECT_EQ(device.host_time(), 17.5);  // Device's default: the steady clock
  EXPECT_EQ(inner.take(), "host_time\n");
  const Device::CallTimes times = device.call_times();  // Device's default: zero
  EXPECT_EQ(times.calls_us, 19);
  EXPECT_EQ(times.waits_us, 23);
  EXPECT_EQ(inner.take(), "call_times\n");
}

// A decorator overrides one call; the others still reach the inner device.
TEST(ForwardingDevice, ADecoratorChangesOnlyTheCallsItOverrides) {
  class Renamed final : public ForwardingDevice {
   public:
    using ForwardingDevice::ForwardingDevice;
    std::string name() const override { return "renamed " + inner().name(); }
  };
  ScriptedDevice inner;
  Renamed device(inner);
  EXPECT_EQ(device.name(), "renamed scripted");
  EXPECT_EQ(inner.take(), "name\n");
  device.map(1, 2, 3);
  EXPECT_EQ(inner.take(), "map 1 2 3\n");
}

// What an engine did, as its device and its stats saw it.
struct EngineRun {
  std::vector<void*> blocks;  // every malloc's pointer, in order
  MemoryStats stats;  // detailed
  std::vector<std::pair<std::string, std::int64_t>> flat;  // the same by name, to compare
  std::array<std::uint64_t, static_cast<std::size_t>(DeviceCall::count_)> calls{};
  double call_us = 0, wait_us = 0, host_us = 0;
  std::size_t chunk_bytes = 0;
};

// A small program run by an engine on `device`, over (or being) `sim`: mallocs and frees of
// several sizes on two streams whose work completes only when told, under a limit, so that the
// engine stitches and hands one stream's freed memory to the other (wait_event); a capture on
// one stream (stream_capturing); steps marked while the host clock moves (host_time); a cache
// given back. Falling back to Device's default for wait_event, stream_capturing or call_times
// changes the run (host_time too little here: the first test catches that one).
EngineRun run_program(SimulatedDevice& sim, Device& device) {
  EngineRun run;
  Engine engine(device, EngineOptions{.memory_limit = 64 * MiB});
  auto alloc = [&](std::size_t size, StreamId stream) {
    run.blocks.push_back(engine.malloc(size, stream));
    return run.blocks.back();
  };
  constexpr StreamId a = 1, b = 2;
  for (int step = 0; step < 3; ++step) {
    void* x = alloc(3 * MiB + 100, a);
    void* small = alloc(1000, a);
    void* big = alloc(40 * MiB, a);
    sim.streams().submit_work(a);  // a kernel on `big`, still running when it is freed
    engine.free(big);
    void* other = alloc(48 * MiB, b);  // more than is left: a's freed pages handed over
    engine.free(other);
    engine.free(small);
    engine.free(x);
    sim.streams().submit_work(b);
    sim.ledger().advance_host_time(500);
    engine.mark_step();
  }
  sim.streams().submit_work(a);
  void* held = alloc(24 * MiB, a);
  engine.free(held);
  sim.streams().set_capturing(a, true);  // a graph captured on `a`: its freed memory is not taken
  engine.set_capturing(true);
  engine.free(alloc(8 * MiB, b));
  engine.set_capturing(false);
  sim.streams().set_capturing(a, false);
  sim.streams().complete_all_streams();
  engine.empty_cache();
  engine.check_invariants();

  run.stats = engine.detailed_stats();
  run.stats.plan_wait_us = 0;  // the real time spent making plans: no device's, nor the same twice
  run.flat = run.stats.flatten();
  for (std::size_t i = 0; i < run.calls.size(); ++i)
    run.calls[i] = sim.ledger().calls(static_cast<DeviceCall>(i));
  run.call_us = sim.ledger().modelled_call_us();
  run.wait_us = sim.ledger().modelled_wait_us();
  run.host_us = sim.host_time();
  run.chunk_bytes = sim.memory().chunk_bytes();
  return run;
}

TEST(ForwardingDevice, AnEngineRunsOnItAsOnTheDeviceUnderIt) {
  const SimDeviceOptions options = device_of(1 * GiB, /*immediate=*/false);
  SimulatedDevice direct(options);
  const EngineRun expected = run_program(direct, direct);
  // The program reaches the calls with defaults in Device; otherwise the comparison below
  // would not notice them falling back.
  EXPECT_GT(direct.ledger().calls(DeviceCall::wait_event), 0u);
  EXPECT_GT(expected.stats.num_stream_handovers, 0);
  EXPECT_GT(expected.stats.device_call_us, 0);

  SimulatedDevice under(options);
  ForwardingDevice forwarding(under);
  const EngineRun run = run_program(under, forwarding);
  EXPECT_EQ(run.blocks, expected.blocks);
  EXPECT_EQ(run.flat, expected.flat);
  for (std::size_t i = 0; i < run.calls.size(); ++i)
    EXPECT_EQ(run.calls[i], expected.calls[i]) << device_call_name(static_cast<DeviceCall>(i));
  EXPECT_EQ(run.call_us, expected.call_us);
  EXPECT_EQ(run.wait_us, expected.wait_us);
  EXPECT_EQ(run.host_us, expected.host_us);
  EXPECT_EQ(run.chunk_bytes, expected.chunk_bytes);
}

}  // namespace
}  // namespace gmem
