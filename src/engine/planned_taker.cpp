#include "engine/planned_taker.hpp"

#include <optional>

namespace gmem::detail {

PlannedTaker::Taken PlannedTaker::take(std::uint32_t si, std::size_t bytes,
                                       std::size_t requested) {
  StepPlanner* const of = placement_.planner_of(si, bytes);
  if (of != &placement_.planner()) [[unlikely]] {
    if (of == nullptr) return taker_.take_online(si, bytes, requested);
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
      taker_.throw_no_address_space(e);
    }
    if (ticket.ordinal == 0 && ahead_.enabled()) [[unlikely]] ahead_.start();
    if (const std::optional<Placement::Spot> spot = placement_.planned(ticket.offset, bytes)) {
      RangeAllocator& ranges = arenas_[spot->arena].ranges;
      const NodeId node = ranges.take(spot->node, bytes, spot->offset);
      const DevicePtr addr = ranges.node(node).addr;
      bool backed = false;
      try {
        placement_.add_planned(addr, node);
        backed = taker_.back(spot->arena, addr, bytes);
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

PlannedTaker::Taken PlannedTaker::take_covered(StepPlanner& covers, std::uint32_t si,
                                               std::size_t bytes, std::size_t requested) {
  const StepPlanner::Ticket ticket = covers.request(bytes);
  const Taken taken = take_sized(si, bytes, ticket.slot, requested);
  arenas_[taken.arena].ranges.set_plan_ordinal(taken.node, covers.taken(ticket, taken.addr, false));
  return taken;
}

PlannedTaker::Taken PlannedTaker::take_sized(std::uint32_t si, std::size_t bytes,
                                             std::size_t slot, std::size_t requested) {
  // A block of a step that fits its cover (a larger step of its shape, step_plan.hpp) takes the
  // size its block there took (`slot`): best fit then lays the step out as it laid out the larger
  // one, on the same pages at the same moments, whatever its lengths, and their chunks settle as
  // a repeated step's do. Where the slot's pages cannot be had (a limit), it takes its own size.
  // (Not while places are kept for CUDA graphs: a kept place is matched by its block's size.)
  if (slot == bytes || placement_.keeps_places()) [[likely]]
    return taker_.take_online(si, bytes, requested);
  try {
    if (const std::optional<Taken> taken =
            taker_.take_and_back(placement_.online(si, slot, pages_.clock()), slot))
      return *taken;
    chunks_.release_spares();
  } catch (const NoAddressSpace&) {  // the block's own size may still fit
  }
  return taker_.take_online(si, bytes, requested);
}

void PlannedTaker::step_begins(std::uint32_t si, const StepPlanner::Ticket& ticket) {
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

void PlannedTaker::mark_step() {
  if (chunks_.stable_pages()) return;  // a plan region's pages alias online chunks
  if (!placement_.planning()) chunks_.clash_rule().restart_window(device_.host_time());
  // The round ends (a batch in flight gives its pages back when it lands; its pages are booked).
  if (ahead_.under_way()) [[unlikely]] ahead_.end();
  const std::int64_t maps = accounting_.stats.num_maps;
  placement_.mark_step(static_cast<std::size_t>(maps - maps_at_mark_) * arenas_.page_size());
  maps_at_mark_ = maps;
  chunks_.follow_warm_up(placement_.planner().warm_up());
}

}  // namespace gmem::detail
