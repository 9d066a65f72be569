// Engine hot-path cost on a simulated 80 GiB device, next to system malloc measured in the same
// run as an anchor (machines differ; the ratio is what carries over).
//
//   BM_MallocFreePair/<bytes>   malloc then free of one size, after warm-up (cached mapping)
//   BM_RandomChurn              1000 live blocks, log-uniform 512 B..64 MiB; each op frees a
//                               random slot and allocates a new size into it
//   BM_PlannedSteps             steps marked, two shapes taking turns (a training loop under
//                               gmem.torch with varying lengths): every range malloc takes its
//                               planned offset; an item is one malloc and its free
//
// The counter device_calls counts device calls made while timing: a warm steady state makes none.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"

namespace {

using gmem::DeviceCall;

constexpr std::size_t kSlots = 1000;
constexpr std::size_t kChurnOps = std::size_t{1} << 16;  // pre-generated, replayed cyclically
constexpr std::size_t kMinChurnBytes = 512;
constexpr std::size_t kMaxChurnBytes = std::size_t{64} << 20;

std::uint64_t total_device_calls(const gmem::SimulatedDevice& device) {
  std::uint64_t total = 0;
  for (int i = 0; i < static_cast<int>(DeviceCall::count_); ++i) {
    total += device.ledger().calls(static_cast<DeviceCall>(i));
  }
  return total;
}

// The churn workload: which slot each op frees, and the size it then allocates there. Generated
// once with a fixed seed so gmem and the anchor see exactly the same sequence.
struct ChurnPlan {
  std::vector<std::size_t> initial_sizes;  // one per slot
  std::vector<std::size_t> slots, sizes;   // one per op
};

const ChurnPlan& churn_plan() {
  static const ChurnPlan plan = [] {
    ChurnPlan p;
    std::mt19937_64 rng(20240611);
    std::uniform_real_distribution<double> log_size(std::log(double(kMinChurnBytes)),
                                                    std::log(double(kMaxChurnBytes)));
    std::uniform_int_distribution<std::size_t> slot(0, kSlots - 1);
    auto draw = [&] { return static_cast<std::size_t>(std::exp(log_size(rng))); };
    for (std::size_t i = 0; i < kSlots; ++i) p.initial_sizes.push_back(draw());
    for (std::size_t i = 0; i < kChurnOps; ++i) {
      p.slots.push_back(slot(rng));
      p.sizes.push_back(draw());
    }
    return p;
  }();
  return plan;
}

void BM_MallocFreePair(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  gmem::SimulatedDevice device;
  gmem::Engine engine(device);
  for (int i = 0; i < 16; ++i) engine.free(engine.malloc(size));  // warm: mapping now cached
  device.ledger().reset_call_counts();
  for (auto _ : state) {
    void* ptr = engine.malloc(size);
    benchmark::DoNotOptimize(ptr);
    engine.free(ptr);
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["device_calls"] = static_cast<double>(total_device_calls(device));
}
BENCHMARK(BM_MallocFreePair)->Arg(4 << 10)->Arg(1 << 20)->Arg(64 << 20)->Arg(int64_t{4} << 30);

void BM_PlannedSteps(benchmark::State& state) {
  gmem::SimulatedDevice device;
  gmem::Engine engine(device);
  constexpr std::size_t MiB = std::size_t{1} << 20;
  std::vector<void*> kept;
  kept.reserve(64);
  std::size_t mallocs = 0;
  auto step = [&](std::size_t length) {
    for (int layer = 0; layer < 12; ++layer) {
      kept.push_back(engine.malloc(length * MiB));         // an activation, kept for backward
      void* scratch = engine.malloc(2 * length * MiB);     // a temporary
      kept.push_back(engine.malloc(256 * 1024 + 4096));    // a small range block
      engine.free(scratch);
    }
    for (auto it = kept.rbegin(); it != kept.rend(); ++it) engine.free(*it);
    kept.clear();
    engine.mark_step();
    mallocs += 36;
  };
  engine.mark_step();
  for (int warm = 0; warm < 8; ++warm) step(warm % 2 == 0 ? 3 : 5);
  device.ledger().reset_call_counts();
  mallocs = 0;
  int i = 0;
  for (auto _ : state) step(++i % 2 == 0 ? 3 : 5);
  state.SetItemsProcessed(static_cast<std::int64_t>(mallocs));
  state.counters["device_calls"] = static_cast<double>(total_device_calls(device));
}
BENCHMARK(BM_PlannedSteps);

void BM_RandomChurn(benchmark::State& state) {
  const ChurnPlan& plan = churn_plan();
  gmem::SimulatedDevice device;
  gmem::Engine engine(device);
  std::vector<void*> live(kSlots);
  for (std::size_t s = 0; s < kSlots; ++s) live[s] = engine.malloc(plan.initial_sizes[s]);
  auto op = [&](std::size_t i) {
    const std::size_t slot = plan.slots[i];
    engine.free(live[slot]);
    live[slot] = engine.malloc(plan.sizes[i]);
  };
  for (std::size_t i = 0; i < kChurnOps; ++i) op(i);  // warm-up: one pass over the plan
  device.ledger().reset_call_counts();
  std::size_t next = 0;
  for (auto _ : state) {
    op(next);
    next = next + 1 == kChurnOps ? 0 : next + 1;
  }
  state.SetItemsProcessed(state.iterations());
  const auto calls = static_cast<double>(total_device_calls(device));
  state.counters["device_calls"] = calls;
  state.counters["device_calls_per_op"] = benchmark::Counter(calls, benchmark::Counter::kAvgIterations);
  for (void* ptr : live) engine.free(ptr);
}
BENCHMARK(BM_RandomChurn);

// --- anchors: the same loops over the C library's malloc ---------------------------------------
// Memory is never touched, so no page is faulted in: this measures the allocator's bookkeeping,
// as the gmem loops do (a simulated device has no memory behind it). Blocks of 64 MiB go to
// mmap/munmap in glibc, which is the system allocator's real cost for such sizes.

void BM_Anchor_SystemMallocPair(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* ptr = std::malloc(size);
    benchmark::DoNotOptimize(ptr);
    std::free(ptr);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Anchor_SystemMallocPair)->Arg(4 << 10)->Arg(1 << 20)->Arg(64 << 20);

void BM_Anchor_SystemMallocChurn(benchmark::State& state) {
  const ChurnPlan& plan = churn_plan();
  std::vector<void*> live(kSlots);
  for (std::size_t s = 0; s < kSlots; ++s) live[s] = std::malloc(plan.initial_sizes[s]);
  auto op = [&](std::size_t i) {
    const std::size_t slot = plan.slots[i];
    std::free(live[slot]);
    live[slot] = std::malloc(plan.sizes[i]);
    benchmark::DoNotOptimize(live[slot]);
  };
  for (std::size_t i = 0; i < kChurnOps; ++i) op(i);  // warm-up, as for gmem
  std::size_t next = 0;
  for (auto _ : state) {
    op(next);
    next = next + 1 == kChurnOps ? 0 : next + 1;
  }
  state.SetItemsProcessed(state.iterations());
  for (void* ptr : live) std::free(ptr);
}
BENCHMARK(BM_Anchor_SystemMallocChurn);

}  // namespace

BENCHMARK_MAIN();
