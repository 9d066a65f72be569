// The engine's behaviour on the simulated device (engine_test.cpp): shapes that vary, random
// churn, stitching, out of memory, memory limits, empty_cache and peak stats.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"
#include "engine_test_support.hpp"
#include "sim_calls.hpp"

namespace gmem {
namespace {

// A training step in miniature: parameters live throughout; each layer's forward keeps an
// activation for backward and makes a short-lived temporary; backward frees in reverse.
void training_step(Engine& engine, std::size_t tokens) {
  std::vector<void*> saved;
  for (int layer = 0; layer < 12; ++layer) {
    saved.push_back(engine.malloc(tokens * 4096 * 2 + 512 * layer));  // activation
    void* scores = engine.malloc(tokens * tokens * 2);                  // attention scores
    saved.push_back(engine.malloc(tokens * 1024));                      // small saved tensor
    engine.free(scores);
  }
  for (std::size_t i = saved.size(); i-- > 0;) {
    void* grad = engine.malloc(tokens * 4096 * 2);
    engine.free(saved[i]);
    engine.free(grad);
  }
}

TEST(Engine, VaryingShapesStopCallingTheDeviceOnceEachWasSeen) {
  // Sequence lengths vary from step to step (packed batches, detection image sizes): the first
  // steps of each length build its layout; once every length has been seen, no device calls.
  SimulatedDevice device;
  Engine engine(device);
  void* params = engine.malloc(300 * MiB);
  const std::size_t lengths[] = {512, 1536, 768, 1024, 640};
  std::mt19937 rng(3);
  std::uint64_t before = 0;
  for (int step = 0; step < 60; ++step) {
    if (step == 40) before = mapping_calls(device);
    training_step(engine, lengths[rng() % std::size(lengths)]);
  }
  EXPECT_GT(before, 0u);
  EXPECT_EQ(mapping_calls(device) - before, 0u);
  const MemoryStats s = engine.stats();
  EXPECT_LE(static_cast<double>(s.reserved_bytes[kAllPools].peak),
            1.02 * static_cast<double>(s.allocated_bytes[kAllPools].peak) + 4.0 * 2 * MiB);
  engine.free(params);
  engine.check_invariants();
}

// A random churn never repeats its layout: it clashes whatever the engine holds, and more chunks
// only make it clash less often. Whether the engine buys them depends on what the clashes cost:
// back to back, remapping is nearly all the time the program spends (the host clock moves by the
// device calls' modelled time alone), so it buys (up to 1/8 over the pages in use) and settles;
// with GPU work between its operations (a millisecond of host time each), remapping costs about
// a percent and it stays at its peak.
struct ChurnOutcome {
  std::uint64_t early_calls = 0;  // mapping calls in the first 100k operations
  std::uint64_t late_calls = 0;   // and in the second
  double late_device_us = 0;     // their modelled time and the waits for streams
  double late_host_us = 0;       // the host time the second 100k operations took
  double reserved_ratio = 0;     // peak reserved over peak allocated
};
ChurnOutcome random_churn(double host_us_per_op, double gpu_lag_us = 0) {
  SimDeviceOptions options;
  options.lag_us = gpu_lag_us;
  SimulatedDevice device(options);
  Engine engine(device);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> log_size(std::log(512.0), std::log(64.0 * MiB));
  std::vector<void*> slots(1000);
  for (void*& p : slots) p = engine.malloc(static_cast<std::size_t>(std::exp(log_size(rng))));
  auto device_us = [&] {
    return device.ledger().modelled_call_us() + device.ledger().modelled_wait_us();
  };
  ChurnOutcome out;
  std::uint64_t calls_before = 0;
  double device_us_before = 0, host_us_before = 0;
  for (int i = 0; i < 200000; ++i) {
    if (i == 100000) {
      calls_before = mapping_calls(device);
      out.early_calls = calls_before;
      device_us_before = device_us();
      host_us_before = device.host_time();
    }
    const double calls_us = device.ledger().modelled_call_us();
    void*& p = slots[rng() % slots.size()];
    engine.free(p);
    p = engine.malloc(static_cast<std::size_t>(std::exp(log_size(rng))));
    // The host spends the operation's device calls (a wait already moved its clock), then its work.
    device.ledger().advance_host_time(device.ledger().modelled_call_us() - calls_us +
                                      host_us_per_op);
  }
  engine.check_invariants();
  const MemoryStats s = engine.stats();
  out.late_calls = mapping_calls(device) - calls_before;
  out.late_device_us = device_us() - device_us_before;
  out.late_host_us = device.host_time() - host_us_before;
  out.reserved_ratio = static_cast<double>(s.reserved_bytes[kAllPools].peak) /
                       static_cast<double>(s.allocated_bytes[kAllPools].peak);
  return out;
}

TEST(Engine, RandomChurnBackToBackBuysChunksAndSettles) {
  const ChurnOutcome churn = random_churn(0);
  EXPECT_GT(churn.early_calls, 1000u);  // it did have to stitch at first
  EXPECT_LT(churn.late_calls, 1000u);   // of 100000 operations
  // What it bought stays bounded: at most 1/8 over the pages in use, and some page rounding.
  EXPECT_LT(churn.reserved_ratio, 1.25);
}

TEST(Engine, RandomChurnBetweenGpuWorkStaysAtPeak) {
  const ChurnOutcome back_to_back = random_churn(0);
  const ChurnOutcome paced = random_churn(1000);
  // It keeps remapping, at less than the clash rule's tenth of its time ...
  EXPECT_GT(paced.late_calls, 10 * back_to_back.late_calls);
  EXPECT_LT(paced.late_device_us, 0.1 * paced.late_host_us);
  // ... and holds what its pages need: its peak, and the 1/100 (+4 pages) clashes buy by count.
  EXPECT_LT(paced.reserved_ratio, 1.06);
  EXPECT_LT(paced.reserved_ratio, back_to_back.reserved_ratio - 0.05);
}

TEST(Engine, RandomChurnWaitingForItsStreamBuysChunks) {
  // The same paced churn on a GPU running 100 ms (a hundred operations) behind the host: a
  // remap's unmap must wait for the stream to finish with the page's last use, and those waits
  // are what the clashes cost. They take more than a tenth of the time, so the engine buys
  // chunks as the back-to-back churn does (1.16 and 100 calls, against 1.04 and 16,208).
  const ChurnOutcome paced = random_churn(1000);
  const ChurnOutcome waiting = random_churn(1000, 100000);
  EXPECT_GT(waiting.reserved_ratio, paced.reserved_ratio + 0.05);
  EXPECT_LT(waiting.late_calls, paced.late_calls / 4);
}

TEST(Engine, StitchesScatteredFreePagesIntoOneLargeBlock) {
  SimulatedDevice device(device_of(64 * MiB));
  Engine engine(device);
  std::vector<void*> blocks;
  for (int i = 0; i < 32; ++i) blocks.push_back(engine.malloc(2 * MiB));
  EXPECT_THROW(engine.malloc(2 * MiB), OutOfMemoryError);
  for (int i = 0; i < 32; i += 2) engine.free(blocks[i]);  // 16 holes of one page each
  // No contiguous 32 MiB range is free, yet the chunks are: gmem remaps them.
  void* big = engine.malloc(32 * MiB);
  const MemoryStats s = engine.stats();
  EXPECT_GT(s.num_stitches, 0);
  EXPECT_LE(s.reserved_bytes[kAllPools].current, static_cast<std::int64_t>(64 * MiB));
  EXPECT_TRUE(device.memory().is_accessible(reinterpret_cast<std::uintptr_t>(big) + 32 * MiB - 1));
  engine.check_invariants();
}

TEST(Engine, OutOfMemoryCarriesTheNumbersAndLeavesEverythingIntact) {
  SimulatedDevice device(device_of(1 * GiB));
  Engine engine(device, EngineOptions{.memory_limit = 256 * MiB});
  void* a = engine.malloc(200 * MiB);
  try {
    engine.malloc(100 * MiB);
    FAIL() << "malloc over the limit succeeded";
  } catch (const OutOfMemoryError& e) {
    const OomInfo& info = e.info();
    EXPECT_EQ(info.requested, 100 * MiB);
    EXPECT_EQ(info.limit, 256 * MiB);
    EXPECT_EQ(info.device_total, 1 * GiB);
    EXPECT_EQ(info.allocated, 200 * MiB);
    EXPECT_GE(info.reserved, 200 * MiB);
    EXPECT_EQ(info.reason, "limit");
    EXPECT_NE(std::string(e.what()).find("100.00 MiB"), std::string::npos) << e.what();
  }
  EXPECT_EQ(engine.stats().num_ooms, 1);
  engine.check_invariants();
  engine.free(a);
  void* b = engine.malloc(250 * MiB);  // recovers after frees
  engine.free(b);
  engine.check_invariants();
}

TEST(Engine, DeviceOutOfMemoryIsReportedAsSuch) {
  SimDeviceOptions o = device_of(128 * MiB);
  o.used_by_others = 64 * MiB;
  SimulatedDevice device(o);
  Engine engine(device);
  EXPECT_NO_THROW(engine.free(engine.malloc(60 * MiB)));
  try {
    engine.malloc(80 * MiB);
    FAIL();
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.info().reason, "device");
    EXPECT_EQ(e.info().device_total, 128 * MiB);
  }
  engine.check_invariants();
}

// Asks for `bytes`, which cannot fit: OutOfMemoryError for `reason`, and not one chunk created
// first, so that neither time nor the peak of reserved memory goes on chunks given back at once.
void expect_refused_before_any_create(SimulatedDevice& device, Engine& engine, std::size_t bytes,
                                      const std::string& reason) {
  SCOPED_TRACE(bytes);
  const std::uint64_t creates = device.ledger().calls(DeviceCall::create_chunk);
  const std::int64_t peak = engine.stats().reserved_bytes[kAllPools].peak;
  try {
    engine.malloc(bytes);
    ADD_FAILURE() << "malloc of " << bytes << " bytes succeeded";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.info().reason, reason);
  }
  EXPECT_EQ(device.ledger().calls(DeviceCall::create_chunk), creates)
      << "chunks created for nothing";
  EXPECT_EQ(engine.stats().reserved_bytes[kAllPools].peak, peak);
  engine.check_invariants();
}

