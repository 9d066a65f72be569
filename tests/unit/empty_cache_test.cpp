// empty_cache() (EmptyCacheRule, src/engine/empty_cache_rule.hpp): it gives back everything
// until calls after every step are seen to cost the program time, then keeps what recent steps
// used; EngineOptions::strict_empty_cache gives back everything every time.
#include <gtest/gtest.h>

#include <vector>

#include "engine/empty_cache_rule.hpp"
#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"
#include "sim_calls.hpp"

namespace gmem {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

// A training loop's parameters: blocks live across the steps (a call with none live gives back
// everything).
void* parameters(Engine& engine) { return engine.malloc(std::size_t{1} << 20); }

// One step: `blocks` blocks of `size` live at once, all freed, then empty_cache(), `step_us` of
// host time after the step began. Returns the device calls the step and its call made.
std::uint64_t step(Engine& engine, SimulatedDevice& device, int blocks, std::size_t size,
                   double step_us) {
  const std::uint64_t before = mapping_calls(device);
  std::vector<void*> live;
  for (int i = 0; i < blocks; ++i) live.push_back(engine.malloc(size));
  for (void* p : live) engine.free(p);
  device.ledger().advance_host_time(step_us);
  engine.empty_cache();
  return mapping_calls(device) - before;
}

std::int64_t reserved(const Engine& engine) {
  return engine.stats().reserved_bytes[kAllPools].current;
}

// 32 blocks of 4 MiB a step (64 chunks): giving them back and creating them again costs ~6 ms
// at the H100's prices, against 1 ms of host time a step.
constexpr int kBlocks = 32;
constexpr std::size_t kSize = 4 * MiB;
constexpr double kShortStepUs = 1000;
constexpr std::int64_t kParameterPage = 2 << 20;  // the parameters' one page

TEST(EmptyCache, CallsAfterEveryStepStopCostingOnceTheyAreSeenToCost) {
  SimulatedDevice device;
  Engine engine(device);
  parameters(engine);
  std::vector<std::uint64_t> calls;
  for (int i = 0; i < 10; ++i) calls.push_back(step(engine, device, kBlocks, kSize, kShortStepUs));
  // The first three steps create their memory again and give it back; the third call is the
  // second in a row to find that costly, and keeps it.
  for (int i = 0; i < 2; ++i) EXPECT_GT(calls[i], 4u * kBlocks) << "step " << i;
  for (int i = 3; i < 10; ++i) EXPECT_EQ(calls[i], 0u) << "step " << i;
  const MemoryStats s = engine.stats();
  EXPECT_EQ(s.num_empty_cache, 10);
  EXPECT_GE(s.empty_cache_kept_bytes, static_cast<std::int64_t>(kBlocks * kSize));
  EXPECT_GE(reserved(engine), static_cast<std::int64_t>(kBlocks * kSize));
  EXPECT_EQ(s.allocated_bytes[kAllPools].current, 1 << 20);  // the parameters
}

TEST(EmptyCache, StrictGivesBackEverythingEveryTime) {
  SimulatedDevice device;
  EngineOptions options;
  options.strict_empty_cache = true;
  Engine engine(device, options);
  parameters(engine);
  for (int i = 0; i < 10; ++i) {
    EXPECT_GT(step(engine, device, kBlocks, kSize, kShortStepUs), 4u * kBlocks) << "step " << i;
    EXPECT_EQ(reserved(engine), kParameterPage) << "step " << i;
  }
  EXPECT_EQ(engine.stats().empty_cache_kept_bytes, 0);
}

TEST(EmptyCache, CallsFarApartGiveBackEverything) {
  // 10 s a step: ~6 ms of driver calls is far below a tenth of the time.
  SimulatedDevice device;
  Engine engine(device);
  parameters(engine);
  for (int i = 0; i < 10; ++i) {
    step(engine, device, kBlocks, kSize, 10e6);
    EXPECT_EQ(reserved(engine), kParameterPage) << "step " << i;
  }
  EXPECT_EQ(engine.stats().empty_cache_kept_bytes, 0);
}

TEST(EmptyCache, ACallWithNoBlockLiveGivesBackEverything) {
  SimulatedDevice device;
  Engine engine(device);
  void* params = parameters(engine);
  for (int i = 0; i < 6; ++i) step(engine, device, kBlocks, kSize, kShortStepUs);
  ASSERT_GT(engine.stats().empty_cache_kept_bytes, 0);
  engine.free(params);  // the program is done
  engine.empty_cache();
  EXPECT_EQ(reserved(engine), 0);
  EXPECT_EQ(device.memory().chunk_bytes(), 0u);
}

TEST(EmptyCache, ACallGivesBackWhatNoPageInUseNeeds) {
  SimulatedDevice device;
  Engine engine(device);
  void* kept = engine.malloc(kSize);
  std::vector<void*> gone;
  for (int i = 0; i < kBlocks; ++i) gone.push_back(engine.malloc(kSize));
  for (void* p : gone) engine.free(p);
  engine.empty_cache();
  EXPECT_EQ(reserved(engine), static_cast<std::int64_t>(kSize));
  engine.free(kept);
  engine.empty_cache();
  EXPECT_EQ(reserved(engine), 0);
}

TEST(EmptyCache, WhatRecentStepsStoppedUsingStillGoesBack) {
  SimulatedDevice device;
  Engine engine(device);
  parameters(engine);
  for (int i = 0; i < 6; ++i) step(engine, device, kBlocks, kSize, kShortStepUs);
  ASSERT_GT(engine.stats().empty_cache_kept_bytes, 0);
  // The program now needs a quarter of that: within kWindow calls the rest goes back.
  for (std::size_t i = 0; i <= detail::EmptyCacheRule::kWindow; ++i)
    step(engine, device, kBlocks / 4, kSize, kShortStepUs);
  // A quarter's chunks, with the clash rule's allowance (a few pages).
  EXPECT_LE(reserved(engine), kBlocks / 4 * kSize + kParameterPage + 8 * 2 * MiB);
  // And steps of varying sizes keep what their largest needs: no calls once it has been seen.
  for (int i = 0; i < 4; ++i) step(engine, device, kBlocks, kSize, kShortStepUs);
  std::uint64_t calls = 0;
  for (int i = 0; i < 6; ++i)
    calls += step(engine, device, i % 2 ? kBlocks : kBlocks / 4, kSize, kShortStepUs);
  EXPECT_EQ(calls, 0u);
}

TEST(EmptyCacheRule, KeepsAfterTwoCostlyCallsInARow) {
  detail::EmptyCacheRule rule(false);
  // Call 1 at t=0 gives back 100 chunks; by t=1 ms the program created them again (100 * 93 us
  // of driver calls in 1 ms: costly), twice.
  EXPECT_FALSE(rule.keeps(0, 0));
  rule.called(0, 0, 100);
  EXPECT_FALSE(rule.keeps(1000, 100));
  rule.called(1000, 100, 100);
  EXPECT_TRUE(rule.keeps(2000, 200));
  // It stays so: a keeping call gives back little, and nothing is created again.
  rule.called(2000, 200, 0);
  EXPECT_TRUE(rule.keeps(1e9, 200));
}

TEST(EmptyCacheRule, WhatIsNotCreatedAgainOrIsCheapBreaksTheRun) {
  detail::EmptyCacheRule rule(false);
  rule.keeps(0, 0);
  rule.called(0, 0, 100);
  EXPECT_FALSE(rule.keeps(1000, 100));  // costly: one
  rule.called(1000, 100, 100);
  EXPECT_FALSE(rule.keeps(2000, 140));  // 40 of 100 created again: not the loop
  rule.called(2000, 140, 100);
  EXPECT_FALSE(rule.keeps(3000, 240));  // costly: one again
  rule.called(3000, 240, 100);
  EXPECT_FALSE(rule.keeps(1e7, 340));   // 9.3 ms of calls in 10 s: cheap
  // Strict never keeps.
  detail::EmptyCacheRule strict(true);
  for (int i = 0; i < 5; ++i) {
    EXPECT_FALSE(strict.keeps(i * 1000.0, i * 100u));
    strict.called(i * 1000.0, i * 100u, 100);
  }
}

TEST(EmptyCacheRule, KeepsTheMostOfTheLastWindow) {
  detail::EmptyCacheRule rule(false);
  std::size_t kept = 0;
  for (std::size_t i = 0; i < detail::EmptyCacheRule::kWindow; ++i) {
    kept = rule.keep_bytes(i == 0 ? 500 : 100);  // the first call's interval needed the most
    rule.called(0, 0, 0);
  }
  EXPECT_EQ(kept, 500u);
  EXPECT_EQ(rule.keep_bytes(100), 100u);  // the first is now kWindow calls back: dropped
}

}  // namespace
}  // namespace gmem
