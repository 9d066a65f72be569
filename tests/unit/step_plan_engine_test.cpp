// The engine following planned step layouts (Engine::mark_step): shapes taking turns settle
// with no device calls, and steps that leave their plans or break their lifetimes fall back.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"
#include "step_plan_test_support.hpp"

namespace gmem {
namespace {

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

}  // namespace
}  // namespace gmem
