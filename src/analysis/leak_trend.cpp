#include "analysis/leak_trend.hpp"

#include <algorithm>

namespace gmem::analysis {
namespace {

std::int64_t median(std::vector<std::int64_t> values) {
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2),
                   values.end());
  return values[values.size() / 2];
}

}  // namespace

bool changes_since_last_drop(const std::vector<std::pair<std::size_t, std::int64_t>>& changes,
                             double tolerance, std::vector<Growth>& diffs) {
  std::int64_t before = 0, high = 0, high_before_drop = 0;
  for (const auto& [k, bytes] : changes) {
    const std::int64_t diff = bytes - before;
    if (diff < 0 && static_cast<double>(-diff) > tolerance * static_cast<double>(before)) {
      diffs.clear();
      high_before_drop = high;
    } else {
      diffs.push_back({k, diff});
    }
    before = bytes;
    high = std::max(high, bytes);
  }
  return before > high_before_drop;
}

std::optional<Trend> find_trend(const std::vector<Growth>& diffs, std::size_t last, const LeakOptions& options) {
  std::vector<std::int64_t> positive;
  for (const Growth& g : diffs)
    if (g.bytes > 0) positive.push_back(g.bytes);
  if (positive.size() < options.min_growing_periods) return std::nullopt;

  // One-off jumps (a workspace created on first use, optimizer state) are not the trend; inside
  // it, or just before it, such a step is taken to have leaked the usual amount too.
  const double limit = options.one_off_factor * static_cast<double>(median(positive));
  std::vector<Growth> growth;
  std::vector<std::size_t> one_offs;
  for (const Growth& g : diffs) {
    if (g.bytes > 0 && static_cast<double>(g.bytes) <= limit) growth.push_back(g);
    else if (g.bytes > 0) one_offs.push_back(g.k);
  }
  if (growth.size() < options.min_growing_periods) return std::nullopt;
  Trend trend;
  trend.first = growth.front().k;
  std::size_t one_off_steps = 0;
  for (auto k = one_offs.rbegin(); k != one_offs.rend(); ++k) {
    if (*k + 1 == trend.first) trend.first = *k;
    if (*k >= trend.first) ++one_off_steps;
  }
  trend.periods = last - trend.first + 1;
  trend.growing = growth.size() + one_off_steps;

  // The site's rhythm: how many steps apart it usually grows (1: every step; 4: every fourth
  // period, as when steps are found per micro-batch of a gradient accumulation).
  std::vector<std::int64_t> gaps;
  for (std::size_t i = 1; i < growth.size(); ++i)
    gaps.push_back(static_cast<std::int64_t>(growth[i].k - growth[i - 1].k));
  const auto rhythm = static_cast<std::size_t>(median(gaps));
  const auto longest = static_cast<std::size_t>(*std::max_element(gaps.begin(), gaps.end()));
  // A leak grows regularly (noise does not), at most steps of its rhythm since it began, and is
  // still growing at the end (a cache that filled up and stopped shows a longer quiet stretch).
  if (longest > 2 * rhythm + 1) return std::nullopt;
  if (static_cast<double>(trend.growing) <
      options.min_growing_fraction * static_cast<double>(trend.periods) / static_cast<double>(rhythm))
    return std::nullopt;
  if (last - growth.back().k > longest) return std::nullopt;

  std::vector<std::int64_t> usual;
  for (const Growth& g : growth) usual.push_back(g.bytes);
  trend.usual = median(usual);
  trend.grown = trend.usual * static_cast<std::int64_t>(one_off_steps);
  for (const Growth& g : diffs)
    if (g.k >= trend.first && g.bytes < 0) trend.grown += g.bytes;  // tolerated drops
  for (const Growth& g : growth) trend.grown += g.bytes;
  if (trend.grown <= 0) return std::nullopt;
  return trend;
}

}  // namespace gmem::analysis
