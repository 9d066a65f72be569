#include "engine/range_allocator.hpp"

#include <bit>
#include <cassert>

namespace gmem::detail {

RangeAllocator::RangeAllocator(DevicePtr base, std::size_t size)
    : base_(base), size_(size), bin_heads_(kLevels * 16, kNoNode) {
  nodes_.reserve(256);
  first_ = new_node();
  nodes_[first_].addr = base;
  nodes_[first_].size = size;
  insert_free(first_);
}

int RangeAllocator::bin_of(std::size_t size) {
  const int level = static_cast<int>(std::bit_width(size)) - 1;  // 2^level <= size
  const int sub = static_cast<int>((size >> (level - 4)) & 15);
  return (level - kMinShift) * 16 + sub;
}

NodeId RangeAllocator::new_node() {
  if (spare_nodes_ != kNoNode) {
    const NodeId id = spare_nodes_;
    spare_nodes_ = nodes_[id].next;
    nodes_[id] = RangeNode{};
    return id;
  }
  nodes_.emplace_back();
  return static_cast<NodeId>(nodes_.size() - 1);
}

void RangeAllocator::delete_node(NodeId id) {
  nodes_[id].next = spare_nodes_;
  spare_nodes_ = id;
}

void RangeAllocator::insert_free(NodeId id) {
  RangeNode& n = nodes_[id];
  const int bin = bin_of(n.size);
  n.free = true;
  n.bin = static_cast<std::uint16_t>(bin);
  n.bin_prev = kNoNode;
  n.bin_next = bin_heads_[bin];
  if (n.bin_next != kNoNode) nodes_[n.bin_next].bin_prev = id;
  bin_heads_[bin] = id;
  level_bitmap_ |= std::uint64_t{1} << (bin / 16);
  bin_bitmaps_[bin / 16] = static_cast<std::uint16_t>(bin_bitmaps_[bin / 16] | (1u << (bin % 16)));
  ++free_count_;
}

void RangeAllocator::remove_free(NodeId id) {
  RangeNode& n = nodes_[id];
  if (n.bin_prev != kNoNode) nodes_[n.bin_prev].bin_next = n.bin_next;
  else bin_heads_[n.bin] = n.bin_next;
  if (n.bin_next != kNoNode) nodes_[n.bin_next].bin_prev = n.bin_prev;
  if (bin_heads_[n.bin] == kNoNode) {
    auto& bits = bin_bitmaps_[n.bin / 16];
    bits = static_cast<std::uint16_t>(bits & ~(1u << (n.bin % 16)));
    if (bits == 0) level_bitmap_ &= ~(std::uint64_t{1} << (n.bin / 16));
  }
  n.free = false;
  --free_count_;
}

NodeId RangeAllocator::scan_bin(int bin, std::size_t size, int limit) const {
  NodeId best = kNoNode;
  for (NodeId id = bin_heads_[bin]; id != kNoNode && limit-- > 0; id = nodes_[id].bin_next) {
    const std::size_t s = nodes_[id].size;
    if (s < size) continue;
    if (best == kNoNode || s < nodes_[best].size) {
      best = id;
      if (s == size) break;
    }
  }
  return best;
}

NodeId RangeAllocator::find(std::size_t size) const {
  const int bin = bin_of(size);
  // The request's own bin holds ranges both smaller and larger than it: scan for the best fit.
  if (NodeId id = scan_bin(bin, size, 64); id != kNoNode) return id;
  // Every range in a higher bin fits; take the smallest of the first few in the first such bin.
  const int next = next_nonempty_bin(bin);
  return next < kLevels * 16 ? scan_bin(next, size, 16) : kNoNode;
}

int RangeAllocator::next_nonempty_bin(int bin) const {
  int level = bin / 16;
  std::uint32_t subs = bin_bitmaps_[level] & ~((2u << (bin % 16)) - 1);
  if (subs == 0) {
    const std::uint64_t levels =
        level + 1 < 64 ? level_bitmap_ & ~((std::uint64_t{2} << level) - 1) : 0;
    if (levels == 0) return kLevels * 16;
    level = std::countr_zero(levels);
    subs = bin_bitmaps_[level];
  }
  return level * 16 + std::countr_zero(subs);
}

NodeId RangeAllocator::split_front(NodeId id, std::size_t size) {
  const NodeId rest = new_node();  // may reallocate nodes_: index again below
  RangeNode& n = nodes_[id];
  RangeNode& r = nodes_[rest];
  r.addr = n.addr + size;
  r.size = n.size - size;
  r.prev = id;
  r.next = n.next;
  if (n.next != kNoNode) nodes_[n.next].prev = rest;
  n.next = rest;
  n.size = size;
  return rest;
}

NodeId RangeAllocator::take(NodeId id, std::size_t size, std::size_t offset) {
  assert(nodes_[id].free && nodes_[id].size >= offset + size);
  remove_free(id);
  if (offset > 0) {  // the front stays free
    const NodeId used = split_front(id, offset);
    insert_free(id);
    id = used;
  }
  if (nodes_[id].size > size) insert_free(split_front(id, size));
  return id;
}

NodeId RangeAllocator::release(NodeId id) {
  assert(!nodes_[id].free);
  const NodeId next = nodes_[id].next;
  if (next != kNoNode && nodes_[next].free) {
    remove_free(next);
    nodes_[id].size += nodes_[next].size;
    nodes_[id].next = nodes_[next].next;
    if (nodes_[id].next != kNoNode) nodes_[nodes_[id].next].prev = id;
    delete_node(next);
  }
  const NodeId prev = nodes_[id].prev;
  if (prev != kNoNode && nodes_[prev].free) {
    remove_free(prev);
    nodes_[prev].size += nodes_[id].size;
    nodes_[prev].next = nodes_[id].next;
    if (nodes_[prev].next != kNoNode) nodes_[nodes_[prev].next].prev = prev;
    delete_node(id);
    id = prev;
  }
  insert_free(id);
  return id;
}

}  // namespace gmem::detail
