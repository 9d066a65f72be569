// Backing's map-ahead: the plan region's pages mapped by a thread of Backing's, early (while the
// steps before the first plan run) and as each new plan's first step runs (backing.hpp says why
// and how).
#include <algorithm>
#include <exception>

#include "engine/backing.hpp"

namespace gmem::detail {

void Backing::start_map_ahead() {
  const std::vector<StepPlanner::PlannedBlock> blocks = planner_.blocks_of_new_plan();
  if (blocks.empty()) return;
  end_map_ahead();  // a round the last mark did not end (no mark since): what it holds goes back
  const Arena& arena = *arenas_[plan_arena_];
  std::vector<std::uint32_t> queue, ordinals;
  std::vector<bool> seen;
  for (const StepPlanner::PlannedBlock& b : blocks) {
    if (b.offset + b.size > arena.ranges.size()) continue;  // take_planned sends it online
    const std::size_t first = b.offset >> page_shift_, last = (b.offset + b.size - 1) >> page_shift_;
    if (seen.size() <= last) seen.resize(last + 1);
    for (std::size_t i = first; i <= last; ++i) {
      if (seen[i]) continue;
      seen[i] = true;
      if (arena.pages.get(i).mapped()) continue;
      queue.push_back(static_cast<std::uint32_t>(i));
      ordinals.push_back(b.ordinal);
    }
  }
  if (queue.size() < kMinAheadPages) return;
  ahead_.queue = std::move(queue);
  ahead_.ordinals = std::move(ordinals);
  ahead_.next = ahead_.reached = 0;
  ahead_.held = true;
  wake_map_ahead();
}

std::size_t Backing::booking_limit() {
  if (!ahead_.held) return ahead_.queue.size();
  // The step's mallocs so far: the pages first used by blocks it has asked for are reached.
  const std::size_t asked = planner_.recorded();
  while (ahead_.reached < ahead_.ordinals.size() && ahead_.ordinals[ahead_.reached] < asked) ++ahead_.reached;
  return std::min(ahead_.queue.size(), ahead_.reached + kAheadWindow);
}

void Backing::start_mapping_early(std::uint32_t si, std::size_t extent) {
  end_map_ahead();  // an early round the last mark did not end: its candidates are stale
  if (plan_arena_ == kNoArena) plan_arena_ = add_arena(si, extent, false, /*for_malloc=*/false);
  const Arena& arena = *arenas_[plan_arena_];
  const std::size_t wanted = std::min((extent + granularity_ - 1) >> page_shift_, arena.pages.size());
  std::vector<std::uint32_t> queue;
  for (std::size_t i = 0; i < wanted; ++i) {
    const Page& p = arena.pages.get(i);
    if (!p.mapped() && p.refs == 0 && !p.in_flight) queue.push_back(static_cast<std::uint32_t>(i));
  }
  if (queue.size() < kMinAheadPages) return;
  // The chunks free as this step begins, found through the freed pages (a walk of them all, in
  // the steps before the first plan only): one for each page, each with room for another alias
  // (so that no steal has to unmap one for it), none mapped in the plan region already (two of
  // its pages would share it), none another stream may still use.
  std::vector<std::pair<ChunkId, PageId>> candidates;
  std::vector<bool> seen(chunks_.slots());
  for (std::size_t k = freed_pages_.begin(); k < freed_pages_.end(); ++k) {
    const PageId id = freed_pages_.at(k);
    if (id == kNoPage) continue;
    Page& p = page_at(id);
    settle(p);
    if (p.refs > 0 || !p.mapped() || seen[p.chunk]) continue;
    seen[p.chunk] = true;
    if (early_chunk_fits(p.chunk, arena.stream)) candidates.emplace_back(p.chunk, id);
  }
  // Due last first, as a steal weighs them: a chunk whose page the program uses again soon (a
  // block that outlives each step lands there) would be busy when the plan's step wants it.
  const auto due = [&](const std::pair<ChunkId, PageId>& c) {
    const Page& p = page_at(c.second);
    return static_cast<std::uint32_t>(p.last_use + p.reuse - clock_);
  };
  std::stable_sort(candidates.begin(), candidates.end(),
                   [&](const auto& a, const auto& b) { return due(a) > due(b); });
  ahead_.queue = std::move(queue);
  ahead_.next = 0;
  ahead_.held = false;
  ahead_.candidates = std::move(candidates);
  ahead_.next_candidate = 0;
  wake_map_ahead();
}

bool Backing::early_chunk_fits(ChunkId chunk, std::uint32_t stream) const {
  const Chunk& c = chunks_.at(chunk);
  if (c.handle == 0 || c.maps == 0 || c.maps >= Chunk::kMaxMaps - 1) return false;
  for (std::uint32_t k = 0; k < c.maps; ++k) {
    const PageId alias = c.pages[k];
    if (arena_of(alias) == plan_arena_) return false;
    const Arena& a = *arenas_[arena_of(alias)];
    const Page& p = a.pages.get(index_of(alias));
    if (refs_of(p) > 0 || p.in_flight) return false;
    if (!streams_.progress.ordered(stream, a.stream, p.free_seq)) return false;
  }
  return true;
}

void Backing::wake_map_ahead() {
  if (!ahead_.thread.joinable()) {
    try {
      ahead_.thread = std::thread([this] { map_ahead_loop(); });
    } catch (...) {  // no thread: the step maps its pages itself, as without map-ahead
      ahead_.enabled = false;
      end_map_ahead();
      return;
    }
  }
  client_.landed();  // wakes the thread
}

bool Backing::book_ahead(MapJob& job) {
  const std::uint32_t stream = arenas_[plan_arena_]->stream;
  PageTable& pages = arenas_[plan_arena_]->pages;
  job.arena = plan_arena_;
  job.base = arenas_[plan_arena_]->ranges.base();
  job.pages.reserve(kAheadBatch);
  job.chunks.reserve(kAheadBatch);
  job.undone.reserve(kAheadBatch);
  ahead_.booked.reserve(ahead_.booked.size() + kAheadBatch);  // the pushes below cannot throw
  while (job.pages.size() < kAheadBatch && ahead_.next < booking_limit()) {
    const std::uint32_t i = ahead_.queue[ahead_.next];
    Page& p = pages.at(i);
    settle(p);
    if (p.mapped() || p.refs > 0) {  // the step got there first
      ++ahead_.next;
      continue;
    }
    // A spare, or a free chunk the stream may use now; never a new chunk nor a wait for another
    // stream: what that would take is left to the step's own malloc, which knows how.
    // An early round leaves the step a few free chunks besides those its batch holds: a malloc
    // that found none would create one (and hold it for good) rather than wait for the batch.
    // It ends there; the next step's round goes on.
    if (!ahead_.held && chunks_.held() < used_pages_ + job.pages.size() + chunks_.held() / kEarlyReserve) {
      ahead_.next = ahead_.queue.size();
      break;
    }
    ChunkId chunk = kNoChunk;
    if (chunks_.has_spare()) {
      chunk = chunks_.any_spare();
    } else {
      chunk = ahead_.held ? steal_free_chunk(stream, Steal::ready) : early_chunk(p);
    }
    if (chunk == kNoChunk) {
      ahead_.next = ahead_.queue.size();
      break;
    }
    ++ahead_.next;
    p.refs = 1;  // the map-ahead's: the chunk is busy, so nobody steals or unmaps it
    p.ahead = 1;
    p.in_flight = 1;
    if (ahead_.held) {  // a block takes the page over: it counts as used from now on
      if (++used_pages_ > interval_peak_used_) note_peak_used();
      ahead_.booked.push_back(i);
    }
    note_mapped(plan_arena_, i, chunk);
    job.pages.push_back(i);
    job.chunks.push_back(chunks_.at(chunk).handle);
    job.undone.push_back(0);
  }
  return !job.pages.empty();
}

ChunkId Backing::early_chunk(Page& page) {
  const std::uint32_t stream = arenas_[plan_arena_]->stream;
  while (ahead_.next_candidate < ahead_.candidates.size()) {
    const auto [chunk, found_at] = ahead_.candidates[ahead_.next_candidate++];
    if (chunk >= chunks_.slots() || !early_chunk_fits(chunk, stream)) continue;  // used since
    // The page is due when the page its chunk was found through is: a steal weighs the chunk
    // the same through either.
    if (const Chunk& c = chunks_.at(chunk); std::find(c.pages.begin(), c.pages.begin() + c.maps, found_at) !=
                                            c.pages.begin() + c.maps) {
      Page& source = page_at(found_at);
      settle(source);
      page.last_use = source.last_use;
      page.reuse = source.reuse;
    }
    return chunk;
  }
  return kNoChunk;
}

bool Backing::pinned_early(std::uint32_t arena, std::size_t first, std::size_t last) const {
  // A page whose chunk an early batch in flight is mapping in the plan region: the batch holds
  // the chunk busy only until it lands (a millisecond), so the malloc waits rather than remap.
  const PageTable& pages = arenas_[arena]->pages;
  for (std::size_t i = first; i <= last; ++i) {
    const Page& p = pages.get(i);
    if (!p.aliased || !p.mapped()) continue;
    const Chunk& c = chunks_.at(p.chunk);
    for (std::uint32_t k = 0; k < c.maps; ++k)
      if (arena_of(c.pages[k]) == plan_arena_) {
        const Page& q = page_at(c.pages[k]);
        if (q.in_flight && q.ahead) return true;
      }
  }
  return false;
}

void Backing::land_ahead(const MapJob& job, std::uint64_t round, bool held) {
  PageTable& pages = arenas_[job.arena]->pages;
  accounting_.stats.num_maps_ahead += static_cast<std::int64_t>(job.mapped);
  // A device failure ends the round; the step maps the rest itself (and meets the failure
  // there, if it lasts).
  if (!land_books(job)) ahead_.next = ahead_.queue.size();
  for (const std::uint32_t i : job.pages) {
    pages.at(i).in_flight = 0;
    if (!held) {  // an early map's reference, counted nowhere (book_ahead), goes back at once
      Page& p = pages.at(i);
      p.ahead = 0;
      drop_ref(plan_arena_, i, p, /*counted=*/false);
    } else if (job.error || round != ahead_.round) {
      give_back_ahead(i);
    }
  }
}

void Backing::give_back_ahead(std::uint32_t index) {
  Page& p = arenas_[plan_arena_]->pages.at(index);
  if (!p.ahead || p.in_flight) return;  // a block's reference now, or its batch lands later
  p.ahead = 0;
  drop_ref(plan_arena_, index, p);  // no stamp: the GPU never used the page through it
}

void Backing::end_map_ahead() {
  ++ahead_.round;  // a batch in flight gives its pages back when it lands (land_ahead)
  for (const std::uint32_t i : ahead_.booked) give_back_ahead(i);
  ahead_.booked.clear();
  ahead_.queue.clear();
  ahead_.ordinals.clear();
  ahead_.next = ahead_.reached = 0;
  ahead_.candidates.clear();
  ahead_.next_candidate = 0;
  ahead_.waits_for_step = false;
}

bool Backing::take_back_map_ahead() {
  // A malloc at the memory limit that found no free chunk: the chunks map-ahead holds (pages
  // booked for the plan's later blocks, a batch in flight) are worth a wait of a millisecond;
  // an OOM with them held would be one that stopping the thread avoids.
  if (!ahead_.job_in_flight && ahead_.booked.empty()) return false;
  end_map_ahead();
  const double since = device_.host_time();
  while (ahead_.job_in_flight) client_.wait_for_landing();
  accounting_.stats.map_ahead_wait_us += static_cast<std::int64_t>(device_.host_time() - since);
  return true;
}

void Backing::map_ahead_loop() noexcept {
  for (;;) {
    MapJob job;
    std::uint64_t round = 0;
    bool stop = false, held = true;
    client_.with_lock([&] {
      while (!ahead_.stop && ahead_.next >= booking_limit()) {
        ahead_.waits_for_step = ahead_.next < ahead_.queue.size();
        client_.wait_for_landing();
      }
      ahead_.waits_for_step = false;
      if (ahead_.stop) {
        stop = true;
        return;
      }
      try {
        if (!book_ahead(job)) return;
      } catch (...) {  // a steal's wait or unmap failed: the step maps the rest itself
        ahead_.next = ahead_.queue.size();
        if (job.pages.empty()) return;
      }
      round = ahead_.round;
      held = ahead_.held;
      ahead_.job_in_flight = true;
      ahead_.early_in_flight = !held;
      ++slow_mallocs_;  // check_invariants waits for it to land
    });
    if (stop) return;
    if (job.pages.empty()) continue;
    run_job(job);  // without the engine's lock, holding mapping_calls_
    client_.with_lock([&] {
      land_ahead(job, round, held);
      ahead_.job_in_flight = ahead_.early_in_flight = false;
      --slow_mallocs_;
      client_.landed();  // mallocs waiting for these pages
    });
  }
}

void Backing::stop_map_ahead() {
  if (!ahead_.thread.joinable()) return;
  client_.with_lock([&] {
    ahead_.stop = true;
    client_.landed();
  });
  ahead_.thread.join();
  client_.with_lock([&] { end_map_ahead(); });
}

}  // namespace gmem::detail
