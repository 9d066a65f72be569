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
  s.free_bits = {};
  for (std::uint32_t i = 0; i < s.capacity; ++i) s.put(i);
  bytes_ += s.bytes();
  list(class_of(arena, cls), id);
  return id;
}

bool SlabAllocator::emptied(SlabId id, KeepBudget budget) {
  Slab& s = slabs_[id];
  ClassState& c = class_of(s);
  // A class's first empty slab has the larger budget (a malloc/free pair should not carve and
  // give back a slab each time), and where that is full it takes the place of the slabs kept
  // longest; further ones have the smaller budget.
  const bool first = c.empty.empty();
  const std::size_t limit = first ? budget.first : budget.more;
  while (first && kept_bytes_ + s.bytes() > limit && kept_oldest_ != kNoSlab) {
    const SlabId old = kept_oldest_;
    ClassState& oc = class_of(slabs_[old]);
    if (slabs_[old].listed) unlist(oc, old);
    unkeep(oc, old);
    evicted_.push_back(old);
  }
  if (kept_bytes_ + s.bytes() <= limit) {
    keep(c, id);
    // Alone in the list it stays there; among partial slabs it steps aside, so that they fill
    // up first (reuse_spare brings it back when they are full).
    if (c.partial != id || s.next != kNoSlab) unlist(c, id);
    return false;
  }
  unlist(c, id);
  return true;
}

void SlabAllocator::keep(ClassState& c, SlabId id) {
  Slab& s = slabs_[id];
  c.empty.push_back(id);
  kept_bytes_ += s.bytes();
  s.kept_prev = kept_newest_;
  s.kept_next = kNoSlab;
  if (kept_newest_ != kNoSlab) slabs_[kept_newest_].kept_next = id;
  else kept_oldest_ = id;
  kept_newest_ = id;
}

void SlabAllocator::unkeep(ClassState& c, SlabId id) {
  for (std::size_t k = 0; k < c.empty.size(); ++k) {
    if (c.empty[k] != id) continue;
    c.empty[k] = c.empty.back();
    c.empty.pop_back();
    Slab& s = slabs_[id];
    kept_bytes_ -= s.bytes();
    if (s.kept_prev != kNoSlab) slabs_[s.kept_prev].kept_next = s.kept_next;
    else kept_oldest_ = s.kept_next;
    if (s.kept_next != kNoSlab) slabs_[s.kept_next].kept_prev = s.kept_prev;
    else kept_newest_ = s.kept_prev;
    s.kept_prev = s.kept_next = kNoSlab;
    return;
  }
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
    for (SlabId id : c.empty) {
      if (slabs_[id].listed) unlist(c, id);
      slabs_[id].kept_prev = slabs_[id].kept_next = kNoSlab;
      spares.push_back(id);
    }
    c.empty.clear();
  }
  kept_bytes_ = 0;
  kept_oldest_ = kept_newest_ = kNoSlab;
  return spares;
}

bool SlabAllocator::reuse_spare(ClassState& c) {
  if (c.empty.empty()) return false;
  SlabId lowest = c.empty[0];
  for (SlabId id : c.empty)
    if (slabs_[id].base < slabs_[lowest].base) lowest = id;
  list(c, lowest);
  return true;  // allocate() takes it out of c.empty as it takes the first slot
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
