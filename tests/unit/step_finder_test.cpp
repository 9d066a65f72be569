// Step ends found in a live-memory curve with no markers (analysis::step_ends_from_live_minima):
// the returns to the baseline, not the dips between forward and backward.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "analysis/step_finder.hpp"

namespace gmem::analysis {
namespace {

// One training step above `base`: the forward climbs to `peak`, falls to `dip` when its largest
// temporaries go (the logits' loss), the backward climbs to `back` and returns to the baseline.
void add_step(std::vector<std::int64_t>& live, std::int64_t base, std::int64_t peak, std::int64_t dip,
              std::int64_t back) {
  for (std::int64_t v : {base + peak / 2, base + peak, base + dip, base + back, base + back / 2, base})
    live.push_back(v);
}

// Lengths drawn per step (fine-tuning with dynamic padding): long steps and short ones, whose
// dip lies near the baseline in absolute terms (a short step keeps little for backward) but is
// as deep below its two climbs as a short step's end is: a dip, not an end.
TEST(StepFinder, AShortStepsDipBetweenForwardAndBackwardIsNotAStepEnd) {
  const std::int64_t base = 1000;
  std::vector<std::int64_t> live{base};
  std::vector<std::size_t> expected;
  const char* order = "LLSLSSLLSLLS";
  for (const char* c = order; *c; ++c) {
    if (*c == 'L')
      add_step(live, base, 100, 55, 90);  // the dip 35 below the backward's climb: shallow
    else
      add_step(live, base, 60, 18, 54);   // the dip 18 above the baseline, 36 below its climbs
    expected.push_back(live.size() - 1);
  }
  expected.pop_back();  // the last return has no climb after it: nothing says a step ends there
  EXPECT_EQ(step_ends_from_live_minima(live), expected);
}

// A short step's own end is still one: it returns to the baseline.
TEST(StepFinder, AShortStepsReturnToTheBaselineIsAStepEnd) {
  const std::int64_t base = 1000;
  std::vector<std::int64_t> live{base};
  for (int i = 0; i < 6; ++i) add_step(live, base, 100, 55, 90);
  add_step(live, base, 60, 40, 54);
  const std::size_t short_end = live.size() - 1;
  for (int i = 0; i < 6; ++i) add_step(live, base, 100, 55, 90);
  const std::vector<std::size_t> ends = step_ends_from_live_minima(live);
  EXPECT_EQ(ends.size(), 12u);
  EXPECT_NE(std::find(ends.begin(), ends.end(), short_end), ends.end());
}

}  // namespace
}  // namespace gmem::analysis
