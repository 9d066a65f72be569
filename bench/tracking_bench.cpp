// What tracking costs: the engine's malloc+free pair alone against the same pair through a
// TrackingResource, in the same run, with 1000 other blocks live (as in a training step).
// The budget: tracking adds at most 10% to the pair.
//
//   build/bench/gmem_tracking_bench --benchmark_min_time=0.5s
#include <benchmark/benchmark.h>

#include <vector>

#include "gmem/engine.hpp"
#include "gmem/scope.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/tracker.hpp"

namespace {

using namespace gmem;

constexpr int kLiveBlocks = 1000;

void pair_loop(benchmark::State& state, MemoryResource& resource, const Engine& engine) {
  const auto size = static_cast<std::size_t>(state.range(0));
  resource.deallocate(resource.allocate(size, 0));  // warm: mappings cached
  const std::int64_t maps = engine.stats().num_maps;
  for (auto _ : state) {
    void* p = resource.allocate(size, 0);
    benchmark::DoNotOptimize(p);
    resource.deallocate(p);
  }
  state.SetItemsProcessed(state.iterations());
  // Should be 0: a steady loop makes no device calls (nor listener calls).
  state.counters["maps_per_pair"] = static_cast<double>(engine.stats().num_maps - maps) /
                                    static_cast<double>(state.iterations());
}

void BM_EnginePair(benchmark::State& state) {
  SimulatedDevice device{SimDeviceOptions{std::size_t{80} << 30}};
  Engine engine(device);
  std::vector<void*> live;
  for (int i = 0; i < kLiveBlocks; ++i)
    live.push_back(engine.malloc(static_cast<std::size_t>(512 + (i % 64) * 4096), 0));
  pair_loop(state, engine, engine);
  for (void* p : live) engine.free(p);
}

void tracked(benchmark::State& state, TrackerOptions options, bool in_scope) {
  SimulatedDevice device{SimDeviceOptions{std::size_t{80} << 30}};
  Engine engine(device);
  Tracker tracker(options);
  TrackingResource resource(engine, tracker);
  std::vector<void*> live;
  for (int i = 0; i < kLiveBlocks; ++i)
    live.push_back(resource.allocate(static_cast<std::size_t>(512 + (i % 64) * 4096), 0));
  if (in_scope) {
    Scope scope("model.transformer.h.3.mlp");
    frames::set_current("train.py:42:forward");
    pair_loop(state, resource, engine);
    frames::set_current("");
  } else {
    pair_loop(state, resource, engine);
  }
  for (void* p : live) resource.deallocate(p);
}

void BM_TrackedPair(benchmark::State& state) { tracked(state, TrackerOptions{}, true); }
void BM_TrackedPairNoHistory(benchmark::State& state) {
  tracked(state, TrackerOptions{0, false, 0}, true);
}
void BM_TrackedPairBacktrace(benchmark::State& state) {
  tracked(state, TrackerOptions{100'000, true, 32}, false);
}

// The tracker's own share of the pair, without the engine.
void BM_TrackerAlonePair(benchmark::State& state) {
  Tracker tracker;
  const std::uintptr_t base = 0x7f0000000000;
  for (std::uintptr_t i = 1; i <= kLiveBlocks; ++i)
    tracker.on_malloc(reinterpret_cast<void*>(base + i * 1048576), 512, 512, 0);
  void* p = reinterpret_cast<void*>(base);
  for (auto _ : state) {
    tracker.on_malloc(p, 4096, 4096, 0);
    tracker.on_free(p);
  }
  state.SetItemsProcessed(state.iterations());
}

// Small (slab) and large (page-range) blocks.
BENCHMARK(BM_EnginePair)->Arg(4096)->Arg(4 << 20);
BENCHMARK(BM_TrackedPair)->Arg(4096)->Arg(4 << 20);
BENCHMARK(BM_TrackedPairNoHistory)->Arg(4096)->Arg(4 << 20);
BENCHMARK(BM_TrackedPairBacktrace)->Arg(4096);
BENCHMARK(BM_TrackerAlonePair);

}  // namespace

BENCHMARK_MAIN();
