// Planned step layouts (Engine::mark_step, src/engine/step_plan.hpp): the offline placement,
// and the engine following, leaving and re-making plans.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "engine/step_plan.hpp"
#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"
#include "map_ahead_settle.hpp"

namespace gmem {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

using detail::PlanBlock;
using detail::place_offline;

bool overlap(const PlanBlock& a, const PlanBlock& b) {
  return a.start < b.end && b.start < a.end && a.offset < b.offset + b.size && b.offset < a.offset + a.size;
}

TEST(PlaceOffline, BlocksThatFollowEachOtherShareTheirOffset) {
  std::vector<PlanBlock> blocks{{4 * MiB, 0, 2}, {4 * MiB, 2, 4}, {4 * MiB, 4, 6}};
  EXPECT_EQ(place_offline(blocks), 4 * MiB);
  for (const PlanBlock& b : blocks) EXPECT_EQ(b.offset, 0u);
}

TEST(PlaceOffline, LargestFirstAtTheLowestFreeOffset) {
  // A 1 MiB block alive throughout, a 2 MiB one early and a 3 MiB one late: the 3 MiB block
  // takes the bottom, the 2 MiB one (not alive with it) too, the 1 MiB one above both.
  std::vector<PlanBlock> blocks{{1 * MiB, 0, 10}, {2 * MiB, 1, 4}, {3 * MiB, 5, 9}};
  EXPECT_EQ(place_offline(blocks), 4 * MiB);
  EXPECT_EQ(blocks[2].offset, 0u);
  EXPECT_EQ(blocks[1].offset, 0u);
  EXPECT_EQ(blocks[0].offset, 3 * MiB);
}

TEST(PlaceOffline, NoTwoBlocksAliveTogetherOverlap) {
  std::mt19937 rng(7);
  for (int round = 0; round < 20; ++round) {
    std::vector<PlanBlock> blocks;
    std::size_t peak = 0;
    for (std::uint32_t i = 0; i < 300; ++i) {
      const std::uint32_t start = rng() % 1000;
      blocks.push_back({(1 + rng() % 4096) * 512, start, start + 1 + static_cast<std::uint32_t>(rng() % 200)});
    }
    for (std::uint32_t t = 0; t < 1200; ++t) {
      std::size_t live = 0;
      for (const PlanBlock& b : blocks) live += b.start <= t && t < b.end ? b.size : 0;
      peak = std::max(peak, live);
    }
    const std::size_t extent = place_offline(blocks);
    EXPECT_GE(extent, peak);
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      EXPECT_EQ(blocks[i].offset % 512, 0u);
      EXPECT_LE(blocks[i].offset + blocks[i].size, extent);
      for (std::size_t j = i + 1; j < blocks.size(); ++j)
        ASSERT_FALSE(overlap(blocks[i], blocks[j])) << i << " and " << j;
    }
  }
}

// A training step of "length" `len`: a long-lived block from the last step is freed, then
// activations are made (forward) and freed in reverse (backward), with temporaries between,
// and a new long-lived block is left for the next step. Returns the step's transient addresses.
struct Loop {
  Engine& engine;
  bool mark = true;
  void* carried = nullptr;
  std::function<void()> after_first_malloc;  // called once a step, after its first malloc
  std::vector<void*> step(std::size_t len) {
    std::vector<void*> transient;
    std::vector<void*> acts;
    for (int layer = 0; layer < 8; ++layer) {
      void* tmp = engine.malloc((3 + layer % 3) * len * MiB / 2);
      if (layer == 0 && after_first_malloc) after_first_malloc();
      acts.push_back(engine.malloc(len * MiB + (layer % 2) * 512 * 1024));
      transient.push_back(tmp);
      transient.push_back(acts.back());
      engine.free(tmp);
    }
    if (carried) engine.free(carried);
    while (!acts.empty()) {
      void* grad = engine.malloc(2 * len * MiB);
      transient.push_back(grad);
      engine.free(acts.back());
      acts.pop_back();
      engine.free(grad);
    }
    carried = engine.malloc(6 * MiB);  // outlives the step: placed online
    if (mark) engine.mark_step();
    return transient;
  }
};

std::uint64_t device_calls(const SimulatedDevice& d) {
  return d.calls(DeviceCall::create_chunk) + d.calls(DeviceCall::map) + d.calls(DeviceCall::unmap);
}

