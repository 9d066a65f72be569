// Pages whose last user left while they were mapped, oldest first: where stitching looks for a
// free chunk to map elsewhere. A page is listed at most once (Page::listed). An entry goes stale
// when its page is used again or unmapped; it stays until a scan drops it, so that a free (the
// hot path) only sets a bit and appends, and a steady loop, which never scans, never sweeps.
// A scan closes the gaps it walked over (close_gaps_before), so no scan walks over the same
// dropped entry twice: a scan costs what it examines, not what earlier scans dropped.
#pragma once

#include <cstddef>
#include <vector>

#include "engine/page_table.hpp"

namespace gmem::detail {

class FreedPages {
 public:
  void add(PageId id, Page& page) {
    if (page.listed) return;
    page.listed = 1;
    ids_.push_back(id);
  }
  // Entries are visited by index from begin() (the oldest) to end(); kNoPage: dropped.
  std::size_t begin() const { return head_; }
  std::size_t end() const { return ids_.size(); }
  PageId at(std::size_t k) const { return ids_[k]; }
  void drop(std::size_t k, Page& page) {
    page.listed = 0;
    if (k == head_) {
      ++head_;
    } else {
      ids_[k] = kNoPage;
      ++holes_;
    }
  }
  // Packs the entries before `end` against it, keeping their order, and returns where the
  // entry at `tracked` went (tracked may be end(): not tracked). Costs end - begin().
  std::size_t close_gaps_before(std::size_t end, std::size_t tracked) {
    std::size_t write = end;
    for (std::size_t k = end; k-- > head_;) {
      if (ids_[k] == kNoPage) {
        --holes_;
        continue;
      }
      ids_[--write] = ids_[k];
      if (k == tracked) tracked = write;
    }
    head_ = write;
    return tracked;
  }
  // Once dropped entries make up half the list, closes the gaps (indices change).
  void sweep() {
    const std::size_t dropped = head_ + holes_;
    if (dropped < 1024 || 2 * dropped < ids_.size()) return;
    std::size_t out = 0;
    for (std::size_t k = head_; k < ids_.size(); ++k)
      if (ids_[k] != kNoPage) ids_[out++] = ids_[k];
    ids_.resize(out);
    head_ = holes_ = 0;
  }
  std::size_t listed() const { return ids_.size() - head_ - holes_; }

 private:
  std::vector<PageId> ids_;
  std::size_t head_ = 0;   // entries before it are dropped
  std::size_t holes_ = 0;  // dropped entries after head_ (kNoPage)
};

}  // namespace gmem::detail
