// Physical memory behind virtual ranges: taking ranges and mapping their pages, stitching
// (unmapping a cached free page and mapping its chunk where it is needed), and reclaiming under
// pressure. Every path that fails puts back what it took, so invariants hold after an error.
#include <algorithm>

#include "engine/engine_impl.hpp"

namespace gmem {

using detail::kNoNode;
using detail::kNoPage;
using detail::NodeId;
using detail::Page;
using detail::PageId;
using detail::page_id;

namespace {
// How far acquire_chunk had to go; the malloc's stats say so.
enum Stage : int { kFromCache = 0, kStitched = 1, kRetried = 2 };
}  // namespace

std::uint32_t Engine::Impl::add_arena(std::uint32_t si, std::size_t min_bytes) {
  const std::size_t size =
      std::max(arena_size_, (min_bytes + granularity_ - 1) / granularity_ * granularity_);
  DevicePtr base = 0;
  try {
    base = device_.reserve_address(size, granularity_);
  } catch (const DeviceError& e) {
    if (!e.device_out_of_memory()) throw;
    oom_reason_ = "address space";
    throw_oom(min_bytes, streams_.stream(si));
  }
  const std::uint32_t index = pages_.add_arena(size >> page_shift_, si);
  arenas_.push_back(std::make_unique<detail::Arena>(base, size, si));
  slabs_.add_arena();
  stream_arenas_[si].push_back(index);
  return index;
}

std::pair<std::uint32_t, NodeId> Engine::Impl::take_range(std::uint32_t si, std::size_t bytes,
                                                          std::size_t requested) {
  Placement place = best_fit(si, bytes);
  if (place.node == kNoNode) {
    const std::uint32_t arena = add_arena(si, bytes);
    place = Placement{arena, arenas_[arena]->ranges.find(bytes), 0};
  }
  // Big blocks at the top of their range, the rest at the bottom: the two kinds then keep to
  // their own ends of the address space and a big block's range stays whole for its next use.
  const detail::RangeNode& fit = arenas_[place.arena]->ranges.node(place.node);
  if (bytes >= kTopDownBytes) place.offset = fit.size - bytes;
  if (unmapped_pages(place.arena, fit.addr + place.offset, bytes) > 0) {
    // The other end of the same range may be mapped already (cheapest_fit's last choice);
    // else the slow path: avoid stitching where some mapped range fits.
    const std::size_t other = place.offset == 0 ? fit.size - bytes : 0;
    if (unmapped_pages(place.arena, fit.addr + other, bytes) == 0) place.offset = other;
    else place = cheapest_fit(si, bytes);
  }
  detail::RangeAllocator& ranges = arenas_[place.arena]->ranges;
  const NodeId node = ranges.take(place.node, bytes, place.offset);
  bool backed = false;
  try {
    backed = back_pages(place.arena, ranges.node(node).addr, bytes);
  } catch (...) {
    ranges.release(node);
    throw;
  }
  if (!backed) {
    ranges.release(node);
    // Chunks created for this request stay with the device, not idle in gmem's hands.
    try {
      while (!spare_chunks_.empty()) {
        release_chunk(spare_chunks_.back());
        spare_chunks_.pop_back();
      }
    } catch (const DeviceError&) {  // kept as spare: the OOM is the news here
    }
    throw_oom(requested, streams_.stream(si));
  }
  return {place.arena, node};
}

Engine::Impl::Placement Engine::Impl::best_fit(std::uint32_t si, std::size_t bytes) const {
  for (std::uint32_t a : stream_arenas_[si])
    if (const NodeId node = arenas_[a]->ranges.find(bytes); node != kNoNode) return {a, node, 0};
  return {0, kNoNode, 0};
}

std::size_t Engine::Impl::unmapped_pages(std::uint32_t arena, DevicePtr addr, std::size_t bytes) const {
  const std::vector<Page>& pages = pages_.arena(arena);
  const DevicePtr base = arenas_[arena]->ranges.base();
  const std::size_t first = (addr - base) >> page_shift_, last = (addr + bytes - 1 - base) >> page_shift_;
  std::size_t count = 0;
  for (std::size_t i = first; i <= last; ++i) count += pages[i].chunk == 0;
  return count;
}

Engine::Impl::Placement Engine::Impl::cheapest_fit(std::uint32_t si, std::size_t bytes) const {
  // Among the smallest fitting ranges, the placement (at either end) needing the fewest new
  // pages; ties go to the smaller range. Stitching in a loop would otherwise move the same
  // pages back and forth every step.
  Placement best{0, kNoNode, 0};
  std::size_t best_cost = ~std::size_t{0}, best_size = 0;
  for (std::uint32_t a : stream_arenas_[si]) {
    const detail::RangeAllocator& ranges = arenas_[a]->ranges;
    ranges.for_each_fit(bytes, 32, [&](NodeId id) {
      const detail::RangeNode& n = ranges.node(id);
      for (std::size_t offset : {n.size - bytes, std::size_t{0}}) {
        const std::size_t cost = unmapped_pages(a, n.addr + offset, bytes);
        if (cost < best_cost || (cost == best_cost && n.size < best_size)) {
          best = {a, id, offset};
          best_cost = cost;
          best_size = n.size;
        }
      }
      return best_cost == 0;
    });
  }
  return best;
}

void Engine::Impl::release_range(std::uint32_t arena, NodeId node) {
  detail::RangeAllocator& ranges = arenas_[arena]->ranges;
  const detail::RangeNode& n = ranges.node(node);
  unref_pages(arena, n.addr, n.size, streams_.stamp(arenas_[arena]->stream));
  ranges.release(node);
}

void Engine::Impl::unref_pages(std::uint32_t arena, DevicePtr addr, std::size_t bytes,
                               std::uint64_t stamp) {
  std::vector<Page>& pages = pages_.arena(arena);
  const DevicePtr base = arenas_[arena]->ranges.base();
  const std::size_t first = (addr - base) >> page_shift_, last = (addr + bytes - 1 - base) >> page_shift_;
  for (std::size_t i = first; i <= last; ++i) {
    Page& p = pages[i];
    if (--p.refs == 0) {
      p.free_seq = stamp;
      if (p.chunk) pages_.push_cached(page_id(arena, static_cast<std::uint32_t>(i)));
    }
  }
}

bool Engine::Impl::back_pages(std::uint32_t arena, DevicePtr addr, std::size_t bytes) {
  std::vector<Page>& pages = pages_.arena(arena);
  const DevicePtr base = arenas_[arena]->ranges.base();
  const std::size_t first = (addr - base) >> page_shift_, last = (addr + bytes - 1 - base) >> page_shift_;
  bool missing = false;
  for (std::size_t i = first; i <= last; ++i) {
    Page& p = pages[i];
    if (p.refs++ == 0 && p.chunk) pages_.remove_cached(page_id(arena, static_cast<std::uint32_t>(i)));
    missing |= p.chunk == 0;
  }
  if (!missing) return true;  // the steady state: every page already mapped

  // Slow path: find a chunk for every unmapped page, map them, then set access run by run.
  std::vector<std::size_t> need;
  for (std::size_t i = first; i <= last; ++i)
    if (!pages[i].chunk) need.push_back(i);
  std::vector<ChunkHandle> chunks;
  std::size_t mapped = 0;
  int stage = kFromCache;
  auto rollback = [&] {
    for (std::size_t k = 0; k < mapped; ++k) {
      Page& p = pages[need[k]];
      try {
        device_.unmap(base + (need[k] << page_shift_), granularity_);
        p.chunk = 0;
        pages_.add_mapped(-1);
        ++stats_.num_unmaps;
      } catch (...) {  // still mapped: the page keeps its chunk and is cached below
        chunks[k] = 0;
      }
    }
    for (ChunkHandle c : chunks)
      if (c) spare_chunks_.push_back(c);
    unref_pages(arena, addr, bytes, streams_.stamp(arenas_[arena]->stream));
  };
  try {
    while (chunks.size() < need.size()) {
      const ChunkHandle c = acquire_chunk(stage);
      if (!c) {
        rollback();
        return false;
      }
      chunks.push_back(c);
    }
    for (; mapped < need.size(); ++mapped) {
      device_.map(base + (need[mapped] << page_shift_), granularity_, chunks[mapped]);
      pages[need[mapped]].chunk = chunks[mapped];
      pages_.add_mapped(1);
      ++stats_.num_maps;
    }
    for (std::size_t k = 0; k < need.size();) {  // one set_access per contiguous run
      std::size_t end = k + 1;
      while (end < need.size() && need[end] == need[end - 1] + 1) ++end;
      const DevicePtr va = base + (need[k] << page_shift_);
      const std::size_t len = (end - k) << page_shift_;
      device_.set_access(va, len);
      if (log_) log_->on_map(va, len);
      k = end;
    }
  } catch (...) {
    rollback();
    throw;
  }
  if (stage >= kStitched) ++stats_.num_stitches;
  if (stage >= kRetried) ++stats_.num_alloc_retries;
  return true;
}

ChunkHandle Engine::Impl::acquire_chunk(int& stage) {
  if (!spare_chunks_.empty()) {
    const ChunkHandle c = spare_chunks_.back();
    spare_chunks_.pop_back();
    return c;
  }
  // Grow freely up to a little over what the program has ever had allocated (cache_slack):
  // a training loop then caches what it needs. Beyond that, reuse cached free pages first, so
  // reserved memory tracks live memory instead of fragmentation.
  const std::size_t next = (chunks_held_ + 1) * granularity_;
  const bool within_budget = !options_.reuse_before_grow || next <= growth_budget();
  if (!within_budget) {
    if (const ChunkHandle c = steal_cached_page(false)) {
      stage = std::max(stage, int{kStitched});
      note_stitch();
      return c;
    }
  }
  if (const ChunkHandle c = create_chunk()) return c;
  // Pressure: stitch from cached pages, waiting for other streams, then from released slabs
  // and frees pending on other streams.
  stage = std::max(stage, int{kStitched});
  if (const ChunkHandle c = steal_cached_page(false)) return c;
  stage = kRetried;
  if (const ChunkHandle c = steal_cached_page(true)) return c;
  release_spare_slabs();
  if (!pending_.empty()) process_pending(true);
  return steal_cached_page(true);
}

void Engine::Impl::note_stitch() {
  // Stitching costs device calls (on a GPU ~60 us a page). When a program keeps stitching
  // within its budget (a churn with no repeating layout), double the slack, up to kMaxSlack:
  // a little memory for a steady state without device calls.
  stitched_bytes_ += granularity_;
  if (options_.adaptive_slack && stitched_bytes_ > high_water_ / 4 && slack_ < kMaxSlack) {
    slack_ = std::min(kMaxSlack, std::max(slack_ * 2, 1.0 / 64));
    stitched_bytes_ = 0;
  }
}

std::size_t Engine::Impl::growth_budget() const {
  const std::size_t high_water = std::max(high_water_, allocating_);
  return high_water + static_cast<std::size_t>(static_cast<double>(high_water) * slack_) +
         2 * granularity_;
}

ChunkHandle Engine::Impl::create_chunk() {
  if ((chunks_held_ + 1) * granularity_ > limit_) {
    oom_reason_ = "limit";
    return 0;
  }
  try {
    const ChunkHandle c = device_.create_chunk(granularity_);
    ++chunks_held_;
    ++stats_.num_device_alloc;
    for (int pool : {kAllPools, kLargePool}) {
      stats_.reserved_bytes[pool].increase(static_cast<std::int64_t>(granularity_));
      stats_.segment[pool].increase(1);
    }
    return c;
  } catch (const DeviceError& e) {
    if (!e.device_out_of_memory()) throw;
    oom_reason_ = "device";
    return 0;
  }
}

ChunkHandle Engine::Impl::steal_cached_page(bool wait) {
  std::vector<bool> polled(streams_.size(), false);
  for (PageId id = pages_.newest_cached(); id != kNoPage; id = pages_.prev_cached(id)) {
    const Page& p = pages_.at(id);
    if (!streams_.done(p.stream, p.free_seq)) {
      // Unmapping takes effect at once, not in stream order: kernels queued before the free
      // may still be using the page, even on the requesting stream. Its chunk may move only
      // once the freeing stream has caught up.
      if (polled[p.stream]) continue;
      polled[p.stream] = true;
      if (wait) ++stats_.num_sync_all_streams;
      if (!streams_.catch_up(p.stream, wait) && !streams_.done(p.stream, p.free_seq)) continue;
    }
    const ChunkHandle chunk = p.chunk;
    unmap_page(id);
    return chunk;
  }
  return 0;
}

void Engine::Impl::unmap_page(PageId id) {
  const std::uint32_t arena = static_cast<std::uint32_t>(id >> 32);
  const std::size_t index = id & 0xffffffffu;
  const DevicePtr va = arenas_[arena]->ranges.base() + (index << page_shift_);
  device_.unmap(va, granularity_);
  pages_.remove_cached(id);
  pages_.at(id).chunk = 0;
  pages_.add_mapped(-1);
  ++stats_.num_unmaps;
  if (log_) log_->on_unmap(va, granularity_);
}

void Engine::Impl::release_chunk(ChunkHandle chunk) {
  device_.release_chunk(chunk);
  --chunks_held_;
  ++stats_.num_device_free;
  for (int pool : {kAllPools, kLargePool}) {
    stats_.reserved_bytes[pool].decrease(static_cast<std::int64_t>(granularity_));
    stats_.segment[pool].decrease(1);
  }
}

void Engine::Impl::release_spare_slabs() {
  for (detail::SlabId id : slabs_.take_spares()) {
    const detail::Slab& slab = slabs_.slab(id);
    const auto bytes = static_cast<std::int64_t>(slab.bytes());
    release_range(slab.arena, slab.node);
    slabs_.remove(id);
    move_reserved_to_small(-bytes);
  }
}

void Engine::Impl::trim_to(std::size_t bytes, bool wait) {
  while (chunks_held_ * granularity_ > bytes && !spare_chunks_.empty()) {
    release_chunk(spare_chunks_.back());
    spare_chunks_.pop_back();
  }
  while (chunks_held_ * granularity_ > bytes) {
    const ChunkHandle c = steal_cached_page(wait);
    if (!c) break;
    try {
      release_chunk(c);
    } catch (...) {
      spare_chunks_.push_back(c);  // still ours: keep it accounted for
      throw;
    }
  }
}

void Engine::Impl::empty_cache() {
  std::lock_guard lock(mutex_);
  if (!pending_.empty()) process_pending(true);
  release_spare_slabs();
  trim_to(0, true);
}

void Engine::Impl::set_memory_limit(std::size_t bytes) {
  std::lock_guard lock(mutex_);
  limit_ = bytes ? bytes : device_total_;
  stats_.memory_limit = static_cast<std::int64_t>(limit_);
  if (chunks_held_ * granularity_ > limit_) {
    release_spare_slabs();
    trim_to(limit_, true);
  }
}

void Engine::Impl::throw_oom(std::size_t requested, StreamId stream) {
  OomInfo info;
  info.requested = requested;
  info.stream = stream;
  info.limit = limit_;
  info.device_total = device_total_;
  try {
    info.device_free = device_.mem_info().free;
  } catch (...) {  // the report goes on without it
  }
  info.reserved = chunks_held_ * granularity_;
  info.allocated = static_cast<std::size_t>(stats_.allocated_bytes[kAllPools].current);
  info.largest_free_range = largest_free_range();
  info.reclaimable = (pages_.cached() + spare_chunks_.size()) * granularity_;
  info.reason = oom_reason_;
  ++stats_.num_ooms;
  if (log_) log_->on_oom(info);
  throw OutOfMemoryError(std::move(info));
}

std::vector<std::pair<DevicePtr, DevicePtr>> Engine::Impl::mapped_ranges() const {
  std::vector<std::pair<DevicePtr, DevicePtr>> out;
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    const std::vector<Page>& pages = pages_.arena(a);
    const DevicePtr base = arenas_[a]->ranges.base();
    for (std::size_t i = 0; i < pages.size(); ++i) {
      if (!pages[i].chunk) continue;
      const DevicePtr begin = base + (i << page_shift_);
      if (!out.empty() && out.back().second == begin) out.back().second += granularity_;
      else out.emplace_back(begin, begin + granularity_);
    }
  }
  return out;
}

std::size_t Engine::Impl::largest_free_range() const {
  std::size_t best = 0;
  for_each_free_range([&](const detail::RangeAllocator& ranges, const std::vector<Page>& pages,
                          const detail::RangeNode& n) {
    std::size_t run = 0;
    for (DevicePtr pos = n.addr, end = n.addr + n.size; pos < end;) {
      const std::size_t i = (pos - ranges.base()) >> page_shift_;
      const DevicePtr page_end = std::min<DevicePtr>(end, ranges.base() + ((i + 1) << page_shift_));
      run = pages[i].chunk ? run + (page_end - pos) : 0;
      best = std::max(best, run);
      pos = page_end;
    }
  });
  return best;
}

}  // namespace gmem
