// ClashRule (src/engine/clash_rule.hpp): how far the engine may buy chunks for pages that keep
// having to be remapped. 1000 pages in use at the peak; each call is one clash at such a page.
#include <gtest/gtest.h>

#include "engine/clash_rule.hpp"

namespace gmem::detail {
namespace {

constexpr std::size_t kPeak = 1000;

// Chunks the rule allows at most: the largest `held` it still says yes to, plus one.
std::size_t allowed(ClashRule& rule, double now_us) {
  std::size_t held = kPeak;
  while (rule.allows_new_chunk(held, kPeak, ClashRule::kClashesToBuy, false, now_us)) ++held;
  return held;
}

// `count` clashes, each remapped outside a warm-up after `wait_us`, `step_us` apart.
double clash(ClashRule& rule, int count, double now_us, double step_us, double wait_us = 0) {
  for (int i = 0; i < count; ++i) {
    now_us += step_us;
    rule.count_cost(wait_us);
    rule.allows_new_chunk(0, kPeak, 1, false, now_us);
  }
  return now_us;
}

TEST(ClashRule, StartsAtOneTwoHundredthOfThePeakAndFourPages) {
  ClashRule rule(0);
  EXPECT_EQ(allowed(rule, 0), kPeak + kPeak / 200 + ClashRule::kPages);
}

TEST(ClashRule, AnOnlinePageBuysOnlyOnceItKeepsClashing) {
  // An online page's first clashes come while its layout forms: weighed, but they buy nothing.
  // A plan page buys at its first clash again: its plan is fixed.
  ClashRule rule(0);
  for (std::uint32_t before = 1; before < ClashRule::kClashesToBuy; ++before) {
    EXPECT_FALSE(rule.allows_new_chunk(kPeak, kPeak, before, false, 0)) << before;
    EXPECT_TRUE(rule.allows_new_chunk(kPeak, kPeak, before, true, 0)) << before;
  }
  EXPECT_TRUE(rule.allows_new_chunk(kPeak, kPeak, ClashRule::kClashesToBuy, false, 0));
  // Those that buy nothing count towards the share as any clash does (the count doubles it).
  ClashRule counted(0);
  for (std::size_t i = 0; i <= kPeak / 2; ++i) counted.allows_new_chunk(0, kPeak, 1, false, 0);
  EXPECT_EQ(allowed(counted, 0), kPeak + kPeak / 100 + ClashRule::kPages);
}

TEST(ClashRule, ClashesThatCostNothingBuyOneHundredthAtMost) {
  ClashRule rule(0);
  // A second between clashes: 62 us of remapping a second is far below a tenth of the time.
  const double now = clash(rule, 100 * static_cast<int>(kPeak), 0, 1e6);
  EXPECT_EQ(allowed(rule, now), kPeak + kPeak / ClashRule::kRecurringShare + ClashRule::kPages);
}

TEST(ClashRule, CostlyClashesBuyUpToOneEighth) {
  ClashRule rule(0);
  // The clock stands still: the remaps are all the time there is.
  clash(rule, 100 * static_cast<int>(kPeak), 0, 0);
  EXPECT_EQ(allowed(rule, 0), kPeak + kPeak / ClashRule::kMinShare + ClashRule::kPages);
}

TEST(ClashRule, OneCountDoublesTheShareOnce) {
  ClashRule rule(0);
  clash(rule, static_cast<int>(kPeak / 2) + 1, 0, 0);  // both bounds reach their first count
  EXPECT_EQ(allowed(rule, 0), kPeak + kPeak / 100 + ClashRule::kPages);
}

TEST(ClashRule, WaitsForTheStreamMakeClashesCostly) {
  // 1 ms apart: the remaps' 62 us alone are cheap; a 1 ms wait before each unmap is not.
  ClashRule cheap(0), waiting(0);
  const double end = clash(cheap, 10 * static_cast<int>(kPeak), 0, 1000);
  clash(waiting, 10 * static_cast<int>(kPeak), 0, 1000, 1000);
  EXPECT_EQ(allowed(cheap, end), kPeak + kPeak / ClashRule::kRecurringShare + ClashRule::kPages);
  EXPECT_GT(allowed(waiting, end), kPeak + kPeak / 50 + ClashRule::kPages);
}

TEST(ClashRule, AQuietStartDoesNotHideALateChurn) {
  // The engine is made at 0 and clashes start a minute later, back to back: the first window,
  // found cheap and older than kWindowUs, starts again, and the churn is then found costly.
  ClashRule rule(0);
  const double start = 60e6;
  clash(rule, 20 * static_cast<int>(kPeak), start, 0);
  EXPECT_EQ(allowed(rule, start), kPeak + kPeak / ClashRule::kMinShare + ClashRule::kPages);
}

TEST(ClashRule, ABurstIsWeighedOverAsLongAsTheWindowThatLastBought) {
  // A second of clashes, each after a 0.3 ms wait for its stream, costs 18% of it: the share
  // doubles (to 1/100). Then a new request's shapes remap 501 pages within 5 ms, and the program
  // goes on clashing cheaply (one every 2 ms, 3% of its time). The burst alone, 31 ms of
  // remapping in 5 ms, would look costly; weighed over a second, as long as the window that
  // bought, it is not, and the share stays (bert_large_serve bought 1/12 on such bursts, 1.10
  // times its peak, with its remaps 3% of its time whatever it held).
  ClashRule rule(0);
  const int half = static_cast<int>(kPeak / 2) + 1;
  double now = clash(rule, half, 0, 2000, 300);
  ClashRule after_the_second = rule;  // (allowed() counts clashes: ask a copy)
  EXPECT_EQ(allowed(after_the_second, now), kPeak + kPeak / 100 + ClashRule::kPages);
  now = clash(rule, half, now, 10);
  now = clash(rule, half, now, 2000);
  EXPECT_EQ(allowed(rule, now), kPeak + kPeak / 100 + ClashRule::kPages);
}

TEST(ClashRule, TimeInWarmUpsIsNotWeighed) {
  // Steps marked, 20 s of warm-ups (shapes new in every step, not yet found the norm), then
  // 3,000 clashes that count, 1 ms apart with a 0.5 ms wait for the stream each: half the time.
  // Weighed against the 20 s as well they would look cheap (7%); against the 3 s they had,
  // costly.
  ClashRule rule(0), unpaused(0);
  rule.set_counting(false, 0);
  rule.set_counting(true, 20e6);
  const int count = 3 * static_cast<int>(kPeak);
  const double end = clash(rule, count, 20e6, 1000, 500);
  clash(unpaused, count, 20e6, 1000, 500);
  EXPECT_GT(allowed(rule, end), kPeak + kPeak / 50 + ClashRule::kPages);
  EXPECT_EQ(allowed(unpaused, end), kPeak + kPeak / ClashRule::kRecurringShare + ClashRule::kPages);
}

TEST(ClashRule, TheFirstMarkStartsTheWindow) {
  // 20 s of building a model before the first step mark; then the same costly clashes.
  ClashRule rule(0);
  rule.restart_window(20e6);
  const double end = clash(rule, 3 * static_cast<int>(kPeak), 20e6, 1000, 500);
  EXPECT_GT(allowed(rule, end), kPeak + kPeak / 50 + ClashRule::kPages);
}

}  // namespace
}  // namespace gmem::detail