// Five rounds of lengths 3, 7, 5 and 4, each a step(len) that returns its transient blocks: from
// round 3 on each length's blocks are where they were the round before, and no round calls the
// device. Returns each length's blocks of the last round.
std::map<std::size_t, std::vector<void*>> expect_rounds_settle(
    SimulatedDevice& device, Engine& engine, const std::function<std::vector<void*>(std::size_t)>& step) {
  const std::size_t lengths[] = {3, 7, 5, 4};
  std::map<std::size_t, std::vector<void*>> last;
  for (int round = 0; round < 5; ++round) {
    const std::uint64_t before = device_calls(device);
    for (const std::size_t len : lengths) {
      const std::vector<void*> addrs = step(len);
      if (round >= 3) EXPECT_EQ(addrs, last[len]) << "length " << len << " moved in round " << round;
      last[len] = addrs;
      engine.check_invariants();
    }
    if (round >= 3) EXPECT_EQ(device_calls(device) - before, 0u) << "round " << round;
  }
  return last;
}

// Whether `p` lies outside the online arena. `weights`, a 64 MiB block malloc'ed first, sits at
// the top of the stream's arena, which spans the device's size.
bool in_plan_region(SimulatedDevice& device, const void* weights, const void* p) {
  const auto online_end = reinterpret_cast<std::uintptr_t>(weights) + 64 * MiB;
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  return a >= online_end || a < online_end - device.mem_info().total;
}

TEST(StepPlan, ShapesTakingTurnsFollowTheirPlansWithoutDeviceCalls) {
  SimulatedDevice device;
  Engine engine(device);
  void* weights = engine.malloc(64 * MiB);
  Loop loop{engine};
  engine.mark_step();
  // Round 0 records each length; plans are followed from the second length that comes back (7
  // in round 1), so length 3 follows its plan from round 2 on.
  const auto last = expect_rounds_settle(device, engine, [&](std::size_t len) { return loop.step(len); });
  // What the stats say (gmem.steps_marked, gmem.plan_*): every step of rounds 3 and 4 followed
  // its plan, each of its 32 range mallocs at its planned offset, and nothing left a plan.
  const MemoryStats s = engine.stats();
  EXPECT_EQ(s.steps_marked, 1 + 5 * 4);
  EXPECT_EQ(s.plans, 4);
  EXPECT_GE(s.plan_steps_followed, 2 * 4);
  EXPECT_GE(s.plan_hits, 2 * 4 * 32);
  EXPECT_EQ(s.plan_mismatches, 0);
  EXPECT_EQ(s.plan_conflicts, 0);
  EXPECT_GE(s.plan_extent_bytes, static_cast<std::int64_t>(8 * 7 * MiB));
  // The transient blocks sit in the plan region, apart from the blocks placed online.
  for (const auto& [len, addrs] : last)
    for (void* p : addrs) EXPECT_TRUE(in_plan_region(device, weights, p)) << "length " << len;
  EXPECT_FALSE(in_plan_region(device, weights, loop.carried));
  engine.free(loop.carried);
  engine.free(weights);
  engine.check_invariants();
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
}

TEST(StepPlan, FreesRightAfterTheMarkBelongToTheStep) {
  // As PyTorch runs under gmem.torch: the step is marked after optimizer.step(), and zero_grad
  // then frees the gradients made in backward, before the next step's forward. The step's
  // record stays open until the next step's first range malloc, so the gradients are the step's
  // own blocks and planned with it: in the plan region, where online blocks (which plan pages
  // would share chunks with, and clash) do not come between.
  SimulatedDevice device;
  Engine engine(device);
  void* weights = engine.malloc(64 * MiB);
  engine.mark_step();
  std::vector<void*> grads;
  const auto step = [&](std::size_t len) {
    for (void* g : grads) engine.free(g);  // zero_grad of the step before
    grads.clear();
    std::vector<void*> acts, addrs;
    for (int layer = 0; layer < 8; ++layer) acts.push_back(engine.malloc(len * MiB + (layer % 2) * 512 * 1024));
    addrs = acts;
    for (int layer = 0; layer < 8; ++layer) {
      grads.push_back(engine.malloc(4 * MiB + layer * 512 * 1024));  // the parameters' sizes
      engine.free(acts.back());
      acts.pop_back();
    }
    addrs.insert(addrs.end(), grads.begin(), grads.end());
    engine.mark_step();  // after optimizer.step(): the gradients are still alive
    return addrs;
  };
  const auto last = expect_rounds_settle(device, engine, step);
  for (const auto& [len, addrs] : last)
    for (void* p : addrs) EXPECT_TRUE(in_plan_region(device, weights, p)) << "length " << len;
  const MemoryStats s = engine.stats();
  EXPECT_EQ(s.plan_mismatches, 0);
  EXPECT_EQ(s.plan_conflicts, 0);
  EXPECT_GE(s.plan_hits, 2 * 4 * 16);
  for (void* g : grads) engine.free(g);
  engine.free(weights);
  engine.check_invariants();
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
}