TEST(Engine, AMallocOverTheLimitCreatesNothingBeforeItFails) {
  SimDeviceOptions o = device_of(4 * GiB);
  o.used_by_others = 1 * GiB;
  SimulatedDevice device(o);
  Engine engine(device, EngineOptions{.memory_limit = 3 * GiB});
  engine.free(engine.malloc(8 * MiB));  // four chunks held
  expect_refused_before_any_create(device, engine, 3 * GiB + 1, "limit");
  expect_refused_before_any_create(device, engine, 4 * GiB, "limit");
  engine.free(engine.malloc(2 * GiB + 2 * MiB));  // what fits the limit and the device still does
  engine.check_invariants();
}

TEST(Engine, AMallocBeyondWhatTheDeviceHasFreeCreatesNothingBeforeItFails) {
  // No limit, but others hold 3 of the device's 4 GiB: a 1.5 GiB block needs more new chunks
  // than the device has, which one cuMemGetInfo tells before any is created.
  SimDeviceOptions o = device_of(4 * GiB);
  o.used_by_others = 3 * GiB;
  SimulatedDevice device(o);
  Engine engine(device);
  engine.free(engine.malloc(8 * MiB));
  expect_refused_before_any_create(device, engine, 1536 * MiB, "device");
  engine.free(engine.malloc(1000 * MiB));  // what fits still does
  engine.check_invariants();
}

