// The step planner on its own (detail::StepPlanner, src/engine/step_plan.hpp): the offline
// placement, which steps it plans and when, its bounded records, and plans made in the background.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "engine/step_plan.hpp"
#include "engine_test_support.hpp"

namespace gmem {
namespace {

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