TEST(StepPlan, WithoutMarksNothingIsPlanned) {
  // The same program on two engines, one told where its steps end: they place every block alike
  // until two shapes have come back (a plan is followed only then), and the one never told keeps
  // placing online, where the first steps were.
  SimulatedDevice plain_device, marked_device;
  Engine plain(plain_device), marked(marked_device);
  // Addresses are compared from an anchor block in each engine (the devices' ranges differ).
  void* plain_anchor = plain.malloc(64 * MiB);
  void* marked_anchor = marked.malloc(64 * MiB);
  const auto from = [](void* anchor, const std::vector<void*>& addrs) {
    std::vector<std::intptr_t> out;
    for (void* p : addrs) out.push_back(reinterpret_cast<std::intptr_t>(p) - reinterpret_cast<std::intptr_t>(anchor));
    return out;
  };
  Loop a{plain, false}, b{marked, true};
  marked.mark_step();
  const std::size_t lengths[] = {3, 7, 7};  // 7 again right after 7: shapes do not take turns yet
  for (const std::size_t len : lengths)
    EXPECT_EQ(from(plain_anchor, a.step(len)), from(marked_anchor, b.step(len))) << "length " << len;
  for (int round = 0; round < 3; ++round)
    for (const std::size_t len : {3, 7}) {
      const std::vector<void*> addrs = a.step(len);
      plain.check_invariants();
      const auto first = reinterpret_cast<std::uintptr_t>(addrs.front());
      const auto carried = reinterpret_cast<std::uintptr_t>(a.carried);
      EXPECT_LT(std::max(first, carried) - std::min(first, carried), 64 * GiB);  // one range
    }
}

TEST(StepPlan, AStepThatLeavesItsPlanFallsBackOnline) {
  SimulatedDevice device;
  Engine engine(device);
  Loop loop{engine};
  engine.mark_step();
  for (int round = 0; round < 3; ++round)
    for (const std::size_t len : {3, 7}) loop.step(len);
  // Same first request as length 3, then other sizes: the plan is left at the first mismatch.
  std::vector<void*> live;
  live.push_back(engine.malloc(9 * MiB / 2));  // length 3's first request (its first temporary)
  for (int i = 0; i < 20; ++i) live.push_back(engine.malloc((i + 1) * MiB + 512));
  engine.check_invariants();
  for (std::size_t i = 0; i < live.size(); ++i)
    for (std::size_t j = i + 1; j < live.size(); ++j) {
      const auto a = reinterpret_cast<std::uintptr_t>(live[i]), b = reinterpret_cast<std::uintptr_t>(live[j]);
      const std::size_t sa = engine.block_info(live[i]).size, sb = engine.block_info(live[j]).size;
      ASSERT_TRUE(a + sa <= b || b + sb <= a) << "blocks " << i << " and " << j << " overlap";
    }
  for (void* p : live) engine.free(p);
  engine.mark_step();
  // Both shapes follow their plans again afterwards (the odd step replaced length 3's plan, as
  // it began with the same request, so the next step of length 3 leaves that plan too and is
  // planned anew).
  for (int round = 0; round < 2; ++round)
    for (const std::size_t len : {3, 7}) loop.step(len);
  const std::uint64_t before = device_calls(device);
  for (const std::size_t len : {3, 7}) loop.step(len);
  EXPECT_EQ(device_calls(device) - before, 0u);
  engine.check_invariants();
}

TEST(StepPlan, LifetimesThatDoNotHoldFallBackWithoutOverlap) {
  SimulatedDevice device;
  Engine engine(device);
  engine.mark_step();
  // Two shapes: blocks a, b, c in turn, each freed before the next (a plan puts them all at
  // offset 0); shape 2 likewise, to make the plans followed.
  auto shape = [&](std::size_t first, bool hold_a) {
    void* a = engine.malloc(first);
    void* kept = nullptr;
    if (hold_a) kept = a;  // this time `a` lives on: the plan's offset 0 is taken
    else engine.free(a);
    void* b = engine.malloc(first);
    void* c = engine.malloc(first);
    const auto pa = reinterpret_cast<std::uintptr_t>(kept), pb = reinterpret_cast<std::uintptr_t>(b),
               pc = reinterpret_cast<std::uintptr_t>(c);
    if (kept) {
      EXPECT_TRUE(pa + first <= pb || pb + first <= pa);
      EXPECT_TRUE(pa + first <= pc || pc + first <= pa);
    }
    EXPECT_TRUE(pb + first <= pc || pc + first <= pb);
    engine.free(b);
    engine.free(c);
    if (kept) engine.free(kept);
    engine.check_invariants();
    engine.mark_step();
  };
  for (int round = 0; round < 3; ++round) {
    shape(8 * MiB, false);
    shape(12 * MiB, false);
  }
  shape(8 * MiB, true);   // the plan's lifetimes do not hold: b and c fall back where a stays
  shape(8 * MiB, false);  // planned again from the step that did not hold
  shape(8 * MiB, false);
  engine.check_invariants();
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
}