TEST(Engine, DetailedStatsSayWhatIsHeldOutsideGmem) {
  // The CUDA context, NCCL and other processes hold memory gmem never sees: the device's total
  // less what is free less what gmem holds. Asked of the device only for the detailed stats.
  SimDeviceOptions o = device_of(128 * MiB);
  o.used_by_others = 24 * MiB;
  SimulatedDevice device(o);
  Engine engine(device);
  void* p = engine.malloc(10 * MiB);
  const std::size_t asked = device.ledger().calls(DeviceCall::mem_info);
  const MemoryStats quick = engine.stats();
  EXPECT_EQ(quick.outside_bytes, 0);
  // Polled stats ask nothing of the driver.
  EXPECT_EQ(device.ledger().calls(DeviceCall::mem_info), asked);
  const MemoryStats s = engine.detailed_stats();
  EXPECT_EQ(s.device_total_bytes, static_cast<std::int64_t>(128 * MiB));
  EXPECT_EQ(s.device_free_bytes, static_cast<std::int64_t>(128 * MiB - 24 * MiB) - s.reserved_bytes[kAllPools].current);
  EXPECT_EQ(s.outside_bytes, static_cast<std::int64_t>(24 * MiB));
  EXPECT_EQ(s.find("gmem.outside_bytes"), s.outside_bytes);
  EXPECT_TRUE(MemoryStats::is_derived("gmem.outside_bytes"));
  EXPECT_TRUE(MemoryStats::is_derived("gmem.device_free_bytes"));
  engine.free(p);
}

