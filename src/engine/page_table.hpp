// Physical pages behind every arena's virtual range: which chunk is mapped at each granule, how
// many used ranges (blocks, slabs) overlap it, and, for pages mapped but wholly free, an LRU
// list from which the engine reclaims chunks to map them elsewhere (stitching).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gmem/device.hpp"

namespace gmem::detail {

// A page anywhere: arena index in the high half, page index within the arena in the low half.
using PageId = std::uint64_t;
inline constexpr PageId kNoPage = ~PageId{0};
inline PageId page_id(std::uint32_t arena, std::uint32_t index) {
  return (PageId{arena} << 32) | index;
}

struct Page {
  ChunkHandle chunk = 0;       // 0: nothing mapped here
  std::uint32_t refs = 0;      // used ranges overlapping the page
  std::uint32_t stream = 0;    // stream index of the arena, for the reuse rule
  std::uint64_t free_seq = 0;  // the stream's free stamp when refs last dropped to 0
  PageId lru_prev = kNoPage, lru_next = kNoPage;
};

class PageTable {
 public:
  // Adds the pages of a new arena; returns the arena's index.
  std::uint32_t add_arena(std::size_t pages, std::uint32_t stream);
  Page& at(PageId id) { return arenas_[id >> 32][id & 0xffffffffu]; }
  const Page& at(PageId id) const { return arenas_[id >> 32][id & 0xffffffffu]; }
  std::vector<Page>& arena(std::uint32_t index) { return arenas_[index]; }
  const std::vector<Page>& arena(std::uint32_t index) const { return arenas_[index]; }

  // The cached list: mapped pages with no user, oldest free first.
  void push_cached(PageId id);
  void remove_cached(PageId id);
  PageId oldest_cached() const { return lru_head_; }
  PageId next_cached(PageId id) const { return at(id).lru_next; }
  PageId newest_cached() const { return lru_tail_; }
  PageId prev_cached(PageId id) const { return at(id).lru_prev; }
  std::size_t cached() const { return cached_; }
  std::size_t mapped() const { return mapped_; }
  void add_mapped(std::ptrdiff_t delta) { mapped_ = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(mapped_) + delta); }

 private:
  std::vector<std::vector<Page>> arenas_;
  PageId lru_head_ = kNoPage, lru_tail_ = kNoPage;
  std::size_t cached_ = 0;
  std::size_t mapped_ = 0;
};

}  // namespace gmem::detail