// Steps of lengths taking turns on one stream, from four threads at once, one of them marking:
// requests interleave in no fixed order, so plans are followed, left and made again while other
// threads' device calls run with the lock released. Blocks never overlap, the books balance.
void threads_sharing_the_stream(const EngineOptions& options) {
  SimulatedDevice device;
  Engine engine(device, options);
  engine.mark_step();
  std::atomic<int> steps{0};
  auto worker = [&](unsigned seed, bool marks) {
    std::mt19937 rng(seed);
    std::vector<std::pair<void*, std::size_t>> live;
    for (int step = 0; step < 60; ++step) {
      const std::size_t len = 1 + rng() % 3;
      for (int k = 0; k < 12; ++k) {
        const std::size_t bytes = (k % 4 + 1) * len * MiB / 2 + 512 * (rng() % 8);
        live.emplace_back(engine.malloc(bytes), bytes);
        if (live.size() > 3) {
          const std::size_t victim = rng() % live.size();
          engine.free(live[victim].first);
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(victim));
        }
      }
      for (auto& [p, bytes] : live) engine.free(p);
      live.clear();
      if (marks) engine.mark_step();
      ++steps;
    }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 4; ++t) threads.emplace_back(worker, t + 1, t == 0);
  // Meanwhile: no two live blocks overlap (checked under the engine's lock).
  while (steps.load() < 4 * 60) {
    std::vector<std::pair<std::uintptr_t, std::size_t>> blocks;
    engine.for_each_block([&](const BlockInfo& b) {
      blocks.emplace_back(reinterpret_cast<std::uintptr_t>(b.ptr), b.size);
    });
    std::sort(blocks.begin(), blocks.end());
    for (std::size_t i = 1; i < blocks.size(); ++i)
      ASSERT_LE(blocks[i - 1].first + blocks[i - 1].second, blocks[i].first);
    std::this_thread::yield();
  }
  for (std::thread& t : threads) t.join();
  engine.check_invariants();
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
}

TEST(StepPlan, ThreadsSharingTheStreamStress) { threads_sharing_the_stream({}); }

TEST(StepPlan, ThreadsSharingTheStreamWithMapAheadStress) {
  EngineOptions options;
  options.map_ahead = true;  // a fifth thread maps each new plan's pages as its step runs
  threads_sharing_the_stream(options);
}

EngineOptions with_map_ahead(bool on) {
  EngineOptions options;
  options.map_ahead = on;
  return options;
}

// The map-ahead tests' set-up: an engine on the simulated device with map-ahead on or off, 64 MiB
// of weights, and a Loop that pauses after each step's first malloc until the map-ahead thread is
// quiet (as a step's kernels run while the host waits); steps marked from here on.
struct PausingLoop {
  explicit PausingLoop(bool map_ahead) : engine(device, with_map_ahead(map_ahead)) {
    loop.after_first_malloc = [this] { let_map_ahead_settle(engine); };
    engine.mark_step();
  }
  SimulatedDevice device;
  Engine engine;
  void* weights = engine.malloc(64 * MiB);
  Loop loop{engine};
};

