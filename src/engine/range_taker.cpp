#include "engine/range_taker.hpp"

namespace gmem::detail {

void RangeTaker::throw_no_address_space(const NoAddressSpace& e) {
  chunks_.set_oom_reason("address space");
  chunks_.throw_oom(e.min_bytes, streams_.progress.stream(e.stream));
}

RangeTaker::Taken RangeTaker::take_online(std::uint32_t si, std::size_t bytes,
                                          std::size_t requested) {
  try {
    if (placement_.keeps_places()) [[unlikely]] return take_kept(si, bytes, requested);
    return take_placed(placement_.online(si, bytes, pages_.clock()), bytes, requested);
  } catch (const NoAddressSpace& e) {
    throw_no_address_space(e);
  }
}

std::optional<RangeTaker::Taken> RangeTaker::take_and_back(const Placement::Spot& spot,
                                                           std::size_t bytes) {
  RangeAllocator& ranges = arenas_[spot.arena].ranges;
  const NodeId node = ranges.take(spot.node, bytes, spot.offset);
  const DevicePtr addr = ranges.node(node).addr;
  bool backed = false;
  try {
    backed = back(spot.arena, addr, bytes);
  } catch (...) {
    ranges.release(node);
    throw;
  }
  if (!backed) [[unlikely]] {
    ranges.release(node);
    return std::nullopt;
  }
  pages_.pin_if_pinning(spot.arena, addr, bytes);
  return Taken{spot.arena, node, addr};
}

RangeTaker::Taken RangeTaker::take_placed(const Placement::Spot& spot, std::size_t bytes,
                                          std::size_t requested) {
  if (const std::optional<Taken> taken = take_and_back(spot, bytes)) [[likely]] return *taken;
  chunks_.release_spares();  // chunks created for this request go back to the device
  chunks_.throw_oom(requested, streams_.progress.stream(arenas_[spot.arena].stream));
}

[[gnu::noinline]] RangeTaker::Taken RangeTaker::take_kept(std::uint32_t si, std::size_t bytes,
                                                          std::size_t requested) {
  const std::optional<KeptPlaces::Place> kept = placement_.take_kept(si, bytes, pages_.clock());
  if (!kept) return take_placed(placement_.online(si, bytes, pages_.clock()), bytes, requested);
  bool backed = false;
  try {
    backed = back(kept->arena, kept->addr, bytes);
  } catch (...) {
    placement_.release_kept(*kept);
    throw;
  }
  if (backed) return {kept->arena, kept->node, kept->addr, true};
  placement_.release_kept(*kept);  // no memory for its pages: online placement may find some (or throws)
  return take_placed(placement_.online(si, bytes, pages_.clock()), bytes, requested);
}

RangeTaker::Taken RangeTaker::take_at(DevicePtr addr, std::size_t bytes, std::size_t requested) {
  // A pool put back to a checkpoint: a walk over the arena's ranges in order.
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    const RangeAllocator& ranges = arenas_[a].ranges;
    if (addr < ranges.base() || addr >= ranges.base() + ranges.size()) continue;
    for (NodeId id = ranges.first(); id != kNoNode; id = ranges.node(id).next) {
      const RangeNode& n = ranges.node(id);
      if (n.addr + n.size <= addr) continue;
      if (!n.free || n.addr + n.size < addr + bytes) break;  // [addr, addr + bytes) is in use
      return take_placed({a, id, addr - n.addr}, bytes, requested);
    }
    break;
  }
  return {0, kNoNode, 0};
}

void RangeTaker::keep(std::uint32_t arena, NodeId node, std::uint32_t birth,
                      std::uint64_t freed_at) {
  // Not in the plan region (its ranges go where the plan puts them) nor in a stable engine (its
  // pages keep their chunks): there the range is released.
  if (arena == placement_.plan_arena() || chunks_.stable_pages())
    return release(arena, node, freed_at);
  unref(arena, arenas_[arena].ranges.node(node), freed_at);
  placement_.keep(arena, node, birth, pages_.clock());
}

}  // namespace gmem::detail
