// PageRuns: the interior pages of large ranges kept as one record each, so that a range taken and
// given back again costs O(1) instead of a pass over its pages (PageBacking's fast path).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/page_table.hpp"

namespace gmem::detail {

// The interior pages of a large range (each wholly inside it: refs is 0 or 1 for all of them
// at once), kept as one record while only the fast path touches them, so that taking and giving
// back the same range again costs O(1) instead of a pass over its pages. A run is made when a
// range's interior pages come out of a malloc's pass alike (mapped, unaliased, listed as freed,
// the same stamp and reuse): the range was used before, and a step that repeats will take it
// again. Its pages are marked (Page::in_run) and hold the run's index in last_use; anything but
// the fast path that looks at one of them first writes the run's fields back into its pages
// (settle), which ends the run. A run's pages stay mapped, unaliased and listed while it lasts:
// only slow paths change those, and they settle first.
struct PageRun {
  std::uint32_t arena = 0;
  std::uint32_t first = 0, last = 0;  // page indices in the arena, inclusive
  std::uint32_t refs = 0;             // of each of its pages: 0 or 1
  std::uint64_t free_seq = 0;
  std::uint32_t last_use = 0;
  std::uint32_t reuse = 0;
  bool live = false;
};

class PageRuns {
 public:
  // Runs shorter than this are not worth a record: a pass over them costs a few hundred ns.
  static constexpr std::size_t kMinPages = 64;
  static constexpr std::uint32_t kNone = ~std::uint32_t{0};

  // Whether any run lives: while none does, the passes over pages need not look for runs.
  bool any() const { return live_ != 0; }
  PageRun& operator[](std::uint32_t index) { return runs_[index]; }
  const PageRun& operator[](std::uint32_t index) const { return runs_[index]; }
  // A page's references: its own, or its run's.
  std::uint32_t refs_of(const Page& p) const { return p.in_run ? runs_[p.last_use].refs : p.refs; }
  // The run that is exactly the interior pages [first, last] of a range in `pages`, or kNone.
  std::uint32_t at(const PageTable& pages, std::size_t first, std::size_t last) const {
    if (last < first || last - first + 1 < kMinPages) return kNone;
    const Page& p = pages.get(first);
    if (!p.in_run) return kNone;
    const PageRun& run = runs_[p.last_use];
    return run.first == first && run.last == last ? p.last_use : kNone;
  }
  // Makes pages [first, last] of `arena` (interior pages just taken, ready; `pages` is the
  // arena's table) a run if they are alike. Never throws: without memory for a record the pages
  // keep their own fields.
  void make(std::uint32_t arena, PageTable& pages, std::size_t first, std::size_t last);
  // Ends a run, writing its fields back into its pages (`pages`: its arena's table).
  void end(std::uint32_t index, PageTable& pages);

  // For Backing::check_invariants: every record, live or not, and the counts kept of them.
  const std::vector<PageRun>& records() const { return runs_; }
  std::size_t unused() const { return unused_.size(); }
  std::size_t live() const { return live_; }

 private:
  std::vector<PageRun> runs_;
  std::vector<std::uint32_t> unused_;  // indices of runs_ that are not live
  std::size_t live_ = 0;
};

}  // namespace gmem::detail
