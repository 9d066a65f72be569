// PageRuns: making a run of a range's interior pages, and writing one back into its pages.
#include "engine/page_runs.hpp"

namespace gmem::detail {

void PageRuns::make(std::uint32_t arena, PageTable& pages, std::size_t first, std::size_t last) {
  if (last < first || last - first + 1 < kMinPages) return;
  const Page& head = pages.at(first);
  const std::uint64_t free_seq = head.free_seq;
  const std::uint32_t last_use = head.last_use, reuse = head.reuse;
  for (std::size_t i = first; i <= last; ++i) {
    const Page& p = pages.at(i);
    if (!p.mapped() || p.aliased || !p.listed || p.in_run || p.free_seq != free_seq ||
        p.reuse != reuse || p.last_use != last_use || p.refs != 1)
      return;
  }
  std::uint32_t index;
  if (!unused_.empty()) {
    index = unused_.back();
    unused_.pop_back();
  } else {
    try {
      runs_.emplace_back();
      unused_.reserve(runs_.size());  // so that end never allocates
    } catch (...) {  // no run: the pages keep their own fields, as before
      if (runs_.size() > unused_.capacity()) runs_.pop_back();
      return;
    }
    index = static_cast<std::uint32_t>(runs_.size() - 1);
  }
  runs_[index] = PageRun{arena, static_cast<std::uint32_t>(first), static_cast<std::uint32_t>(last),
                         1, free_seq, last_use, reuse, true};
  ++live_;
  for (std::size_t i = first; i <= last; ++i) {
    Page& p = pages.at(i);
    p.in_run = 1;
    p.last_use = index;
  }
}

void PageRuns::end(std::uint32_t index, PageTable& pages) {
  PageRun& run = runs_[index];
  for (std::size_t i = run.first; i <= run.last; ++i) {
    Page& p = pages.at(i);
    p.refs = run.refs & 1u;
    p.free_seq = run.free_seq;
    p.last_use = run.last_use;
    p.reuse = run.reuse;
    p.in_run = 0;
  }
  run.live = false;
  --live_;
  unused_.push_back(index);
}

}  // namespace gmem::detail
