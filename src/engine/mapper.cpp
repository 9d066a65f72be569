#include "engine/mapper.hpp"

namespace gmem::detail {

namespace {
// Counts a malloc among the claims while it is in map_missing, and wakes the waiters when it
// leaves: its claims have landed, or a waiter's range is a block.
struct SlowMalloc {
  SlowMalloc(PageBacking& p, const EngineLock& l) : pages(p), lock(l) { pages.add_claim(); }
  ~SlowMalloc() {
    pages.end_claim();
    lock.landed();
  }
  PageBacking& pages;
  const EngineLock& lock;
};
}  // namespace

[[gnu::noinline]] bool Mapper::map_missing(std::uint32_t arena, DevicePtr addr, std::size_t bytes) {
  const auto [first, last] = arenas_.span(arena, addr, bytes);
  SlowMalloc slow(pages_, lock_);
  PageTable& pages = arenas_[arena].pages;
  if (in_flight(arena, first, last)) [[unlikely]] return wait_and_take_again(arena, addr, bytes);
  // Claimed until this returns or throws (by then a failed job's maps are undone, and its books
  // rolled back under the lock).
  struct Claim {
    Page &low, &high;
    Claim(Page& l, Page& h) : low(l), high(h) { low.in_flight = high.in_flight = 1; }
    ~Claim() { low.in_flight = high.in_flight = 0; }
  } claim(pages.at(first), pages.at(last));
  MapJob job;
  job.arena = arena;
  job.base = arenas_[arena].ranges.base();
  int stage = kFromCache;
  if (!plan_maps(arena, addr, bytes, job, stage)) return false;
  if (!job.pages.empty()) {
    lock_.unlocked([&] { calls_.run(job); });
    land(job, addr, bytes);
  }
  if (stage >= kStitched) ++accounting_.stats.num_stitches;
  if (stage >= kRetried) ++accounting_.stats.num_alloc_retries;
  return true;
}

bool Mapper::wait_and_take_again(std::uint32_t arena, DevicePtr addr, std::size_t bytes) {
  // Another slow malloc claims a boundary page: wait for it with no reference taken (so that on
  // a claimed page refs > 1 means ready: docs/design.md#device-calls-outside-the-lock), then take
  // the range's pages again; they may be ready by then.
  pages_.give_back(arena, addr, bytes, stamp(arena));
  const auto [first, last] = arenas_.span(arena, addr, bytes);
  const bool ahead = ahead_.batch_in_flight();  // waits for map-ahead batches are counted
  const double since = device_.host_time();
  do lock_.wait_for_landing();
  while (in_flight(arena, first, last));
  if (ahead) accounting_.stats.map_ahead_wait_us += static_cast<std::int64_t>(device_.host_time() - since);
  if (pages_.take(arena, addr, bytes)) return true;
  return map_missing(arena, addr, bytes);
}

bool Mapper::in_flight(std::uint32_t arena, std::size_t first, std::size_t last) const {
  const PageTable& pages = arenas_[arena].pages;
  if (pages.get(first).in_flight || pages.get(last).in_flight) return true;
  return ahead_.in_flight(arena, first, last);
}

bool Mapper::plan_maps(std::uint32_t arena, DevicePtr addr, std::size_t bytes, MapJob& job,
                       int& stage) {
  PageTable& pages = arenas_[arena].pages;
  const auto [first, last] = arenas_.span(arena, addr, bytes);
  const std::uint32_t stream = arenas_[arena].stream;
  StreamTracker& progress = arenas_.streams().progress;
  auto rollback = [&] {  // nothing reached the device yet
    calls_.forget(job, 0);
    pages_.give_back(arena, addr, bytes, progress.stamp(stream));
  };
  if (!chunks_.could_back(last - first + 1)) [[unlikely]] {
    rollback();
    return false;
  }
  try {
    for (std::size_t i = first; i <= last; ++i) {
      Page& p = pages.at(i);
      const bool conflict = p.mapped();
      if (conflict) {
        // Ready, or made so by asking a stream that freed an alias and was not asked since: an
        // event query costs far less than the remap it may save (a side stream that copies the
        // next batch while the main stream's frees of the last step are done but not polled
        // remapped every step).
        if (p.refs > 1 || chunks_.make_ready(arena, i, p)) continue;
        // Refs were taken in order, so an alias of this chunk among earlier pages of this block
        // makes it busy, as it should. Its chunk stays mapped elsewhere: only this alias goes.
        double waited_us = 0;
        if (!progress.done(stream, p.free_seq)) {
          const double waiting_since = device_.host_time();
          if (!progress.wait_for(stream, p.free_seq, &lock_)) {
            // The stream is being captured and may still use the page: it cannot be unmapped,
            // nor the stream asked (StreamTracker::set_capturing).
            chunks_.set_oom_reason(ChunkSource::kCaptureReason);
            rollback();
            return false;
          }
          ++accounting_.stats.num_sync_all_streams;
          waited_us = device_.host_time() - waiting_since;
        }
        chunks_.unmap_page(page_id(arena, static_cast<std::uint32_t>(i)), /*unlock=*/true);
        if (!placement_.planner().warm_up()) chunks_.clash_rule().count_cost(waited_us);
      }
      const std::uint32_t clashes_before = conflict ? p.clashes : 0;
      if (conflict && p.clashes < Page::kMaxClashes) ++p.clashes;
      const bool planned = arena == placement_.plan_arena();
      ChunkId chunk = chunks_.acquire(stream, stage, clashes_before, planned,
                                      placement_.planner().warm_up());
      if (chunk == kNoChunk && ahead_.take_back()) chunk = chunks_.after_map_ahead(stream);
      if (chunk == kNoChunk) {
        rollback();
        return false;
      }
      job.pages.reserve(last - i + 1);
      job.chunks.reserve(last - i + 1);
      job.undone.reserve(last - i + 1);  // the pushes below cannot throw
      job.pages.push_back(static_cast<std::uint32_t>(i));
      job.chunks.push_back(pages_.chunks().at(chunk).handle);
      job.undone.push_back(0);
      pages_.note_mapped(arena, i, chunk);
      ++accounting_.stats.num_maps;
    }
  } catch (...) {
    rollback();
    throw;
  }
  return true;
}

void Mapper::land(MapJob& job, DevicePtr addr, std::size_t bytes) {
  if (calls_.land(job)) [[likely]] return;
  // The range gives its references back.
  pages_.give_back(job.arena, addr, bytes, stamp(job.arena));
  std::rethrow_exception(job.error);
}

}  // namespace gmem::detail
