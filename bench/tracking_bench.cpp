// What tracking costs: the engine's malloc+free pair alone against the same pair with a Tracker
// attached, in the same run, with 1000 other blocks live (as in a training step).
// The budget: tracking adds at most 10% to the pair. The differences are a few ns, less than a
// shared machine drifts in a second: compare medians of interleaved repetitions.
//
//   build/bench/gmem_tracking_bench --benchmark_repetitions=15 \
//       --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <optional>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/scope.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/tracker.hpp"

namespace {

using namespace gmem;

constexpr int kLiveBlocks = 1000;

void pair_loop(benchmark::State& state, Engine& engine, std::size_t size) {
  engine.free(engine.malloc(size, 0));  // warm: mappings cached
  const std::int64_t maps = engine.stats().num_maps;
  for (auto _ : state) {
    void* p = engine.malloc(size, 0);
    benchmark::DoNotOptimize(p);
    engine.free(p);
  }
  state.SetItemsProcessed(state.iterations());
  // Should be 0: a steady loop makes no device calls.
  state.counters["maps_per_pair"] = static_cast<double>(engine.stats().num_maps - maps) /
                                    static_cast<double>(state.iterations());
}

// Pairs of `size` bytes; `tracker_options`: none for the untracked engine. In a scope and at a
// call site unless `backtrace` (which takes its own).
void pair(benchmark::State& state, std::size_t size, std::optional<TrackerOptions> tracker_options) {
  SimulatedDevice device{SimDeviceOptions{std::size_t{80} << 30}};
  Engine engine(device);
  std::optional<Tracker> tracker;
  if (tracker_options) tracker.emplace(engine, *tracker_options);
  std::vector<void*> live;
  for (int i = 0; i < kLiveBlocks; ++i)
    live.push_back(engine.malloc(static_cast<std::size_t>(512 + (i % 64) * 4096), 0));
  if (tracker_options && tracker_options->capture_backtrace) {
    pair_loop(state, engine, size);
  } else {
    Scope scope("model.transformer.h.3.mlp");
    frames::set_current("train.py:42:forward");
    pair_loop(state, engine, size);
    frames::set_current("");
  }
  for (void* p : live) engine.free(p);
}

std::size_t size_arg(const benchmark::State& state) {
  return static_cast<std::size_t>(state.range(0));
}

void BM_EnginePair(benchmark::State& state) { pair(state, size_arg(state), std::nullopt); }
void BM_TrackedPair(benchmark::State& state) { pair(state, size_arg(state), TrackerOptions{}); }
void BM_TrackedPairNoHistory(benchmark::State& state) {
  pair(state, size_arg(state), TrackerOptions{0, false, 0});
}
void BM_TrackedPairBacktrace(benchmark::State& state) {
  pair(state, size_arg(state), TrackerOptions{TrackerOptions{}.history_capacity, true, 32});
}
// 4 KiB pairs with a history of range(0) events: what the ring's size costs once it outgrows the
// CPU's caches.
void BM_TrackedPairHistory(benchmark::State& state) {
  const auto events = static_cast<std::size_t>(state.range(0));
  state.counters["history_MiB"] =
      static_cast<double>(events * TrackerOptions::kEventBytes) / (1 << 20);
  pair(state, 4096, TrackerOptions{events, false, 0});
}

// Small (slab) and large (page-range) blocks.
BENCHMARK(BM_EnginePair)->Arg(4096)->Arg(4 << 20);
BENCHMARK(BM_TrackedPair)->Arg(4096)->Arg(4 << 20);
BENCHMARK(BM_TrackedPairNoHistory)->Arg(4096)->Arg(4 << 20);
BENCHMARK(BM_TrackedPairBacktrace)->Arg(4096);
BENCHMARK(BM_TrackedPairHistory)->RangeMultiplier(4)->Range(4096, 1 << 18);

}  // namespace

BENCHMARK_MAIN();
