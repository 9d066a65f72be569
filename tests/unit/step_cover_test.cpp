// Steps laid out as the largest of their shape (covers, src/engine/step_plan.hpp): a step that
// follows no plan takes, block by block, the sizes of the largest step of its shape recorded,
// matched by their place among all the step's mallocs; what keeps a cover and what replaces it;
// and the engine's loops whose length is drawn anew every step.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "engine/step_plan.hpp"
#include "gmem/engine.hpp"
#include "gmem/error.hpp"
#include "gmem/sim_device.hpp"

namespace gmem {
namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

using detail::StepPlanner;

// A step for the planner alone: each entry a range malloc of that size, or 0 for a malloc in a
// slab's slot (tick). Every block is freed within the step, in reverse. Returns each range
// malloc's slot (the size it takes).
std::vector<std::size_t> run_step(StepPlanner& planner, const std::vector<std::size_t>& mallocs) {
  std::vector<std::size_t> slots;
  std::vector<std::pair<DevicePtr, std::uint32_t>> live;
  DevicePtr next = 0x100000000;
  for (const std::size_t bytes : mallocs) {
    if (bytes == 0) {
      planner.tick();
      continue;
    }
    const StepPlanner::Ticket t = planner.request(bytes);
    EXPECT_EQ(t.offset, StepPlanner::kOnline) << "no plan is followed here";
    EXPECT_GE(t.slot, bytes);
    slots.push_back(t.slot);
    live.emplace_back(next, planner.taken(t, next, false));
    next += 4096 * MiB;
  }
  for (auto it = live.rbegin(); it != live.rend(); ++it) planner.released(it->first, it->second);
  planner.mark_step();
  return slots;
}

TEST(StepCover, ASmallerStepTakesTheSizesOfTheLargerOne) {
  StepPlanner planner(/*background=*/false);
  planner.mark_step();
  // The first request is the same (an all-gather); the others scale with a length.
  EXPECT_EQ(run_step(planner, {84 * MiB, 40 * MiB, 0, 8 * MiB, 160 * MiB}),
            (std::vector<std::size_t>{84 * MiB, 40 * MiB, 8 * MiB, 160 * MiB}))
      << "the shape's first step has no cover: its own sizes";
  EXPECT_EQ(run_step(planner, {84 * MiB, 10 * MiB, 0, 8 * MiB, 40 * MiB}),
            (std::vector<std::size_t>{84 * MiB, 40 * MiB, 8 * MiB, 160 * MiB}));
  EXPECT_EQ(planner.stats().covered, 1u);
  EXPECT_EQ(planner.stats().plans, 0u) << "one shape that fits its cover needs no plan";
}

TEST(StepCover, BlocksAreMatchedByTheirPlaceAmongAllTheStepsMallocs) {
  StepPlanner planner(/*background=*/false);
  planner.mark_step();
  run_step(planner, {84 * MiB, 40 * MiB, 512 * KiB, 512 * KiB, 16 * MiB, 160 * MiB});
  // At a quarter of the length the two 512 KiB blocks are 128 KiB, in slabs: the blocks after
  // them still take their own blocks' sizes, not the slab-sized ones'.
  EXPECT_EQ(run_step(planner, {84 * MiB, 10 * MiB, 0, 0, 16 * MiB, 40 * MiB}),
            (std::vector<std::size_t>{84 * MiB, 40 * MiB, 16 * MiB, 160 * MiB}));
  EXPECT_EQ(planner.stats().covered, 1u);
}

TEST(StepCover, ALargerStepLeavesItsCoverAndBecomesTheNext) {
  StepPlanner planner(/*background=*/false);
  planner.mark_step();
  run_step(planner, {84 * MiB, 40 * MiB, 160 * MiB});
  // A longer length: its second block is larger than the cover's, so it and the rest take their
  // own sizes; it is the larger step, the cover from now on.
  EXPECT_EQ(run_step(planner, {84 * MiB, 60 * MiB, 240 * MiB}),
            (std::vector<std::size_t>{84 * MiB, 60 * MiB, 240 * MiB}));
  EXPECT_EQ(run_step(planner, {84 * MiB, 20 * MiB, 80 * MiB}),
            (std::vector<std::size_t>{84 * MiB, 60 * MiB, 240 * MiB}));
  EXPECT_EQ(planner.stats().covered, 1u);
}

TEST(StepCover, ASmallerStepThatDoesNotFitKeepsTheCoverOnceAndTwiceReplacesIt) {
  StepPlanner planner(/*background=*/false);
  planner.mark_step();
  run_step(planner, {84 * MiB, 40 * MiB, 160 * MiB});
  // Another program from here on: a block larger than its cover's, in a step smaller in all.
  const std::vector<std::size_t> other{84 * MiB, 48 * MiB, 8 * MiB};
  EXPECT_EQ(run_step(planner, other), other);
  // The cover stayed (one such step may be an outlier): the step fits it up to the same block.
  EXPECT_EQ(run_step(planner, other), other);
  // Two in a row: the program changed, and its step is the cover now.
  EXPECT_EQ(run_step(planner, {84 * MiB, 40 * MiB, 4 * MiB}),
            (std::vector<std::size_t>{84 * MiB, 48 * MiB, 8 * MiB}));
}

TEST(StepCover, AStepThatRepeatsExactlyTakesItsOwnSizes) {
  StepPlanner planner(/*background=*/false);
  planner.mark_step();
  const std::vector<std::size_t> step{84 * MiB, 0, 40 * MiB, 0, 160 * MiB};
  for (int k = 0; k < 3; ++k)
    EXPECT_EQ(run_step(planner, step), (std::vector<std::size_t>{84 * MiB, 40 * MiB, 160 * MiB}));
  EXPECT_EQ(planner.stats().covered, 2u);
}

std::uint64_t device_calls(const SimulatedDevice& d) {
  const SimCallLedger& ledger = d.ledger();
  return ledger.calls(DeviceCall::create_chunk) + ledger.calls(DeviceCall::map) +
         ledger.calls(DeviceCall::unmap);
}

// FSDP2 in miniature, a length drawn per step: the root's all-gather on a stream of its own
// begins the step, then the root's parameters unsharded on the compute stream (fixed sizes: the
// shape's first request there); per layer an all-gather, activations that scale with the length
// (kept for backward, and a temporary; a small block that falls under the slab limit at short
// lengths), then in backward the all-gather again, a gradient of the activation's size, and a
// reduce-scatter buffer of fixed size.
struct Fsdp2Loop {
  Engine& engine;
  StreamId gather = 7;
  void step(std::size_t len) {
    const std::size_t act = len * 3 * MiB, tiny = len * 48 * KiB;
    void* root_gathered = engine.malloc(24 * MiB, gather);
    void* root = engine.malloc(24 * MiB);
    engine.free(root_gathered);
    std::vector<void*> saved;
    for (int layer = 0; layer < 6; ++layer) {
      void* gathered = engine.malloc(21 * MiB, gather);
      void* tmp = engine.malloc(2 * act + 512);
      saved.push_back(engine.malloc(act));
      saved.push_back(engine.malloc(tiny));
      engine.free(tmp);
      engine.free(gathered);
    }
    void* logits = engine.malloc(len * 20 * MiB);
    engine.free(logits);
    while (!saved.empty()) {
      void* gathered = engine.malloc(21 * MiB, gather);
      void* grad = engine.malloc(act);
      engine.free(saved.back());
      saved.pop_back();
      engine.free(saved.back());
      saved.pop_back();
      void* reduce = engine.malloc(42 * MiB);
      engine.free(grad);
      engine.free(gathered);
      engine.free(reduce);
    }
    engine.free(root);
    engine.mark_step();
  }
};

TEST(StepCover, LengthsDrawnPerStepStopMappingOnceTheLongestRan) {
  SimulatedDevice device;
  Engine engine(device);
  void* params = engine.malloc(300 * MiB);
  Fsdp2Loop loop{engine};
  engine.mark_step();
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> draw(1, 8);
  // The longest first (the streams are weighed in the first step, the second is the cover):
  // every step after it lays out as it did, on its pages.
  loop.step(8);
  loop.step(8);
  const std::int64_t reserved = engine.stats().reserved_bytes[kAllPools].peak;
  const std::uint64_t before = device_calls(device);
  for (int k = 0; k < 40; ++k) {
    loop.step(static_cast<std::size_t>(draw(rng)));
    engine.check_invariants();
  }
  EXPECT_EQ(device_calls(device) - before, 0u) << "no two of these steps lay out alike unless covered";
  EXPECT_EQ(engine.stats().reserved_bytes[kAllPools].peak, reserved)
      << "a covered step holds no more than its cover did";
  engine.free(params);
  engine.check_invariants();
  EXPECT_EQ(engine.stats().allocated_bytes[kAllPools].current, 0);
  EXPECT_EQ(engine.stats().plans, 0) << "covers need no plan region";
}

TEST(StepCover, AStepLargerThanAnyBeforeMapsAndIsTheCoverFromThen) {
  SimulatedDevice device;
  Engine engine(device);
  Fsdp2Loop loop{engine};
  engine.mark_step();
  for (const std::size_t len : {2, 3, 2, 3}) loop.step(len);
  const std::uint64_t at_three = device_calls(device);
  loop.step(6);  // longer than any before: its blocks take their own sizes, on new pages
  EXPECT_GT(device_calls(device), at_three);
  // The steps after it take its sizes; their chunks settle within a few steps, as a repeated
  // step's do (a page whose chunk another page of the new layout took is remapped once).
  for (const std::size_t len : {6, 2, 5, 1, 4, 3}) loop.step(len);
  const std::uint64_t before = device_calls(device);
  for (int round = 0; round < 3; ++round)
    for (const std::size_t len : {3, 1, 4, 6, 2, 5}) loop.step(len);
  EXPECT_EQ(device_calls(device) - before, 0u);
  engine.check_invariants();
}

TEST(StepCover, ACoverThatCannotBeHadUnderTheLimitGivesTheBlockItsOwnSize) {
  SimulatedDevice device;
  EngineOptions options;
  options.memory_limit = 128 * MiB;
  Engine engine(device, options);
  engine.mark_step();
  void* a = engine.malloc(100 * MiB);
  engine.free(a);
  engine.mark_step();
  // Another stream holds 64 MiB meanwhile: the cover's 100 MiB would not fit, the block's 20 do.
  void* other = engine.malloc(64 * MiB, /*stream=*/5);
  void* b = engine.malloc(20 * MiB);
  EXPECT_EQ(engine.block_info(b).size, 20 * MiB);
  EXPECT_EQ(engine.stats().num_ooms, 0);
  engine.check_invariants();
  engine.free(b);
  engine.free(other);
  engine.mark_step();
  engine.check_invariants();
}

}  // namespace
}  // namespace gmem
