// The virtual address space of one arena as address-ordered ranges, each free or used. Free
// ranges sit in segregated size bins (TLSF: 16 bins per power of two, bitmaps to find the next
// non-empty bin), so best fit is a bin lookup plus a short scan; a freed range merges with free
// neighbours. Knows nothing of physical memory: the engine backs ranges with pages.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "gmem/device.hpp"

namespace gmem::detail {

using NodeId = std::uint32_t;
inline constexpr NodeId kNoNode = ~NodeId{0};

struct RangeNode {
  DevicePtr addr = 0;
  std::size_t size = 0;
  NodeId prev = kNoNode, next = kNoNode;          // neighbours in address order
  NodeId bin_prev = kNoNode, bin_next = kNoNode;  // free list of the node's bin
  std::uint16_t bin = 0;
  bool free = false;
  // A used range's block's ordinal in its step's record (StepPlanner::taken), handed back when
  // it is freed; set by the range's user, kept in what would be padding.
  std::uint32_t plan_ordinal = ~std::uint32_t{0};
};
static_assert(sizeof(RangeNode) == 40, "plan_ordinal fits in the node's padding");

class RangeAllocator {
 public:
  // Manages [base, base + size); sizes handed out are multiples of 512.
  RangeAllocator(DevicePtr base, std::size_t size);

  // A free range of at least `size` bytes, the smallest found; kNoNode when none fits.
  NodeId find(std::size_t size) const;
  // Visits free ranges of at least `size` bytes, smallest bins first, at most `limit` of them;
  // stops early when `visit(id)` returns true.
  template <class Visit>
  void for_each_fit(std::size_t size, int limit, Visit&& visit) const {
    for (int bin = bin_of(size); bin < kLevels * 16 && limit > 0; ++bin) {
      if (!(bin_bitmaps_[bin / 16] & (1u << (bin % 16)))) {
        bin = next_nonempty_bin(bin) - 1;
        continue;
      }
      for (NodeId id = bin_heads_[bin]; id != kNoNode && limit > 0; id = nodes_[id].bin_next) {
        if (nodes_[id].size < size) continue;
        --limit;
        if (visit(id)) return;
      }
    }
  }
  // Uses `size` bytes of free range `id` starting `offset` bytes in; what is left on either
  // side stays free. Returns the used node.
  NodeId take(NodeId id, std::size_t size, std::size_t offset = 0);
  // Frees used node `id`, merging with free neighbours; returns the resulting free node.
  NodeId release(NodeId id);

  const RangeNode& node(NodeId id) const { return nodes_[id]; }
  // Sets a used range's RangeNode::plan_ordinal (the only field its user writes).
  void set_plan_ordinal(NodeId id, std::uint32_t ordinal) { nodes_[id].plan_ordinal = ordinal; }
  NodeId first() const { return first_; }
  DevicePtr base() const { return base_; }
  std::size_t size() const { return size_; }
  std::size_t free_ranges() const { return free_count_; }

 private:
  static constexpr int kMinShift = 9;  // 512 B
  static constexpr int kLevels = 48 - kMinShift;
  static int bin_of(std::size_t size);  // the bin whose sizes start at or below `size`
  NodeId new_node();
  void delete_node(NodeId id);
  void insert_free(NodeId id);
  void remove_free(NodeId id);
  NodeId scan_bin(int bin, std::size_t size, int limit) const;
  int next_nonempty_bin(int bin) const;  // first non-empty bin after `bin`, or the end
  NodeId split_front(NodeId id, std::size_t size);  // keeps `size` in id, returns the rest

  DevicePtr base_;
  std::size_t size_;
  std::vector<RangeNode> nodes_;
  NodeId spare_nodes_ = kNoNode;  // recycled nodes, linked through `next`
  NodeId first_ = kNoNode;
  std::size_t free_count_ = 0;
  std::vector<NodeId> bin_heads_;
  std::uint64_t level_bitmap_ = 0;
  std::array<std::uint16_t, kLevels> bin_bitmaps_{};
};

}  // namespace gmem::detail
