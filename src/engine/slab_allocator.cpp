#include "engine/slab_allocator.hpp"

namespace gmem::detail {

void SlabAllocator::add_arena() { classes_.resize(classes_.size() + kNumClasses); }

SlabId SlabAllocator::add(std::uint32_t arena, int cls, DevicePtr base, NodeId node) {
  SlabId id;
  if (!recycled_.empty()) {
    id = recycled_.back();
    recycled_.pop_back();
  } else {
    id = static_cast<SlabId>(slabs_.size());
    slabs_.emplace_back();
  }
  Slab& s = slabs_[id];
  s.base = base;
  s.object_size = class_size(cls);
  s.node = node;
  s.arena = arena;
  s.cls = static_cast<std::uint32_t>(cls);
  s.capacity = slab_objects(cls);
  s.used = 0;
  s.live = true;
  s.free_slots.clear();
  for (std::uint32_t i = s.capacity; i-- > 0;) s.free_slots.push_back(i);  // slot 0 on top
  bytes_ += s.bytes();
  list(classes_[arena * kNumClasses + static_cast<std::size_t>(cls)], id);
  return id;
}

bool SlabAllocator::free(SlabId id, DevicePtr ptr) {
  Slab& s = slabs_[id];
  ClassState& c = classes_[s.arena * kNumClasses + s.cls];
  s.free_slots.push_back(static_cast<std::uint32_t>((ptr - s.base) / s.object_size));
  if (s.used-- == s.capacity) list(c, id);
  if (s.used > 0) return false;
  if (c.spare == kNoSlab) {
    c.spare = id;
    // Alone in the list it stays there; among partial slabs it steps aside, so that they fill
    // up first (reuse_spare brings it back when they are full).
    if (c.partial != id || s.next != kNoSlab) unlist(c, id);
    return false;
  }
  unlist(c, id);
  return true;
}

void SlabAllocator::remove(SlabId id) {
  Slab& s = slabs_[id];
  s.live = false;
  bytes_ -= s.bytes();
  recycled_.push_back(id);
}

std::vector<SlabId> SlabAllocator::take_spares() {
  std::vector<SlabId> spares;
  for (ClassState& c : classes_) {
    if (c.spare == kNoSlab) continue;
    if (slabs_[c.spare].listed) unlist(c, c.spare);
    spares.push_back(c.spare);
    c.spare = kNoSlab;
  }
  return spares;
}

bool SlabAllocator::reuse_spare(ClassState& c) {
  if (c.spare == kNoSlab) return false;
  list(c, c.spare);
  return true;  // allocate() clears c.spare as it takes the first slot
}

void SlabAllocator::list(ClassState& c, SlabId id) {
  Slab& s = slabs_[id];
  s.prev = kNoSlab;
  s.next = c.partial;
  if (c.partial != kNoSlab) slabs_[c.partial].prev = id;
  c.partial = id;
  s.listed = true;
}

void SlabAllocator::unlist(ClassState& c, SlabId id) {
  Slab& s = slabs_[id];
  if (s.prev != kNoSlab) slabs_[s.prev].next = s.next;
  else c.partial = s.next;
  if (s.next != kNoSlab) slabs_[s.next].prev = s.prev;
  s.prev = s.next = kNoSlab;
  s.listed = false;
}

}  // namespace gmem::detail