TEST(StepPlanThreads, ANewPlansPagesAreMappedAheadWhileItsStepRuns) {
  // The rounds of ShapesTakingTurnsFollowTheirPlansWithoutDeviceCalls with map-ahead on, the
  // program pausing after each step's first malloc (as a step's kernels run while the host
  // waits): the plan region's pages are mapped by the engine's thread, not by the step's
  // mallocs, and every block goes where it went without map-ahead (plans do not depend on what
  // is mapped), with the same settling: no device call in rounds 3 and 4.
  // Round 0's third and fourth steps begin new shapes after two others: the region is mapped
  // early, while they run, so the first step on a plan (round 1's first) maps nothing itself.
  std::map<std::size_t, std::vector<void*>> last[2];
  std::int64_t step_maps[2] = {0, 0}, ahead_maps = 0, early_maps = 0, first_plan_step_maps = -1;
  for (const bool ahead : {false, true}) {
    PausingLoop run(ahead);
    auto& [device, engine, weights, loop] = run;
    int steps = 0;
    last[ahead] = expect_rounds_settle(device, engine, [&](std::size_t len) {
      const MemoryStats before = engine.stats();
      std::vector<void*> blocks = loop.step(len);
      let_map_ahead_settle(engine);
      const MemoryStats after = engine.stats();
      if (++steps == 4) early_maps = after.num_maps_ahead;  // round 0's: made early
      if (steps == 5 && ahead)
        first_plan_step_maps = (after.num_maps - after.num_maps_ahead) - (before.num_maps - before.num_maps_ahead);
      return blocks;
    });
    const MemoryStats s = engine.stats();
    step_maps[ahead] = s.num_maps - s.num_maps_ahead;
    if (ahead) {
      ahead_maps = s.num_maps_ahead;
      EXPECT_GE(early_maps, 16) << "the region of 16 pages or more is mapped early";
    } else {
      EXPECT_EQ(s.num_maps_ahead, 0);
    }
    engine.free(loop.carried);
    engine.free(weights);
    engine.check_invariants();
    EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
  }
  EXPECT_EQ(last[0], last[1]);
  EXPECT_EQ(first_plan_step_maps, 0) << "the first step on a plan found its pages mapped early";
  // The steps' own maps: map-ahead took its maps off them. An early map is a forecast (a chunk
  // free as round 0's steps begin, due last): a few of its chunks are busy when the plans want
  // them and are mapped again (3 of 31 when this was written), so allow a quarter.
  EXPECT_LE(step_maps[1] + ahead_maps, step_maps[0] + ahead_maps / 4)
      << step_maps[1] << " + " << ahead_maps << " against " << step_maps[0];
  EXPECT_LT(step_maps[1], step_maps[0] - ahead_maps / 2);
}

TEST(StepPlanThreads, AStepThatLeavesItsNewPlanHoldsNoChunksMappedAheadForIt) {
  // Length 12's plan is first followed in round 1 (its pages beyond those mapped early are mapped
  // ahead, the program pausing after the step's first malloc), but that step then leaves it
  // (its second request differs) and places the rest online. The pages mapped ahead for the
  // plan's later blocks give their chunks back at once, so the online blocks take them rather
  // than new ones: the same peak reserved as without map-ahead. (Held to the step's end, they
  // made lstm_varlen's replay reserve 1.83 times its peak.)
  std::size_t peak[2] = {0, 0};
  std::int64_t ahead_maps = 0;
  for (const bool ahead : {false, true}) {
    PausingLoop run(ahead);
    auto& [device, engine, weights, loop] = run;
    for (const std::size_t len : {3, 5, 4, 12}) loop.step(len);
    for (const std::size_t len : {3, 5, 4}) loop.step(len);
    // Length 12's first request, then blocks its plan does not know.
    void* first = engine.malloc(3 * 12 * MiB / 2);
    let_map_ahead_settle(engine);
    std::vector<void*> online;
    for (int k = 0; k < 12; ++k) online.push_back(engine.malloc(9 * MiB + 3 * 1024));
    for (void* p : online) engine.free(p);
    engine.free(first);
    if (loop.carried) engine.free(loop.carried);
    engine.mark_step();
    let_map_ahead_settle(engine);
    const MemoryStats s = engine.stats();
    peak[ahead] = static_cast<std::size_t>(s.reserved_bytes[kAllPools].peak);
    if (ahead) ahead_maps = s.num_maps_ahead;
    engine.free(weights);
    engine.check_invariants();
  }
  EXPECT_GT(ahead_maps, 0);
  EXPECT_EQ(peak[1], peak[0]) << "peak reserved with map-ahead " << peak[1] << " against " << peak[0];
}

TEST(StepPlanThreads, AMapAheadTheDeviceFailsIsRolledBack) {
  // Every tenth map fails while plans begin (map-ahead's or a step's own, whichever thread makes
  // it): a failed batch gives its pages back, a step whose own map fails gets DeviceError, and
  // the books always balance; the engine goes away with a round maybe still under way.
  PausingLoop run(true);
  auto& [device, engine, weights, loop] = run;
  for (int round = 0; round < 4; ++round) {
    for (const std::size_t len : {3, 7, 5, 4}) {
      if (round >= 1) device.fail_call(DeviceCall::map, 10);
      try {
        loop.step(len);
      } catch (const DeviceError&) {  // the step's blocks so far stay live (the engine owns them)
        loop.carried = nullptr;
        engine.mark_step();
      }
      let_map_ahead_settle(engine);
      engine.check_invariants();
    }
  }
  device.fail_call(DeviceCall::map, 0);
  EXPECT_GT(engine.stats().num_maps_ahead, 0);
  (void)weights;
}

