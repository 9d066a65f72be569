// Backing: the coordinator. Every path that fails puts back what it took, so the invariants hold
// after an error.
#include "engine/backing.hpp"

#include <bit>
#include <string>

#include "gmem/error.hpp"

namespace gmem::detail {

namespace {
std::size_t checked_page_size(const Device& device, std::size_t page_size, std::size_t alignment) {
  const std::size_t granularity = device.granularity();
  if (!std::has_single_bit(granularity) || granularity < alignment)
    throw Error(Errc::invalid_argument, "device granularity must be a power of two >= " +
                                            std::to_string(alignment) + ", got " +
                                            std::to_string(granularity));
  if (page_size == 0) return granularity;
  if (!std::has_single_bit(page_size) || page_size < granularity || page_size > Backing::kMaxPageSize)
    throw Error(Errc::invalid_argument,
                "page size " + std::to_string(page_size) + " bytes: must be a power of two from "
                "the device's granularity (" + format_bytes(granularity) + ") to " +
                format_bytes(Backing::kMaxPageSize));
  return page_size;  // every chunk is one page: created, mapped and unmapped whole
}
}  // namespace

Backing::Backing(Device& device, Streams& streams, Accounting& accounting,
                 EngineObserver* const& observer, BackingClient& client, const EngineLock& lock,
                 Options options)
    : device_(device), streams_(streams), accounting_(accounting),
      arenas_(device, streams, client,
              checked_page_size(device, options.page_size, options.alignment)),
      placement_(arenas_), pages_(arenas_, streams),
      calls_(device, pages_, accounting, observer, arenas_.page_shift()),
      chunks_(device, arenas_, pages_, calls_, accounting, observer, client, lock,
              {options.stable_pages, options.handovers}),
      ahead_(options.map_ahead && !options.stable_pages, device, arenas_, placement_, pages_,
             chunks_, calls_, accounting, lock),
      mapper_(device, arenas_, placement_, pages_, chunks_, calls_, ahead_, accounting, lock) {}

Backing::~Backing() {
  // Give everything back, live blocks included: the engine owns the memory it handed out.
  const std::size_t page_size = granularity();
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    arenas_[a].pages.for_each_touched([&](std::size_t i, const Page& page) {
      if (!page.mapped()) return;
      try {
        device_.unmap(arenas_.address(page_id(a, static_cast<std::uint32_t>(i))), page_size);
      } catch (...) {  // nothing to report to from a destructor
      }
    });
  }
  arenas_.release_all();
  const ChunkPool& pool = pages_.chunks();
  for (ChunkId id = 0; id < pool.slots(); ++id) {
    if (const ChunkHandle handle = pool.at(id).handle) {
      try { device_.release_chunk(handle); } catch (...) {}
    }
  }
}

void Backing::set_arena_size(std::size_t address_space) {
  // One device's worth of virtual space per arena: a stream rarely needs a second one, and a
  // thousand streams stay within the GPU's address space (2^47 bytes and more).
  arenas_.set_arena_size(address_space ? address_space : chunks_.device_total());
}

void Backing::throw_no_address_space(const NoAddressSpace& e) {
  chunks_.set_oom_reason("address space");
  chunks_.throw_oom(e.min_bytes, streams_.progress.stream(e.stream));
}

// --- taking a range -------------------------------------------------------------------------------

Backing::Taken Backing::take_online(std::uint32_t si, std::size_t bytes, std::size_t requested) {
  try {
    if (placement_.keeps_places()) [[unlikely]] return take_kept(si, bytes, requested);
    return take_placed(placement_.online(si, bytes, pages_.clock()), bytes, requested);
  } catch (const NoAddressSpace& e) {
    throw_no_address_space(e);
  }
}

