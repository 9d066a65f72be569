#include "engine/page_table.hpp"

namespace gmem::detail {

std::uint32_t PageTable::add_arena(std::size_t pages, std::uint32_t stream) {
  arenas_.emplace_back(pages);
  for (Page& p : arenas_.back()) p.stream = stream;
  return static_cast<std::uint32_t>(arenas_.size() - 1);
}

void PageTable::push_cached(PageId id) {
  Page& p = at(id);
  p.lru_prev = lru_tail_;
  p.lru_next = kNoPage;
  if (lru_tail_ != kNoPage) at(lru_tail_).lru_next = id;
  else lru_head_ = id;
  lru_tail_ = id;
  ++cached_;
}

void PageTable::remove_cached(PageId id) {
  Page& p = at(id);
  if (p.lru_prev != kNoPage) at(p.lru_prev).lru_next = p.lru_next;
  else lru_head_ = p.lru_next;
  if (p.lru_next != kNoPage) at(p.lru_next).lru_prev = p.lru_prev;
  else lru_tail_ = p.lru_prev;
  p.lru_prev = p.lru_next = kNoPage;
  --cached_;
}

}  // namespace gmem::detail
