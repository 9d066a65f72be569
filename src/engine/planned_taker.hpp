// PlannedTaker: the range mallocs of marked steps, the path a training loop under gmem.torch
// takes for every block of its own range. A step that follows its shape's plan takes its planned
// offset in the plan region; a step on no plan takes the size its block took in its cover (the
// shape's largest step: step_plan.hpp); a stream that is neither planned nor covered, or a block
// whose place is not free, goes online. Map-ahead's rounds begin and end with the steps. Every
// range it places is backed by RangeTaker, which puts back what it took on a failure.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/accounting.hpp"
#include "engine/arenas.hpp"
#include "engine/chunk_source.hpp"
#include "engine/map_ahead.hpp"
#include "engine/page_backing.hpp"
#include "engine/placement.hpp"
#include "engine/range_taker.hpp"
#include "engine/step_plan.hpp"
#include "gmem/device.hpp"

namespace gmem::detail {

class PlannedTaker {
 public:
  using Taken = RangeTaker::Taken;

  PlannedTaker(Device& device, Arenas& arenas, Placement& placement, const PageBacking& pages,
               ChunkSource& chunks, MapAhead& ahead, Accounting& accounting, RangeTaker& taker)
      : device_(device), arenas_(arenas), placement_(placement), pages_(pages), chunks_(chunks),
        ahead_(ahead), accounting_(accounting), taker_(taker) {}

  // A range malloc of stream `si` while steps are marked (Placement::planning()): at its planned
  // offset when the step follows a plan and that range is free (it is, if the step's lifetimes
  // repeat), else its cover's size or online. Throws as RangeTaker::take_online.
  Taken take(std::uint32_t si, std::size_t bytes, std::size_t requested);
  // A malloc of stream `si` in a slab's slot: it counts among the planned stream's mallocs.
  void count_slot_malloc(std::uint32_t si) { placement_.tick(si); }
  // A training step ends: from now on the range mallocs of one stream (the first to make one)
  // are recorded step by step, and once shapes take turns a step whose shape was seen before
  // takes its planned offsets; until then it takes its cover's sizes where it fits them, as
  // does the stream that takes the most bytes, if another (Placement::planner_of).
  void mark_step();

 private:
  // take on a stream that follows covers only (Placement::planner_of).
  Taken take_covered(StepPlanner& covers, std::uint32_t si, std::size_t bytes, std::size_t requested);
  // take_online for a block of `bytes` that takes the range of a larger step's block, `slot`.
  Taken take_sized(std::uint32_t si, std::size_t bytes, std::size_t slot, std::size_t requested);
  // A step's first malloc: map-ahead's rounds begin (or end) there.
  void step_begins(std::uint32_t si, const StepPlanner::Ticket& ticket);

  Device& device_;
  Arenas& arenas_;
  Placement& placement_;
  const PageBacking& pages_;  // its clock
  ChunkSource& chunks_;
  MapAhead& ahead_;
  Accounting& accounting_;
  RangeTaker& taker_;
  std::int64_t maps_at_mark_ = 0;  // maps made when the last step was marked
};

}  // namespace gmem::detail
