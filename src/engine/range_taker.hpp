// RangeTaker: a range where Placement puts it, backed by mapped pages, and back again. It joins
// a placement (a Spot, a kept place, or an address) to PageBacking's fast path and the Mapper's
// slow one; what it took is put back on every failure, so the invariants hold after an error.
// Placed online, a range is the best fit in its stream's arenas; PlannedTaker places the ranges
// of marked steps and comes here to back them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "engine/arenas.hpp"
#include "engine/chunk_source.hpp"
#include "engine/mapper.hpp"
#include "engine/page_backing.hpp"
#include "engine/placement.hpp"
#include "engine/streams.hpp"

namespace gmem::detail {

class RangeTaker {
 public:
  // A used range, backed by mapped pages.
  struct Taken {
    std::uint32_t arena;
    NodeId node;
    DevicePtr addr;
    bool kept = false;  // a kept place taken back (kept_places.hpp): the block keeps its place too
  };

  RangeTaker(Arenas& arenas, Streams& streams, Placement& placement, PageBacking& pages,
             ChunkSource& chunks, Mapper& mapper)
      : arenas_(arenas), streams_(streams), placement_(placement), pages_(pages),
        chunks_(chunks), mapper_(mapper) {}

  // The best fit for `bytes` in stream `si`'s arenas (a kept place of its size first, while
  // places are kept), backed; throws OutOfMemoryError (for `requested` bytes) or DeviceError
  // with nothing changed.
  Taken take_online(std::uint32_t si, std::size_t bytes, std::size_t requested);
  // Takes `bytes` of the free range at `spot` and backs them (OOM for `requested`).
  Taken take_placed(const Placement::Spot& spot, std::size_t bytes, std::size_t requested);
  // take_placed without the OOM: the range taken and backed (its pages pinned while pinning), or
  // nullopt with the range given back where no memory backs it; a throw gives the range back too.
  std::optional<Taken> take_and_back(const Placement::Spot& spot, std::size_t bytes);
  // [addr, addr + bytes) in the arena that holds it, as take_placed; kNoNode in the result's
  // node when that range is not all free (nothing changed). Walks the arena: not a hot path.
  Taken take_at(DevicePtr addr, std::size_t bytes, std::size_t requested);
  // Backs a used range with mapped pages: the fast path, or the Mapper's slow one. False when no
  // memory backs it (the references given back).
  bool back(std::uint32_t arena, DevicePtr addr, std::size_t bytes) {
    if (pages_.take(arena, addr, bytes)) [[likely]] return true;
    return mapper_.map_missing(arena, addr, bytes);
  }

  // The used range `node` goes back, freed on its stream at `freed_at` (StreamTracker::stamp).
  void release(std::uint32_t arena, NodeId node, std::uint64_t freed_at) {
    RangeAllocator& ranges = arenas_[arena].ranges;
    unref(arena, ranges.node(node), freed_at);
    ranges.release(node);
  }
  // release for a block whose place a CUDA graph may have captured (kept_places.hpp): its pages
  // go back, its range is kept for the next malloc of its size on its stream. `birth`:
  // Record::birth, the order the blocks were made in.
  void keep(std::uint32_t arena, NodeId node, std::uint32_t birth, std::uint64_t freed_at);

  // An arena could not be added for a malloc: the OOM report, naming the address space.
  [[noreturn]] void throw_no_address_space(const NoAddressSpace& e);

 private:
  // take_online while places are kept: the earliest-born kept place of `bytes`, if any.
  Taken take_kept(std::uint32_t si, std::size_t bytes, std::size_t requested);
  // A used range's pages go back (the planner told), the range stays used.
  void unref(std::uint32_t arena, const RangeNode& n, std::uint64_t freed_at) {
    placement_.released(arena, n);
    pages_.give_back(arena, n.addr, n.size, freed_at);
  }

  Arenas& arenas_;
  Streams& streams_;
  Placement& placement_;
  PageBacking& pages_;
  ChunkSource& chunks_;
  Mapper& mapper_;
};

}  // namespace gmem::detail
