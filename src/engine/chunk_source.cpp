// Stitching: a free chunk mapped where a new block needs memory, as an alias (it stays mapped
// where it was). Why aliases: a training step that repeats asks for the same blocks in the same
// order, so the engine places them at the same addresses every step. If stitching unmapped a
// chunk to move it, the page it left would be missing the next time its address came round, and
// every step would stitch again (~60 us a page on a GPU). With aliases, the first steps map every
// page the layout touches, each page keeps its chunk, and later steps make no device calls.
// Physical memory is what counts: a chunk is created only when no free chunk can be mapped
// instead, so reserved memory tracks the pages that live blocks touch.
#include "engine/chunk_source.hpp"

#include <algorithm>

#include "gmem/error.hpp"

namespace gmem::detail {

ChunkSource::ChunkSource(Device& device, Arenas& arenas, PageBacking& pages, MapCalls& calls,
                         Accounting& accounting, EngineObserver* const& observer,
                         BackingClient& client, const EngineLock& lock, Options options)
    : device_(device), arenas_(arenas), streams_(arenas.streams()), pages_(pages),
      chunks_(pages.chunks()), calls_(calls), accounting_(accounting), observer_(observer),
      client_(client), lock_(lock), options_(options), page_size_(arenas.page_size()),
      device_total_(device.mem_info().total), clash_rule_(device.host_time()) {}

std::size_t ChunkSource::checked_limit(std::size_t bytes, const char* what) const {
  if (bytes == 0) return device_total_;
  if (bytes > device_total_)
    throw Error(Errc::invalid_argument, std::string(what) + " = " + format_bytes(bytes) +
                                            ": more than the device's " + format_bytes(device_total_) +
                                            " (0 means the whole device)");
  if (bytes < page_size_)
    throw Error(Errc::invalid_argument, std::string(what) + " = " + std::to_string(bytes) +
                                            " bytes: less than one " + format_bytes(page_size_) +
                                            " page, a limit that would allow nothing");
  return bytes;
}

// --- a chunk for a page -----------------------------------------------------------------------------

ChunkId ChunkSource::acquire(std::uint32_t stream, int& stage, std::uint32_t clashes_before,
                             bool planned, bool warm_up) {
  if (chunks_.has_spare()) return chunks_.any_spare();
  if (options_.stable_pages) [[unlikely]] {  // a spare or a new chunk, never one mapped elsewhere
    if (const ChunkId c = create_chunk(); c != kNoChunk) return c;
    stage = kRetried;
    client_.reclaim();
    return chunks_.has_spare() ? chunks_.any_spare() : kNoChunk;
  }
  // A warm-up step (steps marked: a shape's first, the first on a new plan) stitches: its
  // layout is not seen again, and chunks bought to settle it would be held for good.
  if (clashes_before > 0 && !warm_up &&
      clash_rule_.allows_new_chunk(chunks_.held(), pages_.peak_used(), clashes_before, planned,
                                   device_.host_time()))
    if (const ChunkId c = create_chunk(); c != kNoChunk) return c;
  // A free chunk mapped elsewhere costs the same map and set_access as a new one, and no memory;
  // one another stream may still use costs a stream wait on the GPU besides (hand_over).
  for (const Steal how : {Steal::ready, Steal::handed_over}) {
    if (how == Steal::handed_over && !options_.handovers) break;  // no scan: hand_over refuses all
    if (const ChunkId c = steal(stream, how); c != kNoChunk) {
      stage = std::max(stage, int{kStitched});
      return c;
    }
  }
  // Blocks this stream freed that other streams still hold (record_stream): this stream made to
  // wait for them on the GPU, their memory is its own again, as the next free of it would be.
  if (options_.handovers && client_.hand_over_held(streams_.progress.stream(stream)) > 0) {
    if (const ChunkId c = steal(stream, Steal::ready); c != kNoChunk) {
      stage = std::max(stage, int{kStitched});
      return c;
    }
  }
  if (const ChunkId c = create_chunk(); c != kNoChunk) return c;
  // Pressure: wait for other streams to release their free chunks, then give back empty slabs
  // and frees pending on other streams.
  stage = kRetried;
  if (const ChunkId c = steal(stream, Steal::waited); c != kNoChunk) return c;
  client_.reclaim();
  if (chunks_.has_spare()) return chunks_.any_spare();
  return steal(stream, Steal::waited);
}

ChunkId ChunkSource::after_map_ahead(std::uint32_t stream) {
  if (chunks_.has_spare()) return chunks_.any_spare();
  return steal(stream, Steal::waited);
}

bool ChunkSource::make_ready(std::uint32_t arena, std::size_t index, const Page& page) {
  // Each poll that finds its alias's stream done, or handover made, lets the walk go past it, to
  // the next alias that blocks (or none). A handover costs an event record and a stream wait
  // (a few microseconds, no memory) where the remap it saves costs an unmap, a map and a
  // set-access, and a chunk.
  const std::uint32_t stream = arenas_[arena].stream;
  for (PageId other; (other = pages_.blocking_alias(arena, index, page)) != kNoPage;) {
    const std::uint32_t from = arenas_.stream_of(other);
    const Page& p = arenas_.page(other);
    if (p.refs > 0) return false;  // busy: no poll makes it ready
    if (streams_.progress.catch_up(from, false) && streams_.progress.done(from, p.free_seq)) continue;
    if (!hand_over(stream, from, p.free_seq)) return false;
  }
  return true;
}

bool ChunkSource::chunk_usable_by(ChunkId chunk, std::uint32_t stream, bool poll) {
  const Chunk& c = chunks_.at(chunk);
  for (std::uint32_t k = 0; k < c.maps; ++k) {
    const std::uint32_t from = arenas_.stream_of(c.pages[k]);
    const Page& p = arenas_.page(c.pages[k]);
    if (p.refs > 0) return false;
    if (streams_.progress.ordered(stream, from, p.free_seq)) continue;
    if (!poll || !streams_.progress.catch_up(from, false) || !streams_.progress.done(from, p.free_seq))
      return false;
  }
  return true;
}

bool ChunkSource::hand_over(std::uint32_t stream, std::uint32_t from, std::uint64_t free_seq) {
  if (!options_.handovers || !streams_.progress.order_after(stream, from, free_seq)) return false;
  ++accounting_.stats.num_stream_handovers;
  return true;
}

bool ChunkSource::hand_over_chunk(ChunkId chunk, std::uint32_t stream) {
  const Chunk& c = chunks_.at(chunk);
  for (std::uint32_t k = 0; k < c.maps; ++k) {
    const std::uint32_t from = arenas_.stream_of(c.pages[k]);
    const Page& p = arenas_.page(c.pages[k]);
    if (!streams_.progress.ordered(stream, from, p.free_seq) && !hand_over(stream, from, p.free_seq))
      return false;
  }
  return true;
}

ChunkId ChunkSource::steal(std::uint32_t stream, Steal how) {
  // Which free chunk to take decides whether the layout settles: a chunk taken from a page that
  // is needed again while the thief still holds it must be stitched back (and the page it then
  // takes from, and so on). So take the one whose pages are due last: each page's next use is
  // predicted from its last two (a training step repeats), among the oldest frees (they are
  // also the likeliest to be done on other streams).
  // Before that, one whose pages the GPU is known to be done with (chunk_gpu_done, no event call):
  // a page whose chunk serves elsewhere is unmapped when next used, and the host waits there
  // for the GPU to reach the page's free if it has not yet. That wait lasts as long as the GPU
  // lags (milliseconds), a remap tens of microseconds. Most such waits followed a chunk taken on
  // its own stream a moment after its free, which stream order allows (docs/notes/2026-11-25-steals-that-leave-no-wait-behind.md).
  // At most kWeighed usable candidates, among at most kExamined entries unless the caller will
  // wait anyway: entries another stream has not caught up with stay listed, and scanning them all
  // for every page would make each malloc cost grow with the number of streams. A handover
  // (Steal::handed_over) weighs every chunk no alias uses: the poll was made by the scan before.
  FreedPages& freed = pages_.freed();
  const bool wait = how == Steal::waited;
  static constexpr int kWeighed = 64;
  static constexpr int kExamined = 4 * kWeighed;
  std::size_t best = freed.end();
  bool best_done = false;
  std::int64_t best_due = 0;
  int weighed = 0, examined = 0;
  std::size_t k = freed.begin();
  for (; k < freed.end() && weighed < kWeighed && (wait || examined < kExamined); ++k) {
    const PageId id = freed.at(k);
    if (id == kNoPage) continue;
    const std::uint32_t from = arenas_.stream_of(id);
    Page& p = arenas_.page(id);
    pages_.settle(p);
    // Stale (used again, or unmapped since), or its chunk busy through another alias (which is
    // listed itself when freed): not worth another look.
    if (p.refs > 0 || !p.mapped() || (p.aliased && pages_.chunk_in_use(p.chunk))) {
      freed.drop(k, p);
      continue;
    }
    ++examined;
    if (wait && !streams_.progress.ordered(stream, from, p.free_seq)) {
      streams_.progress.catch_up(from, true);
      ++accounting_.stats.num_sync_all_streams;
    }
    if (how != Steal::handed_over && !chunk_usable_by(p.chunk, stream, true)) continue;
    ++weighed;
    const bool done = pages_.chunk_gpu_done(p.chunk);
    const std::int64_t due =
        static_cast<std::int64_t>(static_cast<std::uint32_t>(p.last_use + p.reuse - pages_.clock()));
    if (best == freed.end() || done > best_done || (done == best_done && due > best_due)) {
      best = k;
      best_done = done;
      best_due = due;
    }
  }
  // Entries dropped in this scan (or in earlier ones, further back) are not walked again.
  best = freed.close_gaps_before(k, best);
  if (best == freed.end()) {
    freed.sweep();
    return kNoChunk;
  }
  const PageId id = freed.at(best);
  const std::uint32_t from = arenas_.stream_of(id);
  const Page& p = arenas_.page(id);
  const ChunkId chunk = p.chunk;
  if (how == Steal::handed_over && !hand_over_chunk(chunk, stream)) {
    freed.sweep();
    return kNoChunk;
  }
  if (chunks_.at(chunk).maps == Chunk::kMaxMaps) {
    // Enough aliases: this one (free, and done on its stream) makes room for the next.
    if (!streams_.progress.wait_for(from, p.free_seq)) return kNoChunk;
    unmap_page(id);
  }
  freed.sweep();
  return chunk;
}

bool ChunkSource::could_back(std::size_t pages) {
  // False (oom_reason_ says why) when a block's pages alone are over the limit, or when the
  // chunks it must create, kAskDeviceBeyond or more beyond those held, are more than the device
  // has free (one cuMemGetInfo). So a malloc that cannot succeed is refused before it creates
  // anything: on an H200, a 140.8 GiB request under a 139.8 GiB limit created the 130 GiB the
  // device had free (65,000 cuMemCreate, then as many cuMemRelease) before it failed, and peak
  // reserved read 138 GiB ever after. At most one page of a chunk is in use at a time, so a
  // block needs a chunk for each of its pages: those held may serve, the rest must be created.
  if (pages * page_size_ > limit_) {
    oom_reason_ = "limit";
    return false;
  }
  const std::size_t held = chunks_.held();
  if (pages <= held + kAskDeviceBeyond) return true;  // a few to create: the creates will tell
  DeviceMemInfo info;
  try {
    info = device_.mem_info();
  } catch (const DeviceError&) {
    return true;  // no answer: the creates will tell
  }
  if ((pages - held) * page_size_ <= info.free) return true;
  oom_reason_ = "device";
  return false;
}

ChunkId ChunkSource::create_chunk() {
  // Chunks being created by other threads (the lock released meanwhile) count as held.
  if ((chunks_.held() + creating_ + 1) * page_size_ > limit_) {
    oom_reason_ = "limit";
    return kNoChunk;
  }
  ChunkHandle handle = 0;
  ++creating_;
  try {
    lock_.unlocked([&] { handle = device_.create_chunk(page_size_); });
  } catch (const DeviceError& e) {
    --creating_;
    if (!e.device_out_of_memory()) throw;
    oom_reason_ = "device";
    return kNoChunk;
  } catch (...) {
    --creating_;
    throw;
  }
  --creating_;
  ChunkId id;
  try {
    id = chunks_.add(handle);
  } catch (...) {
    try { device_.release_chunk(handle); } catch (...) {}
    throw;
  }
  accounting_.count_chunk_created(page_size_);
  return id;
}

// --- unmaps and giving back ---------------------------------------------------------------------------

void ChunkSource::release_chunk(ChunkId chunk) {
  device_.release_chunk(chunks_.at(chunk).handle);
  chunks_.remove(chunk);
  accounting_.count_chunk_released(page_size_);
}

void ChunkSource::release_spares() {
  try {
    while (chunks_.has_spare()) release_chunk(chunks_.any_spare());
  } catch (const DeviceError&) {  // kept as spare: the OOM is the news here
  }
}

void ChunkSource::unmap_page(PageId id, bool unlock) {
  const DevicePtr va = arenas_.address(id);
  // Unmaps made under the lock take free pages only (refs == 0 at every alias of the chunk),
  // so no MapJob maps their chunk: a job's chunks are busy through its malloc's references.
  // Only the clash unmap, made without the lock, can meet one (Mapper::map_missing).
  if (unlock) {
    lock_.unlocked([&] {
      std::lock_guard order(calls_.calls_order());  // never inside another thread's MapJob
      device_.unmap(va, page_size_);
    });
  } else {
    device_.unmap(va, page_size_);
  }
  pages_.note_unmapped(id);
  ++accounting_.stats.num_unmaps;
  if (observer_) observer_->on_unmap(va, page_size_);
}

bool ChunkSource::unmap_chunk(ChunkId chunk, bool wait) {
  Chunk& c = chunks_.at(chunk);
  for (std::uint32_t k = 0; k < c.maps; ++k) {
    const std::uint32_t from = arenas_.stream_of(c.pages[k]);
    const Page& p = arenas_.page(c.pages[k]);
    if (p.refs > 0) return false;
    if (!streams_.progress.done(from, p.free_seq)) {
      if (wait) ++accounting_.stats.num_sync_all_streams;
      if (!streams_.progress.catch_up(from, wait) && !streams_.progress.done(from, p.free_seq))
        return false;
    }
  }
  while (c.maps > 0) unmap_page(c.pages[c.maps - 1]);
  return true;
}

void ChunkSource::trim_to(std::size_t bytes, bool wait) {
  while (chunks_.held() * page_size_ > bytes && chunks_.has_spare())
    release_chunk(chunks_.any_spare());
  // Oldest frees first: the likeliest to be done on their streams.
  FreedPages& freed = pages_.freed();
  for (std::size_t k = freed.begin(); k < freed.end() && chunks_.held() * page_size_ > bytes; ++k) {
    const PageId id = freed.at(k);
    if (id == kNoPage) continue;
    Page& p = arenas_.page(id);
    pages_.settle(p);
    if (p.refs > 0 || !p.mapped()) {
      freed.drop(k, p);
      continue;
    }
    const ChunkId chunk = p.chunk;
    if (!unmap_chunk(chunk, wait)) continue;
    release_chunk(chunk);  // on failure it stays held, as a spare
  }
  freed.sweep();
}

void ChunkSource::release_unpinned_pages() {
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    const Arena& arena = arenas_[a];
    arena.pages.for_each_touched([&](std::size_t i, const Page& seen) {
      if (!seen.mapped() || seen.pinned) return;
      Page& p = arenas_[a].pages.at(i);
      pages_.settle(p);
      if (p.refs > 0 || p.in_flight || !streams_.progress.done(arena.stream, p.free_seq)) return;
      unmap_page(page_id(a, static_cast<std::uint32_t>(i)));  // its chunk goes spare
    });
  }
}

// --- the OOM --------------------------------------------------------------------------------------

void ChunkSource::throw_oom(std::size_t requested, StreamId stream) {
  OomInfo info;
  info.requested = requested;
  info.stream = stream;
  info.limit = limit_;
  info.device_total = device_total_;
  try {
    info.device_free = device_.mem_info().free;
  } catch (...) {  // the report goes on without it
  }
  info.reserved = chunks_.held() * page_size_;
  info.allocated = static_cast<std::size_t>(accounting_.stats.allocated_bytes[kAllPools].current);
  info.largest_free_range = pages_.largest_free_range();
  info.reclaimable = (chunks_.held() - pages_.used_pages()) * page_size_;
  info.reason = oom_reason_;
  ++accounting_.stats.num_ooms;
  if (observer_) observer_->on_oom(info);
  throw OutOfMemoryError(std::move(info));
}

}  // namespace gmem::detail
