// Placement: where a block's range goes, knowing nothing of pages: the best fit in its stream's
// arenas (online), a place kept for a CUDA graph (kept_places.hpp), or its planned offset in the
// plan region (step_plan.hpp, plan_region.hpp). RangeTaker backs what it picks with pages, and
// tells it when that fails.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "engine/arenas.hpp"
#include "engine/kept_places.hpp"
#include "engine/plan_region.hpp"
#include "engine/step_plan.hpp"

namespace gmem::detail {

class Placement {
 public:
  explicit Placement(Arenas& arenas) : arenas_(arenas) {}

  // A place for `bytes`: at `offset` into the free range `node` of arena `arena`.
  struct Spot {
    std::uint32_t arena;
    NodeId node;
    std::size_t offset;
  };

  // --- online -----------------------------------------------------------------------------------
  // The best fit among stream `si`'s arenas, at the end of its free range for the block's kind.
  // Where they are full, kept places are given back first, then an arena is added
  // (NoAddressSpace). `now`: the pages' clock (kept places expire by it).
  Spot online(std::uint32_t si, std::size_t bytes, std::uint32_t now);

  // --- kept places (a block a CUDA graph may have captured) -------------------------------------
  bool keeps_places() const { return !kept_.empty(); }
  // The earliest-born kept place of `bytes` on stream `si`, expired ones given back first.
  std::optional<KeptPlaces::Place> take_kept(std::uint32_t si, std::size_t bytes, std::uint32_t now);
  void release_kept(const KeptPlaces::Place& place) { arenas_[place.arena].ranges.release(place.node); }
  // Keeps the used range `node` (its pages given back) for the next malloc of its size.
  void keep(std::uint32_t arena, NodeId node, std::uint32_t birth, std::uint32_t now);
  const KeptPlaces& kept() const { return kept_; }

  // --- planned step layouts -----------------------------------------------------------------------
  bool planning() const { return planner_.active(); }
  StepPlanner& planner() { return planner_; }
  const StepPlanner& planner() const { return planner_; }
  // The planner of stream `si`'s steps (a range malloc of `bytes` there), or nullptr. The first
  // stream to make a planned malloc is planned (planner()); the stream that took the most bytes
  // of range mallocs in the first step recorded, if another, follows covers (step_plan.hpp) by a
  // planner of its own. FSDP2's first malloc of a step is an all-gather on a stream of its own,
  // blocks of fixed sizes, while the activations, which move with the length, are the compute
  // stream's: they are what needs covering.
  StepPlanner* planner_of(std::uint32_t si, std::size_t bytes) {
    if (plan_stream_ == kNoArena) plan_stream_ = si;
    if (weighing_ && si < weighed_.size()) [[unlikely]] weighed_[si] += bytes;
    if (si == plan_stream_) return &planner_;
    return si == cover_stream_ ? &covers_ : nullptr;
  }
  // A malloc of stream `si` in a slab's slot (StepPlanner::tick).
  void tick(std::uint32_t si) {
    if (si == plan_stream_) planner_.tick();
    else if (si == cover_stream_) [[unlikely]] covers_.tick();
  }
  // A step ends (`mapped_bytes`: what it mapped, StepPlanner::mark_step); after the first step
  // recorded, the covered stream is chosen (planner_of).
  void mark_step(std::size_t mapped_bytes);
  // The plan region: an arena of the plan's stream that online placement never uses (kNoArena
  // until a plan is first followed or mapped early).
  std::uint32_t plan_arena() const { return plan_arena_; }
  void add_plan_arena(std::uint32_t si, std::size_t min_bytes, bool for_malloc) {
    if (plan_arena_ == kNoArena) plan_arena_ = arenas_.add(si, min_bytes, false, for_malloc);
  }
  // The free range holding [offset, offset + bytes) of the plan region, or nullopt where a used
  // range overlaps it or it lies outside the region.
  std::optional<Spot> planned(std::size_t offset, std::size_t bytes) const;
  // A planned block took its place, or gave it back before it was a block.
  void add_planned(DevicePtr addr, NodeId node) { plan_region_.add(addr, node); }
  void remove_planned(DevicePtr addr) { plan_region_.remove(addr); }
  const PlanRegion& plan_region() const { return plan_region_; }
  // A block's used range goes back (freed or kept): the planner and the plan region are told.
  void released(std::uint32_t arena, const RangeNode& n) {
    if (planner_.active()) [[unlikely]] {
      if (arenas_[arena].stream == cover_stream_) [[unlikely]] covers_.released(n.addr, n.plan_ordinal);
      else planner_.released(n.addr, n.plan_ordinal);
      if (arena == plan_arena_) plan_region_.remove(n.addr);
    }
  }

 private:
  void expire_kept(std::uint32_t now, bool all = false) {
    kept_.expire(now, [this](const KeptPlaces::Place& p) { release_kept(p); }, all);
  }

  Arenas& arenas_;
  KeptPlaces kept_;
  StepPlanner planner_;
  std::uint32_t plan_stream_ = kNoArena;  // a stream index
  // The covered stream (kNoArena: none but the planned one) and its planner. Range bytes taken
  // by each stream (the first few: a program rarely computes on more) in the first step
  // recorded, while weighing_.
  std::uint32_t cover_stream_ = kNoArena;
  StepPlanner covers_ = StepPlanner::covers_only();
  bool weighing_ = true;
  std::array<std::size_t, 8> weighed_{};
  std::uint32_t plan_arena_ = kNoArena;
  PlanRegion plan_region_;
};

}  // namespace gmem::detail
