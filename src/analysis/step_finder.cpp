// Step inference: prominent minima of live memory, or the most frequent recurring allocation.
#include "analysis/step_finder.hpp"

#include <algorithm>
#include <unordered_map>

namespace gmem::analysis {
namespace {

// For each i, the highest value between i and the nearest strictly lower value to its left (or
// the start): how far the curve climbs on the left before it comes lower than live[i].
std::vector<std::int64_t> left_climb(const std::vector<std::int64_t>& live) {
  struct Entry {
    std::int64_t value, span_max;  // span_max: highest value since the entry below it
  };
  std::vector<Entry> stack;
  std::vector<std::int64_t> climb(live.size());
  for (std::size_t i = 0; i < live.size(); ++i) {
    std::int64_t span_max = live[i];
    while (!stack.empty() && stack.back().value >= live[i]) {
      span_max = std::max(span_max, stack.back().span_max);
      stack.pop_back();
    }
    climb[i] = span_max;
    stack.push_back({live[i], span_max});
  }
  return climb;
}

}  // namespace

std::vector<std::size_t> step_ends_from_live_minima(const std::vector<std::int64_t>& live) {
  const std::size_t n = live.size();
  if (n < 3) return {};
  const std::vector<std::int64_t> left = left_climb(live);
  std::vector<std::int64_t> reversed(live.rbegin(), live.rend());
  std::vector<std::int64_t> right = left_climb(reversed);
  std::reverse(right.begin(), right.end());

  std::vector<std::int64_t> prominence(n);
  std::int64_t deepest = 0;
  for (std::size_t i = 0; i < n; ++i) {
    prominence[i] = std::min(left[i], right[i]) - live[i];
    deepest = std::max(deepest, prominence[i]);
  }
  if (deepest <= 0) return {};
  const std::int64_t weak = deepest / 4, strong = deepest / 2;

  // Candidates; two minima with only a small bump between them are one basin: keep the lower.
  std::vector<std::size_t> minima;
  std::int64_t highest = 0;  // highest value since minima.back()
  for (std::size_t i = 0; i < n; ++i) {
    highest = std::max(highest, live[i]);
    if (prominence[i] < weak || prominence[i] == 0) continue;
    if (!minima.empty()) {
      const std::size_t previous = minima.back();
      if (highest - std::max(live[previous], live[i]) < weak) {
        if (live[i] < live[previous]) {
          minima.back() = i;
          highest = live[i];
        }
        continue;
      }
    }
    minima.push_back(i);
    highest = live[i];
  }

  // A weaker minimum is a step end only when it lies as low as the strong ones around it (a dip
  // between forward and backward lies far above the baseline), and nearer to it than its own
  // depth. Where lengths vary, a shorter step's dip can lie within typical/4 of the baseline and
  // still be no end: LoRA fine-tuning's step of 4 x 1280 tokens dips to 2.9 GiB above the frozen
  // weights, about 3.5 GiB below its forward's and backward's peaks (held-out lora_llama).
  std::vector<std::size_t> strong_minima;
  std::vector<std::int64_t> strong_prominence;
  for (std::size_t i : minima) {
    if (prominence[i] >= strong) {
      strong_minima.push_back(i);
      strong_prominence.push_back(prominence[i]);
    }
  }
  if (strong_prominence.empty()) return minima;
  std::nth_element(strong_prominence.begin(),
                   strong_prominence.begin() + static_cast<std::ptrdiff_t>(strong_prominence.size() / 2),
                   strong_prominence.end());
  const std::int64_t typical = strong_prominence[strong_prominence.size() / 2];

  std::vector<std::size_t> ends;
  for (std::size_t i : minima) {
    if (prominence[i] >= strong) {
      ends.push_back(i);
      continue;
    }
    const auto next = std::upper_bound(strong_minima.begin(), strong_minima.end(), i);
    std::int64_t baseline = 0;
    if (next != strong_minima.end()) baseline = std::max(baseline, live[*next]);
    if (next != strong_minima.begin()) baseline = std::max(baseline, live[*(next - 1)]);
    if (live[i] <= baseline + std::min(typical, prominence[i]) / 4) ends.push_back(i);
  }
  return ends;
}

std::vector<std::size_t> step_starts_from_recurrence(const std::vector<std::uint64_t>& keys) {
  std::unordered_map<std::uint64_t, std::size_t> count;
  for (std::uint64_t key : keys) ++count[key];
  std::size_t best_count = 2;
  std::uint64_t best = 0;
  bool found = false;
  for (std::uint64_t key : keys) {  // in order of first appearance: ties go to the earliest
    const std::size_t c = count[key];
    if (c > best_count) {
      best_count = c;
      best = key;
      found = true;
    }
  }
  std::vector<std::size_t> starts;
  if (!found) return starts;
  for (std::size_t i = 0; i < keys.size(); ++i)
    if (keys[i] == best) starts.push_back(i);
  return starts;
}

}  // namespace gmem::analysis
