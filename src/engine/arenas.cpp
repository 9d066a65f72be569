#include "engine/arenas.hpp"

#include <algorithm>

#include "gmem/error.hpp"

namespace gmem::detail {

void Arenas::release_all() {
  for (const auto& arena : arenas_) {
    try { device_.release_address(arena->ranges.base(), arena->ranges.size()); } catch (...) {}
  }
  arenas_.clear();
}

void Arenas::set_arena_size(std::size_t bytes) {
  arena_size_ = (bytes + page_size_ - 1) / page_size_ * page_size_;
}

std::uint32_t Arenas::add(std::uint32_t si, std::size_t min_bytes, bool listed, bool for_malloc) {
  const std::size_t size = std::max(arena_size_, (min_bytes + page_size_ - 1) / page_size_ * page_size_);
  DevicePtr base = 0;
  try {
    base = device_.reserve_address(size, page_size_);
  } catch (const DeviceError& e) {
    if (!e.device_out_of_memory() || !for_malloc) throw;
    throw NoAddressSpace{min_bytes, si};
  }
  try {
    arenas_.reserve(arenas_.size() + 1);
    if (listed) streams_.arenas(si).reserve(streams_.arenas(si).size() + 1);
    auto arena = std::make_unique<Arena>(base, size, size >> page_shift_, si);
    client_.arena_added();  // the slabs' classes for it
    arenas_.push_back(std::move(arena));
  } catch (...) {
    try { device_.release_address(base, size); } catch (...) {}
    throw;
  }
  const auto index = static_cast<std::uint32_t>(arenas_.size() - 1);
  if (listed) streams_.arenas(si).push_back(index);
  return index;
}

bool Arenas::contains(DevicePtr ptr) const {
  for (const auto& arena : arenas_) {
    const DevicePtr base = arena->ranges.base();
    if (ptr >= base && ptr <= base + arena->ranges.size()) return true;
  }
  return false;
}

std::vector<std::pair<DevicePtr, DevicePtr>> Arenas::mapped_ranges() const {
  std::vector<std::pair<DevicePtr, DevicePtr>> out;
  for (const auto& arena : arenas_) {
    const DevicePtr base = arena->ranges.base();
    arena->pages.for_each_touched([&](std::size_t i, const Page& page) {
      if (!page.mapped()) return;
      const DevicePtr begin = base + (i << page_shift_);
      if (!out.empty() && out.back().second == begin) out.back().second += page_size_;
      else out.emplace_back(begin, begin + page_size_);
    });
  }
  return out;
}

}  // namespace gmem::detail
