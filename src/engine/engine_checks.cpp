// Reading the engine: stats (the derived ones computed on demand, off the hot path) and the
// full invariant check the tests run after every step.
#include <algorithm>
#include <bit>
#include <map>
#include <unordered_map>
#include <sstream>
#include <stdexcept>

#include "engine/engine_impl.hpp"

namespace gmem {

using detail::kNoNode;
using detail::NodeId;
using detail::Page;

MemoryStats Engine::Impl::stats(bool derived) const {
  // Asked before the lock: a driver call, and the device layer is thread-safe on its own.
  DeviceMemInfo device{};
  if (derived) {
    try {
      device = device_.mem_info();
    } catch (const DeviceError&) {  // unknown: reported as 0
    }
  }
  std::lock_guard lock(mutex_);
  const detail::Accounting& acc = accounting_;
  MemoryStats s = acc.stats;
  const auto gran = static_cast<std::int64_t>(backing_.granularity());
  const auto slab_bytes = static_cast<std::int64_t>(slabs_.bytes());
  const auto held = static_cast<std::int64_t>(backing_.pages().chunks().held());
  const auto spare = static_cast<std::int64_t>(backing_.pages().chunks().spares());
  const auto used = static_cast<std::int64_t>(backing_.pages().used_pages());
  s.chunks_held = held;
  s.chunks_mapped = held - spare;
  s.mapped_pages = static_cast<std::int64_t>(backing_.pages().chunks().mapped_pages());
  s.memory_limit = static_cast<std::int64_t>(backing_.chunk_source().limit());
  const detail::StepPlanner::Stats& plan = backing_.plan_stats();
  s.steps_marked = static_cast<std::int64_t>(plan.steps);
  s.plans = static_cast<std::int64_t>(plan.plans);
  s.plan_steps_followed = static_cast<std::int64_t>(plan.followed);
  s.plan_hits = static_cast<std::int64_t>(plan.hits);
  s.plan_mismatches = static_cast<std::int64_t>(plan.mismatches);
  s.plan_conflicts = static_cast<std::int64_t>(plan.conflicts);
  s.plan_extent_bytes = static_cast<std::int64_t>(plan.extent);
  s.plans_ahead = static_cast<std::int64_t>(plan.ahead);
  s.plan_wait_us = static_cast<std::int64_t>(plan.wait_ns / 1000);
  const Device::CallTimes times = device_.call_times();
  s.device_call_us = static_cast<std::int64_t>(times.calls_us);
  s.stream_wait_us = static_cast<std::int64_t>(times.waits_us);
  s.free_mapped_bytes = (held - spare - used) * gran;
  s.free_unmapped_bytes = spare * gran;
  s.partial_page_bytes = used * gran - static_cast<std::int64_t>(acc.range_bytes) - slab_bytes;
  s.small_slack_bytes = slab_bytes - (acc.stats.active_bytes[kSmallPool].current -
                                      static_cast<std::int64_t>(acc.small_range_bytes));
  s.pending_free_bytes = acc.stats.active_bytes[kAllPools].current -
                         acc.stats.allocated_bytes[kAllPools].current;
  if (!derived) return s;

  s.largest_free_range = static_cast<std::int64_t>(backing_.pages().largest_free_range());
  s.device_total_bytes = static_cast<std::int64_t>(device.total);
  s.device_free_bytes = static_cast<std::int64_t>(device.free);
  if (device.total > 0)
    s.outside_bytes = std::max<std::int64_t>(
        0, s.device_total_bytes - s.device_free_bytes - s.reserved_bytes[kAllPools].current);
  // Inactive split: free bytes sharing a page with used ranges (large) or a slab with live
  // slots (small); peaks are those seen by detailed_stats() calls.
  std::int64_t split_ranges = 0, split_slabs = 0;
  const detail::Arenas& arenas = backing_.arenas();
  const detail::PageBacking& pages = backing_.pages();
  for (std::uint32_t a = 0; a < arenas.size(); ++a) {
    const detail::Arena& arena = arenas[a];
    const detail::RangeAllocator& ranges = arena.ranges;
    for (detail::NodeId id = ranges.first(); id != detail::kNoNode; id = ranges.node(id).next) {
      const detail::RangeNode& n = ranges.node(id);
      if (!n.free) continue;
      const auto [f, l] = arenas.span(a, n.addr, n.size);
      if (pages.refs_of(arena.pages.get(f)) > 0 || pages.refs_of(arena.pages.get(l)) > 0) ++split_ranges;
    }
  }
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
  set(acc.split_bytes[kLargePool], s.partial_page_bytes);
  set(acc.split_bytes[kSmallPool], small_split_bytes);
  set(acc.split_bytes[kAllPools], s.partial_page_bytes + small_split_bytes);
  set(acc.split_counts[kLargePool], split_ranges);
  set(acc.split_counts[kSmallPool], split_slabs);
  set(acc.split_counts[kAllPools], split_ranges + split_slabs);
  s.inactive_split_bytes = acc.split_bytes;
  s.inactive_split = acc.split_counts;
  return s;
}

namespace {
[[noreturn]] void violated(const std::string& what) {
  throw std::logic_error("gmem invariant violated: " + what);
}
}  // namespace

namespace detail {

std::int64_t Backing::check_invariants() const {
  const ChunkPool& pool = pages_.chunks();
  // Ranges tile each arena exactly; no two free neighbours; recount page references.
  std::int64_t used_large = 0;
  std::vector<std::unordered_map<std::size_t, std::uint32_t>> refs(arenas_.size());
  // Kept places (kept_places.hpp) are used ranges with no references, in no plan region.
  std::vector<std::unordered_map<NodeId, std::size_t>> kept(arenas_.size());
  placement_.kept().for_each([&](std::size_t bytes, const KeptPlaces::Place& place) {
    if (place.arena >= arenas_.size() || place.arena == placement_.plan_arena()) violated("a kept place in no arena");
    const RangeNode& n = arenas_[place.arena].ranges.node(place.node);
    if (n.free || n.addr != place.addr || n.size != bytes) violated("a kept place does not own its range");
    if (!kept[place.arena].emplace(place.node, bytes).second) violated("a place kept twice");
  });
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    const RangeAllocator& ranges = arenas_[a].ranges;
    DevicePtr expect = ranges.base();
    bool prev_free = false;
    std::size_t free_count = 0;
    for (NodeId id = ranges.first(); id != kNoNode; id = ranges.node(id).next) {
      const RangeNode& n = ranges.node(id);
      if (n.addr != expect) violated("arena ranges do not tile the address space");
      if (n.size == 0 || n.size % kAlignment) violated("range size not a multiple of 512");
      if (n.free && prev_free) violated("two adjacent free ranges were not merged");
      prev_free = n.free;
      expect += n.size;
      if (n.free) {
        ++free_count;
        continue;
      }
      if (kept[a].count(id)) continue;
      used_large += static_cast<std::int64_t>(n.size);
      const auto [first, last] = arenas_.span(a, n.addr, n.size);
      for (std::size_t i = first; i <= last; ++i) ++refs[a][i];
    }
    if (expect != ranges.base() + ranges.size()) violated("arena ranges end short");
    if (a == placement_.plan_arena()) {  // the plan region's used ranges are all in its map, and only they
      std::size_t used_ranges = 0;
      for (NodeId id = ranges.first(); id != kNoNode; id = ranges.node(id).next)
        if (!ranges.node(id).free && (++used_ranges, !placement_.plan_region().contains(ranges.node(id).addr, id)))
          violated("a used range of the plan region is not in its map");
      if (used_ranges != placement_.plan_region().size()) violated("the plan region's map holds ranges not used");
    }
    if (free_count != ranges.free_ranges()) violated("free range count differs from the bins");
  }
  // Pages: references match, used pages are mapped, and pages and chunks agree on the mappings;
  // a chunk is used through one page at most (else two blocks would share memory).
  std::size_t used = 0, free_mapped = 0, mapped = 0, run_pages = 0;
  std::vector<std::uint32_t> used_through(pool.slots(), 0);
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    std::size_t seen_refs = 0;
    arenas_[a].pages.for_each_touched([&](std::size_t i, const Page& p) {
      const auto it = refs[a].find(i);
      // A page mapped ahead of its plan's first use holds one reference more (map_ahead.cpp).
      const std::uint32_t expect = (it == refs[a].end() ? 0 : it->second) + p.ahead;
      seen_refs += it != refs[a].end();
      // A page mapped ahead is one its round booked: a round that ends gives them all back.
      if (p.ahead && (a != placement_.plan_arena() ||
                      std::find(ahead_.booked().begin(), ahead_.booked().end(), i) == ahead_.booked().end()))
        violated("page " + std::to_string(i) + " holds a map-ahead reference no round booked");
      const std::uint32_t p_refs = pages_.refs_of(p);
      if (p_refs != expect)
        violated("page " + std::to_string(i) + " has " + std::to_string(p_refs) +
                 " references, ranges say " + std::to_string(expect));
      if (p_refs > 0 && !p.mapped()) violated("a used page is not mapped");
      used += p_refs > 0;
      if (p.in_run) {
        if (p.last_use >= pages_.runs().records().size() || !pages_.runs()[p.last_use].live)
          violated("a page is in no live run");
        const PageRun& run = pages_.runs()[p.last_use];
        if (run.arena != a || i < run.first || i > run.last) violated("a page is outside its run");
        if (!p.mapped() || p.aliased || !p.listed) violated("a run's page is unmapped, aliased or not listed");
        ++run_pages;
      }
      if (!p.mapped()) {
        if (p.aliased) violated("an unmapped page is marked aliased");
        return;
      }
      ++mapped;
      free_mapped += p_refs == 0;
      if (p.chunk >= pool.slots() || pool.at(p.chunk).handle == 0)
        violated("a page maps a chunk gmem does not hold");
      const Chunk& c = pool.at(p.chunk);
      const PageId self = page_id(a, static_cast<std::uint32_t>(i));
      if (std::find(c.pages.begin(), c.pages.begin() + c.maps, self) == c.pages.begin() + c.maps)
        violated("a chunk does not list a page it is mapped at");
      if (static_cast<bool>(p.aliased) != (c.maps > 1)) violated("a page's alias mark is wrong");
      if (p_refs > 0 && ++used_through[p.chunk] > 1) violated("a chunk is used through two pages");
    });
    if (seen_refs != refs[a].size()) violated("a used page was never written");
  }
  std::size_t in_runs = 0;
  const std::vector<PageRun>& runs = pages_.runs().records();
  for (const PageRun& run : runs) in_runs += run.live ? run.last - run.first + 1 : 0;
  if (in_runs != run_pages) violated("a run's pages are not all marked");
  const auto live_runs = static_cast<std::size_t>(
      std::count_if(runs.begin(), runs.end(), [](const PageRun& r) { return r.live; }));
  if (runs.size() - pages_.runs().unused() != live_runs || live_runs != pages_.runs().live())
    violated("run counts drifted");
  std::size_t held = 0, listed_maps = 0, spare = 0;
  for (ChunkId id = 0; id < pool.slots(); ++id) {
    const Chunk& c = pool.at(id);
    if (c.handle == 0) continue;
    ++held;
    spare += c.maps == 0;
    listed_maps += c.maps;
    for (std::uint32_t k = 0; k < c.maps; ++k) {
      const Page& p = arenas_.page(c.pages[k]);
      if (p.chunk != id) violated("a chunk lists a page that maps another chunk");
    }
  }
  if (used != pages_.used_pages() || free_mapped != pages_.mapped_free_pages()) violated("used/free page counts drifted");
  if (mapped != listed_maps || mapped != pool.mapped_pages()) violated("mapped page counts drifted");
  if (held != pool.held() || spare != pool.spares()) violated("chunk counts drifted");
  // Every free chunk can be found by stitching: one of its pages is listed as freed.
  std::vector<bool> findable(pool.slots(), false);
  std::size_t listed = 0;
  for (std::size_t k = pages_.freed().begin(); k < pages_.freed().end(); ++k) {
    const PageId id = pages_.freed().at(k);
    if (id == kNoPage) continue;
    const Page& p = arenas_.page(id);
    if (!p.listed) violated("a listed page is not marked so");
    ++listed;
    if (p.mapped() && pages_.refs_of(p) == 0) findable[p.chunk] = true;
  }
  std::size_t marked = 0;
  for (std::uint32_t a = 0; a < arenas_.size(); ++a)
    arenas_[a].pages.for_each_touched([&](std::size_t, const Page& p) { marked += p.listed; });
  if (listed != pages_.freed().listed() || marked != listed) violated("freed page list and marks disagree");
  for (ChunkId id = 0; id < pool.slots(); ++id) {
    const Chunk& c = pool.at(id);
    if (c.handle == 0 || c.maps == 0 || used_through[id] > 0) continue;
    if (!findable[id]) violated("a free chunk is listed nowhere");
  }