TEST(StepPlan, StepsThatNeverRepeatKeepTheRecordsBounded) {
  // Every step begins with a request never seen before: the planner keeps at most a few hundred
  // shapes' records, then starts afresh, and shapes that take turns afterwards are planned.
  detail::StepPlanner planner;
  planner.mark_step();
  const auto run_step = [&](std::size_t first, DevicePtr at) {
    const detail::StepPlanner::Ticket a = planner.request(first);
    const std::uint32_t oa = planner.taken(a, at, a.offset != detail::StepPlanner::kOnline);
    const detail::StepPlanner::Ticket b = planner.request(MiB);
    const std::uint32_t ob = planner.taken(b, at + 64 * MiB, b.offset != detail::StepPlanner::kOnline);
    planner.released(at + 64 * MiB, ob);
    planner.released(at, oa);
    planner.mark_step();
  };
  std::size_t most = 0;
  for (std::size_t s = 1; s <= 5000; ++s) {
    run_step(s * 512, 0x10000000);
    most = std::max(most, planner.shapes());
  }
  EXPECT_LE(most, 256u);
  const std::uint64_t plans = planner.stats().plans;
  for (int round = 0; round < 4; ++round)
    for (const std::size_t first : {3 * MiB, 5 * MiB}) run_step(first, 0x10000000);
  EXPECT_GE(planner.stats().plans, plans + 2) << "shapes that take turns are still planned";
}


TEST(StepPlan, AProgramThatStopsMarkingKeepsTheRecordBounded) {
  // Marks for a while (training), then none (an evaluation loop): the open step's record stops
  // at kMaxStepMallocs instead of growing with every malloc, and marking again plans again.
  detail::StepPlanner planner;
  const auto run_step = [&](std::size_t first) {
    for (const std::size_t bytes : {first, 2 * MiB, 3 * MiB}) {
      const detail::StepPlanner::Ticket t = planner.request(bytes);
      const std::uint32_t ordinal = planner.taken(t, 0x10000000, t.offset != detail::StepPlanner::kOnline);
      planner.released(0x10000000, ordinal);
    }
    planner.mark_step();
  };
  planner.mark_step();
  for (int round = 0; round < 3; ++round)
    for (const std::size_t first : {4 * MiB, 5 * MiB}) run_step(first);
  const std::uint64_t plans = planner.stats().plans;
  ASSERT_GE(plans, 2u);

  std::size_t most = 0;
  for (std::size_t i = 0; i < detail::StepPlanner::kMaxStepMallocs + 5000; ++i) {
    const detail::StepPlanner::Ticket t = planner.request(MiB + 512 * (i % 7));
    EXPECT_EQ(t.offset, detail::StepPlanner::kOnline);
    planner.released(0x20000000, planner.taken(t, 0x20000000, false));
    most = std::max(most, planner.recorded());
  }
  EXPECT_LE(most, detail::StepPlanner::kMaxStepMallocs);
  EXPECT_EQ(planner.recorded(), 0u) << "the overlong step's record is dropped";
  planner.mark_step();

  for (int round = 0; round < 3; ++round)
    for (const std::size_t first : {6 * MiB, 7 * MiB}) run_step(first);
  EXPECT_GE(planner.stats().plans, plans + 2) << "steps marked again are planned again";
  EXPECT_GT(planner.stats().hits, 0u);
}

TEST(StepPlan, WarmUpsAreAShapesFirstStepAndTheFirstStepOnANewPlan) {
  // The clash rule does not count a warm-up's clashes (Backing::acquire_chunk): a shape's first
  // step, while shapes recur, and the first step on a plan just made.
  detail::StepPlanner planner;
  planner.mark_step();
  const DevicePtr at = 0x10000000;
  // Runs a step beginning with a request of `first`; returns whether it was a warm-up (read
  // once the step's first request is known, as the clash rule reads it).
  const auto run_step = [&](std::size_t first) {
    const detail::StepPlanner::Ticket a = planner.request(first);
    const bool warm_up = planner.warm_up();
    planner.released(at, planner.taken(a, at, a.offset != detail::StepPlanner::kOnline));
    planner.mark_step();
    EXPECT_FALSE(planner.warm_up()) << "a step's warm-up ends at its mark";
    return warm_up;
  };
  EXPECT_TRUE(run_step(3 * MiB));   // first of its shape
  EXPECT_FALSE(run_step(3 * MiB));  // the same shape again, not taking turns: online, no plan
  EXPECT_TRUE(run_step(5 * MiB));   // first of its shape
  EXPECT_TRUE(run_step(3 * MiB));   // shapes take turns: the first step on 3 MiB's new plan
  EXPECT_TRUE(run_step(5 * MiB));   // the first step on 5 MiB's plan
  EXPECT_FALSE(run_step(3 * MiB));  // following its plan
  EXPECT_FALSE(run_step(5 * MiB));
  // A program whose shapes are new every step: the first 64 steps are warm-ups, and once more
  // than half of the last 64 steps began a shape, new shapes are the norm, not warm-ups.
  int warm_ups = 0;
  for (std::size_t s = 1; s <= 100; ++s) warm_ups += run_step(64 * MiB + s * 512);
  EXPECT_GE(warm_ups, 50);
  EXPECT_LT(warm_ups, 100);
  EXPECT_FALSE(run_step(256 * MiB));
  // Shapes that recur again: after 64 steps of them, a new shape's first step is a warm-up again.
  for (int round = 0; round < 40; ++round) {
    run_step(3 * MiB);
    run_step(5 * MiB);
  }
  EXPECT_TRUE(run_step(512 * MiB));
}

