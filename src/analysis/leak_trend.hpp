// Judging one site: does S(k), the bytes it holds that survived a whole step, grow as a leak does
// (regularly, up to the last boundary), or as warm-up, a cache or noise does?
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "gmem/leaks.hpp"

namespace gmem::analysis {

struct Growth {
  std::size_t k;       // boundary
  std::int64_t bytes;  // S(k) - S(previous change)
};

// The changes of S (given where it changed: (k, S(k))) since its last real drop: a drop ends any
// trend before it. False when S is no higher now than before that drop: a history cleared every
// N steps is not a leak until it holds more than it ever did.
bool changes_since_last_drop(const std::vector<std::pair<std::size_t, std::int64_t>>& changes,
                             double tolerance, std::vector<Growth>& diffs);

struct Trend {
  std::size_t first = 0;    // boundary where the growth began
  std::size_t periods = 0;  // boundaries from `first` to the last
  std::size_t growing = 0;  // of those, how many grew
  std::int64_t grown = 0;   // bytes accumulated (one-off jumps replaced by the usual growth)
  std::int64_t usual = 0;   // the median growth of a step that grew
};

// The trend in `diffs` (the changes of S up to boundary `last`), or none.
std::optional<Trend> find_trend(const std::vector<Growth>& diffs, std::size_t last, const LeakOptions& options);

}  // namespace gmem::analysis
