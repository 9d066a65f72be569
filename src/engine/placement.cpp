#include "engine/placement.hpp"

namespace gmem::detail {

namespace {
// Blocks at least this large are placed at the top of their free range, the rest at the bottom:
// the two kinds then keep to their own ends of the address space, and a big block's range stays
// whole for its next use.
constexpr std::size_t kTopDownBytes = std::size_t{16} << 20;
std::size_t offset_in(const RangeNode& fit, std::size_t bytes) {
  return bytes >= kTopDownBytes ? fit.size - bytes : 0;
}
}  // namespace

Placement::Spot Placement::online(std::uint32_t si, std::size_t bytes, std::uint32_t now) {
  // The best fit, at its end for the block's kind. The choice depends on the free ranges alone,
  // not on what is mapped where: a step that repeats its requests then repeats its layout, and
  // finds its pages mapped. (Preferring ranges that happen to be mapped moves the layout, and
  // with it the pages to map, every step.)
  for (;;) {
    for (std::uint32_t a : arenas_.streams().arenas(si)) {
      if (const NodeId node = arenas_[a].ranges.find(bytes); node != kNoNode)
        return {a, node, offset_in(arenas_[a].ranges.node(node), bytes)};
    }
    if (kept_.empty()) break;
    expire_kept(now, true);  // the stream's arenas are full: kept places are worth less than a new one
  }
  const std::uint32_t a = arenas_.add(si, bytes, true);
  const NodeId node = arenas_[a].ranges.find(bytes);
  return {a, node, offset_in(arenas_[a].ranges.node(node), bytes)};
}

std::optional<KeptPlaces::Place> Placement::take_kept(std::uint32_t si, std::size_t bytes,
                                                      std::uint32_t now) {
  expire_kept(now);
  return kept_.take(bytes, [&](std::uint32_t arena) { return arenas_[arena].stream == si; });
}

void Placement::keep(std::uint32_t arena, NodeId node, std::uint32_t birth, std::uint32_t now) {
  const RangeNode& n = arenas_[arena].ranges.node(node);
  if (const std::optional<KeptPlaces::Place> older = kept_.keep(n.size, birth, {arena, node, n.addr}, now))
    release_kept(*older);
  expire_kept(now);
}

void Placement::mark_step(std::size_t mapped_bytes) {
  planner_.mark_step(mapped_bytes);
  covers_.mark_step();
  if (!weighing_ || planner_.stats().steps < 2) return;
  weighing_ = false;  // the first step recorded has ended
  std::uint32_t most = 0;
  for (std::uint32_t si = 1; si < weighed_.size(); ++si)
    if (weighed_[si] > weighed_[most]) most = si;
  const bool planned_most = plan_stream_ < weighed_.size() && weighed_[plan_stream_] >= weighed_[most];
  if (weighed_[most] > 0 && !planned_most) cover_stream_ = most;
}

std::optional<Placement::Spot> Placement::planned(std::size_t offset, std::size_t bytes) const {
  const RangeAllocator& ranges = arenas_[plan_arena_].ranges;
  if (offset + bytes > ranges.size()) return std::nullopt;
  const DevicePtr addr = ranges.base() + offset;
  const NodeId free = plan_region_.free_node(ranges, addr, bytes);
  if (free == kNoNode) return std::nullopt;
  return Spot{plan_arena_, free, addr - ranges.node(free).addr};
}

}  // namespace gmem::detail