TEST(StepPlan, NewShapesAreWeighedByTheirMallocs) {
  // Two marks an iteration, as gmem.torch marks a program with an optimizer each for its sparse
  // and its dense parameters (DLRM): a long step whose first request is sized anew every time,
  // and a short one that always recurs. Counted by steps, half were new and the shapes passed for
  // recurring, so the long steps stayed warm-ups for good and their clashes were never counted.
  // Weighed by their mallocs, new shapes are the norm once 64 steps were marked.
  detail::StepPlanner planner(/*background=*/false);
  planner.mark_step();
  const DevicePtr at = 0x10000000;
  const auto run_step = [&](std::size_t first, int mallocs) {
    std::vector<std::pair<DevicePtr, std::uint32_t>> taken;
    bool warm_up = false;
    for (int k = 0; k < mallocs; ++k) {
      const detail::StepPlanner::Ticket t = planner.request(k == 0 ? first : 4 * MiB);
      if (k == 0) warm_up = planner.warm_up();
      const DevicePtr addr = at + static_cast<DevicePtr>(k) * 8 * MiB;
      taken.emplace_back(addr, planner.taken(t, addr, t.offset != detail::StepPlanner::kOnline));
    }
    for (const auto& [addr, ordinal] : taken) planner.released(addr, ordinal);
    planner.mark_step();
    return warm_up;
  };
  std::vector<bool> long_warm_ups;
  for (std::size_t i = 0; i < 80; ++i) {
    long_warm_ups.push_back(run_step(64 * MiB + i * 512, 30));
    run_step(2 * MiB, 1);
  }
  EXPECT_TRUE(long_warm_ups[10]) << "the first 64 steps count as recurring";
  EXPECT_FALSE(long_warm_ups.back()) << "new shapes made nearly all the mallocs";
}

}  // namespace
}  // namespace gmem

