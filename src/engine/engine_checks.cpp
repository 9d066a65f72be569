// Reading the engine: stats (the derived ones computed on demand, off the hot path) and the
// full invariant check the tests run after every step.
#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>

#include "engine/engine_impl.hpp"

namespace gmem {

using detail::kNoNode;
using detail::NodeId;
using detail::Page;

MemoryStats Engine::Impl::stats() const {
  std::lock_guard lock(mutex_);
  MemoryStats s = stats_;
  const auto gran = static_cast<std::int64_t>(granularity_);
  const auto slab_bytes = static_cast<std::int64_t>(slabs_.bytes());
  s.chunks_held = static_cast<std::int64_t>(chunks_held_);
  s.chunks_mapped = static_cast<std::int64_t>(pages_.mapped());
  s.memory_limit = static_cast<std::int64_t>(limit_);
  s.free_mapped_bytes = static_cast<std::int64_t>(pages_.cached()) * gran;
  s.free_unmapped_bytes = static_cast<std::int64_t>(spare_chunks_.size()) * gran;
  s.partial_page_bytes = static_cast<std::int64_t>(pages_.mapped() - pages_.cached()) * gran -
                         static_cast<std::int64_t>(range_bytes_) - slab_bytes;
  s.small_slack_bytes = slab_bytes - (stats_.active_bytes[kSmallPool].current -
                                      static_cast<std::int64_t>(small_range_bytes_));
  s.largest_free_range = static_cast<std::int64_t>(largest_free_range());

  // Inactive split: free bytes sharing a page with used ranges (large) or a slab with live
  // slots (small); peaks are those seen by stats() calls.
  std::int64_t split_ranges = 0, split_slabs = 0;
  for_each_free_range([&](const detail::RangeAllocator& ranges, const std::vector<Page>& pages,
                          const detail::RangeNode& n) {
    const std::size_t first = (n.addr - ranges.base()) >> page_shift_;
    const std::size_t last = (n.addr + n.size - 1 - ranges.base()) >> page_shift_;
    if (pages[first].refs > 0 || pages[last].refs > 0) ++split_ranges;
  });
  std::int64_t small_split_bytes = 0;
  for (detail::SlabId id = 0; id < slabs_.slab_count(); ++id) {
    const detail::Slab& slab = slabs_.slab(id);
    if (!slab.live || slab.used == 0 || slab.used == slab.capacity) continue;
    ++split_slabs;
    small_split_bytes += static_cast<std::int64_t>((slab.capacity - slab.used) * slab.object_size);
  }
  auto set = [](Stat& stat, std::int64_t value) {
    stat.current = value;
    stat.peak = std::max(stat.peak, value);
  };
  set(split_bytes_[kLargePool], s.partial_page_bytes);
  set(split_bytes_[kSmallPool], small_split_bytes);
  set(split_bytes_[kAllPools], s.partial_page_bytes + small_split_bytes);
  set(split_counts_[kLargePool], split_ranges);
  set(split_counts_[kSmallPool], split_slabs);
  set(split_counts_[kAllPools], split_ranges + split_slabs);
  s.inactive_split_bytes = split_bytes_;
  s.inactive_split = split_counts_;
  return s;
}

namespace {
[[noreturn]] void violated(const std::string& what) {
  throw std::logic_error("gmem invariant violated: " + what);
}
}  // namespace

void Engine::Impl::check_invariants() const {
  std::lock_guard lock(mutex_);
  // Ranges tile each arena exactly; no two free neighbours; recount page references.
  std::vector<std::vector<std::uint32_t>> refs(arenas_.size());
  std::int64_t used_large = 0;
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    const detail::RangeAllocator& ranges = arenas_[a]->ranges;
    refs[a].assign(pages_.arena(a).size(), 0);
    DevicePtr expect = ranges.base();
    bool prev_free = false;
    std::size_t free_count = 0;
    for (NodeId id = ranges.first(); id != kNoNode; id = ranges.node(id).next) {
      const detail::RangeNode& n = ranges.node(id);
      if (n.addr != expect) violated("arena ranges do not tile the address space");
      if (n.size == 0 || n.size % kAlignment) violated("range size not a multiple of 512");
      if (n.free && prev_free) violated("two adjacent free ranges were not merged");
      prev_free = n.free;
      expect += n.size;
      if (n.free) {
        ++free_count;
        continue;
      }
      used_large += static_cast<std::int64_t>(n.size);
      const std::size_t first = (n.addr - ranges.base()) >> page_shift_;
      const std::size_t last = (n.addr + n.size - 1 - ranges.base()) >> page_shift_;
      for (std::size_t i = first; i <= last; ++i) ++refs[a][i];
    }
    if (expect != ranges.base() + ranges.size()) violated("arena ranges end short");
    if (free_count != ranges.free_ranges()) violated("free range count differs from the bins");
  }
  // Pages: references match, used pages are mapped, the cache holds exactly the free mapped ones.
  std::size_t mapped = 0, cached = 0;
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    const std::vector<Page>& pages = pages_.arena(a);
    for (std::size_t i = 0; i < pages.size(); ++i) {
      const Page& p = pages[i];
      if (p.refs != refs[a][i])
        violated("page " + std::to_string(i) + " has " + std::to_string(p.refs) +
                 " references, ranges say " + std::to_string(refs[a][i]));
      if (p.refs > 0 && !p.chunk) violated("a used page is not mapped");
      mapped += p.chunk != 0;
      cached += p.chunk != 0 && p.refs == 0;
    }
  }
  std::size_t walked = 0;
  for (detail::PageId id = pages_.oldest_cached(); id != detail::kNoPage; id = pages_.next_cached(id)) {
    const Page& p = pages_.at(id);
    if (!p.chunk || p.refs) violated("the page cache holds a used or unmapped page");
    if (++walked > cached) break;
  }
  if (mapped != pages_.mapped() || cached != pages_.cached() || walked != cached)
    violated("mapped/cached page counts drifted");
  if (mapped + spare_chunks_.size() != chunks_held_) violated("chunks held != mapped + spare");

  // Live blocks: each large one owns its range, each small one a distinct slot of a live slab.
  std::int64_t alloc[3] = {0, 0, 0}, count[3] = {0, 0, 0}, requested[3] = {0, 0, 0};
  std::map<detail::SlabId, std::uint32_t> slab_users;
  std::int64_t pending_ranges = 0, small_ranges = 0;
  for (const detail::PendingFree& p : pending_) {
    if (p.record.in_slab) ++slab_users[p.record.id];
    else pending_ranges += static_cast<std::int64_t>(p.record.size);
    if (!p.record.in_slab && p.record.small) small_ranges += static_cast<std::int64_t>(p.record.size);
  }
  std::int64_t live_ranges = 0;
  live_.for_each([&](std::uintptr_t ptr, const detail::Record& r) {
    if (ptr % kAlignment) violated("block not aligned to 512 B");
    const int pool = r.small ? kSmallPool : kLargePool;
    for (int i : {static_cast<int>(kAllPools), pool}) {
      alloc[i] += static_cast<std::int64_t>(r.size);
      requested[i] += static_cast<std::int64_t>(r.requested);
      ++count[i];
    }
    if (r.in_slab) {
      const detail::Slab& slab = slabs_.slab(r.id);
      if (!slab.live || ptr < slab.base || ptr + r.size > slab.base + slab.bytes() ||
          (ptr - slab.base) % slab.object_size || r.size > slab.object_size)
        violated("small block outside its slab's slots");
      ++slab_users[r.id];
      return;
    }
    const detail::RangeNode& n = arenas_[r.arena]->ranges.node(r.id);
    if (n.free || n.addr != ptr || n.size != r.size) violated("block does not own its range");
    live_ranges += static_cast<std::int64_t>(r.size);
    if (r.small) small_ranges += static_cast<std::int64_t>(r.size);
  });
  std::int64_t slab_bytes = 0;
  for (detail::SlabId id = 0; id < slabs_.slab_count(); ++id) {
    const detail::Slab& slab = slabs_.slab(id);
    if (!slab.live) continue;
    slab_bytes += static_cast<std::int64_t>(slab.bytes());
    const detail::RangeNode& n = arenas_[slab.arena]->ranges.node(slab.node);
    if (n.free || n.addr != slab.base || n.size != slab.bytes()) violated("slab does not own its range");
    if (slab.used != slab_users[id] || slab.used + slab.free_slots.size() != slab.capacity)
      violated("slab slot counts drifted");
  }
  if (live_ranges + pending_ranges != static_cast<std::int64_t>(range_bytes_) ||
      small_ranges != static_cast<std::int64_t>(small_range_bytes_) ||
      live_ranges + pending_ranges + slab_bytes != used_large)
    violated("used ranges differ from live blocks and slabs");
  for (int i = 0; i < 3; ++i) {
    if (stats_.allocated_bytes[i].current != alloc[i] || stats_.allocation[i].current != count[i] ||
        stats_.requested_bytes[i].current != requested[i])
      violated("allocation stats differ from a recount");
  }
  const auto held = static_cast<std::int64_t>(chunks_held_ * granularity_);
  if (stats_.reserved_bytes[kAllPools].current != held) violated("reserved_bytes != chunks held");
  if (stats_.reserved_bytes[kSmallPool].current != slab_bytes + small_ranges)
    violated("small pool reserved != its slabs and ranges");
  if (held < alloc[kAllPools]) violated("reserved < allocated");
}

}  // namespace gmem
