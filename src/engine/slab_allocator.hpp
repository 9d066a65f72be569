// Small blocks: per arena (stream) and size class, slabs of a few equal slots. The fast path
// takes the lowest free slot of the first slab of the class with room: which slot a block gets
// then depends on which are free, not on the order they were freed in, so a program that makes
// the same small blocks in the same order gets the same slots (a CUDA graph that reads one finds
// it where it was captured: kept_places.hpp). A slab that empties is kept,
// empty, for the class to fill again, up to budgets the engine sets (shares of its peak
// memory): a slab given back to the large allocator and carved again elsewhere moves the free
// ranges that large blocks are placed in, and with them the layout of every later step (a loop
// with gradient accumulation never settled: docs/notes/2026-11-24-held-out-traces.md). A class's first
// empty slab has the larger budget, its further ones the smaller; neither grows with the number
// of classes or streams in use (a server whose requests of random shapes touch every class once
// kept a slab in each: 1.4% of its peak). Where the budget is full, a class's first empty slab
// takes the place of the slabs kept longest (a class in use keeps its slab; one touched once
// gives it up). Empty slabs are refilled lowest address first, so which one a class takes
// depends on where they are, not on the order they emptied in. Beyond the budgets, empty slabs
// go back to the large allocator. Bookkeeping only: the engine carves and backs the slabs'
// memory.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/range_allocator.hpp"
#include "engine/size_classes.hpp"
#include "gmem/device.hpp"

namespace gmem::detail {

using SlabId = std::uint32_t;
inline constexpr SlabId kNoSlab = ~SlabId{0};

struct Slab {
  DevicePtr base = 0;
  std::size_t object_size = 0;
  NodeId node = kNoNode;  // the range holding the slab in its arena
  std::uint32_t arena = 0;
  std::uint32_t cls = 0;
  std::uint32_t capacity = 0;
  std::uint32_t used = 0;
  SlabId prev = kNoSlab, next = kNoSlab;  // the class's list of slabs with free slots
  bool listed = false;
  bool live = false;
  SlabId kept_prev = kNoSlab, kept_next = kNoSlab;  // the kept slabs, oldest first
  // Free slots as bits (slot k: bit k % 64 of word k / 64); the lowest is taken first, so which
  // slot a malloc gets depends on which are free, not on the order they were freed in.
  std::array<std::uint64_t, kMaxSlots / 64> free_bits{};
  std::size_t bytes() const { return object_size * capacity; }
  std::uint32_t take_lowest() {
    std::uint32_t w = 0;
    while (free_bits[w] == 0) ++w;
    const auto bit = static_cast<std::uint32_t>(std::countr_zero(free_bits[w]));
    free_bits[w] &= free_bits[w] - 1;
    return w * 64 + bit;
  }
  void put(std::uint32_t slot) { free_bits[slot / 64] |= std::uint64_t{1} << (slot % 64); }
};

class SlabAllocator {
 public:
  void add_arena();

  // A free slot of class `cls` in `arena`, or 0 when the class has no room left.
  DevicePtr allocate(std::uint32_t arena, int cls, SlabId& slab) {
    ClassState& c = class_of(arena, cls);
    if (c.partial == kNoSlab && !reuse_spare(c)) return 0;
    slab = c.partial;
    Slab& s = slabs_[slab];
    const std::uint32_t slot = s.take_lowest();
    if (s.used++ == 0) [[unlikely]] unkeep(c, slab);  // an empty slab in use again
    if (s.used == s.capacity) unlist(c, slab);
    return s.base + slot * s.object_size;
  }
  // Registers a new slab over [base, base + slab bytes) and lists it.
  SlabId add(std::uint32_t arena, int cls, DevicePtr base, NodeId node);
  // How many bytes of empty slabs may be kept in all: while a class's first empty slab fits in
  // `first`, and a further one in `more`.
  struct KeepBudget {
    std::size_t first = 0;
    std::size_t more = 0;
  };
  // Frees the slot at `ptr`. Returns true when the slab is now empty: the caller then calls
  // emptied() (the slow path, out of line).
  bool free(SlabId slab, DevicePtr ptr) {
    Slab& s = slabs_[slab];
    s.put(static_cast<std::uint32_t>((ptr - s.base) / s.object_size));
    if (s.used-- == s.capacity) list(class_of(s), slab);
    return s.used == 0;
  }
  // A slab free() emptied: kept within `budget`, or not (returns true): the caller then gives its
  // range back and calls remove(). Kept slabs that made room for it are then in evicted(), for
  // the caller to give back the same way.
  bool emptied(SlabId id, KeepBudget budget);
  std::vector<SlabId>& evicted() { return evicted_; }
  void remove(SlabId slab);
  // Takes every kept empty slab out of the classes, for the engine to release (under pressure,
  // empty_cache).
  std::vector<SlabId> take_spares();

  const Slab& slab(SlabId id) const { return slabs_[id]; }
  std::size_t slab_count() const { return slabs_.size(); }
  std::size_t bytes() const { return bytes_; }

 private:
  struct ClassState {
    SlabId partial = kNoSlab;  // slabs with room
    // Empty slabs kept for reuse, unlisted, except one left listed when it is the class's only
    // slab (so that a malloc/free pair on it does not relist it).
    std::vector<SlabId> empty;
  };
  ClassState& class_of(std::uint32_t arena, int cls) {
    return classes_[arena * kNumClasses + static_cast<std::size_t>(cls)];
  }
  ClassState& class_of(const Slab& s) { return class_of(s.arena, static_cast<int>(s.cls)); }
  void keep(ClassState& c, SlabId id);
  bool reuse_spare(ClassState& c);  // lists the lowest kept empty slab, if any
  void unkeep(ClassState& c, SlabId id);  // `id` (kept empty until now) has a slot in use
  void list(ClassState& c, SlabId id);
  void unlist(ClassState& c, SlabId id);

  std::vector<Slab> slabs_;
  std::vector<SlabId> recycled_;
  std::vector<ClassState> classes_;
  std::size_t bytes_ = 0;
  std::size_t kept_bytes_ = 0;
  SlabId kept_oldest_ = kNoSlab, kept_newest_ = kNoSlab;  // every kept slab, in keeping order
  std::vector<SlabId> evicted_;
};

}  // namespace gmem::detail