namespace gmem {
namespace {

// Plans made in the background (StepPlanner's default) are the plans made when their shapes
// come back: two planners fed the same steps, one planning in the background and one on the
// caller's thread, hand out the same offsets and count the same. Steps of eight shapes with
// nested and crossing lifetimes, in a shuffled order: the first round's records are kept before
// shapes take turns (then planned in one batch), and every fourth round a shape's step makes one
// request more than its plan (its record is kept and planned again as it closes, and again
// when the next step of the shape makes one request fewer).
TEST(StepPlanThreads, PlansMadeInTheBackgroundAreThePlansMadeInPlace) {
  detail::StepPlanner background(true), in_place(false);
  std::mt19937 random(7);
  std::vector<std::pair<int, int>> order;  // (round, shape)
  for (int round = 0; round < 12; ++round)
    for (int shape = 0; shape < 8; ++shape) order.emplace_back(round, shape);
  std::shuffle(order.begin() + 8, order.end(), random);
  for (detail::StepPlanner* planner : {&background, &in_place}) planner->mark_step();
  std::size_t planned = 0;
  for (const auto& [round, shape] : order) {
    // A step of the shape: 40 blocks whose sizes and frees depend on the shape only, and one
    // more every fourth round.
    std::mt19937 steps(static_cast<unsigned>(shape) + 1);
    std::vector<std::size_t> sizes;
    for (int k = 0; k < 40; ++k) sizes.push_back((1 + shape) * MiB + (steps() % 64) * 4096);
    if (round % 4 == 3) sizes.push_back(MiB);
    std::vector<int> frees(sizes.size());
    std::iota(frees.begin(), frees.end(), 0);
    std::shuffle(frees.begin(), frees.end(), steps);
    // The background plan of the last record is done: the next closing record gets a thread
    // too (one at a time), so which plans are made in the background does not depend on timing.
    while (background.planning()) std::this_thread::yield();
    std::vector<std::size_t> offsets[2];
    for (int p = 0; p < 2; ++p) {
      detail::StepPlanner& planner = p == 0 ? background : in_place;
      std::vector<std::uint32_t> ordinals;
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const detail::StepPlanner::Ticket t = planner.request(sizes[k]);
        offsets[p].push_back(t.offset);
        ordinals.push_back(planner.taken(t, 0x100000000 + k * 64 * MiB,
                                         t.offset != detail::StepPlanner::kOnline));
        if (k % 3 == 2)  // a third are freed as the step goes (temporaries), the rest at its end
          planner.released(0x100000000 + (k - 1) * 64 * MiB, ordinals[k - 1]);
      }
      for (const int k : frees)
        if (k % 3 != 1) planner.released(0x100000000 + static_cast<std::size_t>(k) * 64 * MiB, ordinals[k]);
      planner.mark_step();
    }
    ASSERT_EQ(offsets[0], offsets[1]);
    planned += offsets[0][0] != detail::StepPlanner::kOnline;
  }
  EXPECT_GT(planned, 60u);  // most steps after the first round follow a plan
  const detail::StepPlanner::Stats& a = background.stats();
  const detail::StepPlanner::Stats& b = in_place.stats();
  EXPECT_GT(a.plans, 8u + 4u) << "records kept after the first round are planned again";
  EXPECT_EQ(a.plans, b.plans);
  EXPECT_EQ(a.hits, b.hits);
  EXPECT_EQ(a.extent, b.extent);
  EXPECT_EQ(a.mismatches, b.mismatches);
  EXPECT_GT(a.mismatches, 0u);
  // All but the first plan (made as shapes began to take turns, for the shape coming back).
  EXPECT_EQ(a.ahead, a.plans - 1);
  EXPECT_EQ(b.ahead, 0u);
}

// One shape, steps marked: whether each step's blocks took planned offsets, given what each
// step mapped (as the engine reports it at the mark).
std::vector<bool> planned_steps(const std::vector<std::size_t>& mapped_by_step) {
  detail::StepPlanner planner(/*background=*/false);
  planner.mark_step();
  std::vector<bool> planned;
  for (const std::size_t mapped : mapped_by_step) {
    // An activation kept for backward, a temporary, a gradient: all freed within the step.
    const DevicePtr base = 0x10000000;
    const std::size_t sizes[] = {8 * MiB, 16 * MiB, 4 * MiB};
    std::uint32_t ordinals[3];
    bool all_planned = true;
    for (int k = 0; k < 3; ++k) {
      const detail::StepPlanner::Ticket t = planner.request(sizes[k]);
      all_planned &= t.offset != detail::StepPlanner::kOnline;
      ordinals[k] = planner.taken(t, base + static_cast<DevicePtr>(k) * 64 * MiB,
                                  t.offset != detail::StepPlanner::kOnline);
      if (k == 1) planner.released(base + 64 * MiB, ordinals[1]);
    }
    planner.released(base + 128 * MiB, ordinals[2]);
    planner.released(base, ordinals[0]);
    planner.mark_step(mapped);
    planned.push_back(all_planned);
  }
  return planned;
}

TEST(StepPlan, OneShapeWhoseOnlineLayoutKeepsMovingIsPlanned) {
  // The first step is the shape's warm-up; from the second, steps that still map count. After
  // four in a row that together mapped the step's peak (24 MiB here), its next step is the
  // first on a plan, and the ones after follow it.
  const std::vector<bool> planned = planned_steps({64 * MiB, 8 * MiB, 8 * MiB, 8 * MiB, 8 * MiB, 0, 0, 0});
  EXPECT_EQ(planned, (std::vector<bool>{false, false, false, false, false, true, true, true}));
}

TEST(StepPlan, OneShapeWhoseOnlineLayoutSettlesStaysOnline) {
  // A step that maps nothing ends the run: three moving steps at a time never plan, however
  // much they map.
  std::vector<std::size_t> mapped;
  for (int round = 0; round < 4; ++round)
    for (const std::size_t m : {GiB, GiB, GiB, std::size_t{0}}) mapped.push_back(m);
  for (const bool p : planned_steps(mapped)) EXPECT_FALSE(p);
}

TEST(StepPlan, OneShapeThatMovesLessThanItsPlanWouldMapStaysOnline) {
  // Moving every step, but by less in all than the plan's extent would map once: remapping is
  // still the cheaper of the two.
  for (const bool p : planned_steps(std::vector<std::size_t>(12, 2 * MiB))) EXPECT_FALSE(p);
}

}  // namespace
}  // namespace gmem