TEST(Engine, EmptyCacheGivesEveryFreeChunkBack) {
  SimulatedDevice device;
  Engine engine(device);
  std::vector<void*> blocks;
  for (std::size_t size : {4096, 70000, 5000000, 300000000}) blocks.push_back(engine.malloc(size));
  void* kept = engine.malloc(10 * MiB);
  for (void* p : blocks) engine.free(p);
  engine.empty_cache();
  const MemoryStats s = engine.stats();
  EXPECT_EQ(s.free_mapped_bytes, 0);
  EXPECT_EQ(s.free_unmapped_bytes, 0);
  EXPECT_EQ(device.memory().chunk_bytes(),
            static_cast<std::size_t>(s.reserved_bytes[kAllPools].current));
  EXPECT_LE(device.memory().chunk_bytes(), 12 * MiB);
  EXPECT_GT(s.num_device_free, 0);
  engine.free(kept);
  engine.empty_cache();
  EXPECT_EQ(device.memory().chunk_bytes(), 0u);
  engine.check_invariants();
}

TEST(Engine, LimitsTrimCachedMemoryAndRejectBadFractions) {
  SimulatedDevice device(device_of(1 * GiB));
  Engine engine(device);
  engine.free(engine.malloc(512 * MiB));
  EXPECT_EQ(device.memory().chunk_bytes(), 512 * MiB);
  engine.set_memory_fraction(0.25);
  EXPECT_EQ(engine.memory_limit(), 256 * MiB);
  EXPECT_LE(device.memory().chunk_bytes(), 256 * MiB);
  EXPECT_THROW(engine.set_memory_fraction(0.0), Error);
  EXPECT_THROW(engine.set_memory_fraction(1.5), Error);
  EXPECT_THROW(engine.set_memory_fraction(-0.5), Error);
  EXPECT_THROW(engine.set_memory_fraction(std::nan("")), Error);
  // A limit never quietly becomes no limit: one that rounds to nothing, or above the device, is
  // refused and the limit in force stays.
  EXPECT_THROW(engine.set_memory_fraction(1e-12), Error);
  EXPECT_THROW(engine.set_memory_limit(SIZE_MAX), Error);
  EXPECT_THROW(engine.set_memory_limit(1 * GiB + 1), Error);
  EXPECT_THROW(engine.set_memory_limit(100), Error);
  EXPECT_EQ(engine.memory_limit(), 256 * MiB);
  EXPECT_EQ(engine.stats().memory_limit, static_cast<std::int64_t>(256 * MiB));
  EXPECT_THROW(Engine(device, EngineOptions{.memory_limit = 2 * GiB}), Error);
  engine.set_memory_limit(0);
  EXPECT_EQ(engine.memory_limit(), 1 * GiB);
  engine.check_invariants();
}

TEST(Engine, ResetPeakStats) {
  SimulatedDevice device;
  Engine engine(device);
  engine.free(engine.malloc(64 * MiB));
  void* p = engine.malloc(2 * MiB);
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].peak, static_cast<std::int64_t>(64 * MiB));
  engine.reset_peak_stats();
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].peak, static_cast<std::int64_t>(2 * MiB));
  engine.free(p);
}

}  // namespace
}  // namespace gmem