std::optional<Backing::Taken> Backing::take_and_back(const Placement::Spot& spot,
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

Backing::Taken Backing::take_placed(const Placement::Spot& spot, std::size_t bytes,
                                    std::size_t requested) {
  if (const std::optional<Taken> taken = take_and_back(spot, bytes)) [[likely]] return *taken;
  chunks_.release_spares();  // chunks created for this request go back to the device
  chunks_.throw_oom(requested, streams_.progress.stream(arenas_[spot.arena].stream));
}

[[gnu::noinline]] Backing::Taken Backing::take_kept(std::uint32_t si, std::size_t bytes,
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

Backing::Taken Backing::take_at(DevicePtr addr, std::size_t bytes, std::size_t requested) {
  // Not a hot path (a pool put back to a checkpoint): a walk over the arena's ranges in order.
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

// A range malloc while steps are marked: at its planned offset in the plan region when the step
// follows a plan and that range is free (it is, if the step's lifetimes repeat), else online.
// The path a training loop under gmem.torch takes for every block of its own range.
Backing::Taken Backing::take_planned(std::uint32_t si, std::size_t bytes, std::size_t requested) {
  StepPlanner* const of = placement_.planner_of(si, bytes);
  if (of != &placement_.planner()) [[unlikely]] {
    if (of == nullptr) return take_online(si, bytes, requested);
    return take_covered(*of, si, bytes, requested);  // covers, no plan
  }
  StepPlanner& planner = *of;
  const StepPlanner::Ticket ticket = planner.request(bytes);
  chunks_.follow_warm_up(planner.warm_up());
  if (ticket.ordinal == 0 || ahead_.holds_booked()) [[unlikely]] step_begins(si, ticket);
  ahead_.step_went_on();
  if (ticket.offset != StepPlanner::kOnline) {
    try {
      placement_.add_plan_arena(si, bytes, /*for_malloc=*/true);
    } catch (const NoAddressSpace& e) {
      throw_no_address_space(e);
    }
    if (ticket.ordinal == 0 && ahead_.enabled()) [[unlikely]] ahead_.start();
    if (const std::optional<Placement::Spot> spot = placement_.planned(ticket.offset, bytes)) {
      RangeAllocator& ranges = arenas_[spot->arena].ranges;
      const NodeId node = ranges.take(spot->node, bytes, spot->offset);
      const DevicePtr addr = ranges.node(node).addr;
      bool backed = false;
      try {
        placement_.add_planned(addr, node);
        backed = back(spot->arena, addr, bytes);
      } catch (...) {
        placement_.remove_planned(addr);
        ranges.release(node);
        throw;
      }
      if (backed) [[likely]] {
        ranges.set_plan_ordinal(node, planner.taken(ticket, addr, true));
        return {spot->arena, node, addr};
      }
      // No memory for the plan's pages: online placement may still find some (or throws).
      placement_.remove_planned(addr);
      ranges.release(node);
    }
    planner.conflict();
  }
  const Taken taken = take_sized(si, bytes, ticket.slot, requested);
  arenas_[taken.arena].ranges.set_plan_ordinal(taken.node, planner.taken(ticket, taken.addr, false));
  return taken;
}

Backing::Taken Backing::take_covered(StepPlanner& covers, std::uint32_t si, std::size_t bytes,
                                     std::size_t requested) {
  const StepPlanner::Ticket ticket = covers.request(bytes);
  const Taken taken = take_sized(si, bytes, ticket.slot, requested);
  arenas_[taken.arena].ranges.set_plan_ordinal(taken.node, covers.taken(ticket, taken.addr, false));
  return taken;
}

Backing::Taken Backing::take_sized(std::uint32_t si, std::size_t bytes, std::size_t slot,
                                   std::size_t requested) {
  // A block of a step that fits its cover (a larger step of its shape, step_plan.hpp) takes the
  // size its block there took (`slot`): best fit then lays the step out as it laid out the larger
  // one, on the same pages at the same moments, whatever its lengths, and their chunks settle as
  // a repeated step's do. Where the slot's pages cannot be had (a limit), it takes its own size.
  // (Not while places are kept for CUDA graphs: a kept place is matched by its block's size.)
  if (slot == bytes || placement_.keeps_places()) [[likely]] return take_online(si, bytes, requested);
  try {
    if (const std::optional<Taken> taken =
            take_and_back(placement_.online(si, slot, pages_.clock()), slot))
      return *taken;
    chunks_.release_spares();
  } catch (const NoAddressSpace&) {  // the block's own size may still fit
  }
  return take_online(si, bytes, requested);
}

void Backing::step_begins(std::uint32_t si, const StepPlanner::Ticket& ticket) {
  const StepPlanner& planner = placement_.planner();
  // A step that left its plan places the rest online: the pages mapped ahead for the plan's
  // later blocks would hold chunks that the online blocks then need (lstm_varlen's steps, whose
  // packed lengths part from their plans, replayed at 1.83x their peak).
  if (ahead_.holds_booked() && !planner.following()) ahead_.end();
  if (ticket.ordinal != 0 || !ahead_.enabled()) return;
  if (const std::size_t extent = planner.extent_to_map_early(); extent > 0) {
    try {
      ahead_.start_early(si, extent);
    } catch (...) {  // no address space or host memory for it: the plan's step maps its pages
      ahead_.end();
    }
  }
}

void Backing::keep_range(std::uint32_t arena, NodeId node, std::uint32_t birth,
                         std::uint64_t freed_at) {
  if (arena == placement_.plan_arena() || stable()) return release_range(arena, node, freed_at);
  unref_range(arena, arenas_[arena].ranges.node(node), freed_at);
  placement_.keep(arena, node, birth, pages_.clock());
}

void Backing::mark_step() {
  if (stable()) return;  // a plan region's pages alias online chunks
  if (!placement_.planning()) chunks_.clash_rule().restart_window(device_.host_time());
  // The round ends (a batch in flight gives its pages back when it lands; its pages are booked).
  if (ahead_.under_way()) [[unlikely]] ahead_.end();
  const std::int64_t maps = accounting_.stats.num_maps;
  placement_.mark_step(static_cast<std::size_t>(maps - maps_at_mark_) * granularity());
  maps_at_mark_ = maps;
  chunks_.follow_warm_up(placement_.planner().warm_up());
}

}  // namespace gmem::detail