  return used_large;
}

}  // namespace detail

void Engine::Impl::check_invariants() const {
  // A malloc in its slow path has taken its range but not made it a block yet: check between.
  std::unique_lock lock(mutex_);
  landed_.wait(lock, [this] { return backing_.pages().claims() == 0; });
  const std::int64_t used_large = backing_.check_invariants();
  // Live blocks: each large one owns its range, each small one a distinct slot of a live slab.
  std::int64_t alloc[3] = {0, 0, 0}, count[3] = {0, 0, 0}, requested[3] = {0, 0, 0};
  std::map<detail::SlabId, std::uint32_t> slab_users;
  std::int64_t pending_ranges = 0, small_ranges = 0, record_ranges = 0;
  cross_stream_.for_each_pending([&](const detail::Record& r) {
    if (r.in_slab) {
      ++slab_users[r.id];
    } else {
      pending_ranges += static_cast<std::int64_t>(backing_.arenas()[r.arena].ranges.node(r.id).size);
      record_ranges += static_cast<std::int64_t>(r.size);
    }
    if (!r.in_slab && r.small) small_ranges += static_cast<std::int64_t>(r.size);
  });
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
    const detail::RangeNode& n = backing_.arenas()[r.arena].ranges.node(r.id);
    // A block that took a larger step's place takes that block's range (StepPlanner::Ticket).
    if (n.free || n.addr != ptr || n.size < r.size) violated("block does not own its range");
    live_ranges += static_cast<std::int64_t>(n.size);
    record_ranges += static_cast<std::int64_t>(r.size);
    if (r.small) small_ranges += static_cast<std::int64_t>(r.size);
  });
  std::int64_t slab_bytes = 0;
  for (detail::SlabId id = 0; id < slabs_.slab_count(); ++id) {
    const detail::Slab& slab = slabs_.slab(id);
    if (!slab.live) continue;
    slab_bytes += static_cast<std::int64_t>(slab.bytes());
    const detail::RangeNode& n = backing_.arenas()[slab.arena].ranges.node(slab.node);
    if (n.free || n.addr != slab.base || n.size != slab.bytes()) violated("slab does not own its range");
    std::uint32_t free_slots = 0;
    for (std::uint64_t word : slab.free_bits) free_slots += static_cast<std::uint32_t>(std::popcount(word));
    if (slab.used != slab_users[id] || slab.used + free_slots != slab.capacity)
      violated("slab slot counts drifted");
  }
  const detail::Accounting& acc = accounting_;
  if (record_ranges != static_cast<std::int64_t>(acc.range_bytes) ||
      small_ranges != static_cast<std::int64_t>(acc.small_range_bytes) ||
      live_ranges + pending_ranges + slab_bytes != used_large)
    violated("used ranges differ from live blocks and slabs");
  for (int i = 0; i < 3; ++i) {
    if (acc.stats.allocated_bytes[i].current != alloc[i] || acc.stats.allocation[i].current != count[i] ||
        acc.stats.requested_bytes[i].current != requested[i])
      violated("allocation stats differ from a recount");
  }
  const auto held_bytes = static_cast<std::int64_t>(backing_.pages().chunks().held() * backing_.granularity());
  if (acc.stats.reserved_bytes[kAllPools].current != held_bytes) violated("reserved_bytes != chunks held");
  if (acc.stats.reserved_bytes[kSmallPool].current != slab_bytes + small_ranges)
    violated("small pool reserved != its slabs and ranges");
  if (held_bytes < alloc[kAllPools]) violated("reserved < allocated");
}

}  // namespace gmem
