// The plan region's used ranges by offset (planned blocks only live there), so that a planned
// malloc can tell whether its planned range is free and which free range holds it, without a walk
// over the region's ranges: the used range with the highest start below the block's end is the
// only one that can overlap it (used ranges never overlap, so their ends are in the same order
// as their starts), and the range after it is the free one that holds the block. Its tree nodes
// come from a pool of its own, so that a planned malloc and free, once as many blocks have lived
// at once before, allocate nothing.
#pragma once

#include <cstddef>
#include <iterator>
#include <map>
#include <memory_resource>

#include "engine/range_allocator.hpp"

namespace gmem::detail {

class PlanRegion {
 public:
  // The free range of `ranges` holding [addr, addr + size), or kNoNode where a used one overlaps.
  NodeId free_node(const RangeAllocator& ranges, DevicePtr addr, std::size_t size) const {
    const auto after = used_.lower_bound(addr + size);
    NodeId node = ranges.first();
    if (after != used_.begin()) {
      const auto& [start, before] = *std::prev(after);
      if (start + ranges.node(before).size > addr) return kNoNode;
      node = ranges.node(before).next;
    }
    if (node == kNoNode) return kNoNode;
    const RangeNode& n = ranges.node(node);
    return n.free && n.addr <= addr && n.addr + n.size >= addr + size ? node : kNoNode;
  }
  void add(DevicePtr addr, NodeId node) { used_.emplace(addr, node); }
  void remove(DevicePtr addr) { used_.erase(addr); }
  std::size_t size() const { return used_.size(); }
  bool contains(DevicePtr addr, NodeId node) const {
    const auto it = used_.find(addr);
    return it != used_.end() && it->second == node;
  }

 private:
  std::pmr::unsynchronized_pool_resource pool_;
  std::pmr::map<DevicePtr, NodeId> used_{&pool_};  // start -> used node
};

}  // namespace gmem::detail
