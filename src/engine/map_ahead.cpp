// Backing's map-ahead: a new plan's pages of the plan region mapped by a thread of Backing's
// while the step that first follows the plan runs (backing.hpp says why and how).
#include <exception>

#include "engine/backing.hpp"

namespace gmem::detail {

void Backing::start_map_ahead() {
  const std::vector<std::pair<std::size_t, std::size_t>> blocks = planner_.blocks_of_new_plan();
  if (blocks.empty()) return;
  end_map_ahead();  // a round the last mark did not end (no mark since): what it holds goes back
  const Arena& arena = *arenas_[plan_arena_];
  std::vector<std::uint32_t> queue;
  std::vector<bool> seen;
  for (const auto& [offset, size] : blocks) {
    if (offset + size > arena.ranges.size()) continue;  // take_planned sends it online
    const std::size_t first = offset >> page_shift_, last = (offset + size - 1) >> page_shift_;
    if (seen.size() <= last) seen.resize(last + 1);
    for (std::size_t i = first; i <= last; ++i) {
      if (seen[i]) continue;
      seen[i] = true;
      if (!arena.pages.get(i).mapped()) queue.push_back(static_cast<std::uint32_t>(i));
    }
  }
  if (queue.size() < kMinAheadPages) return;
  ahead_.queue = std::move(queue);
  ahead_.next = 0;
  if (!ahead_.thread.joinable()) {
    try {
      ahead_.thread = std::thread([this] { map_ahead_loop(); });
    } catch (...) {  // no thread: the step maps its pages itself, as without map-ahead
      ahead_.enabled = false;
      ahead_.queue.clear();
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
  while (job.pages.size() < kAheadBatch && ahead_.next < ahead_.queue.size()) {
    const std::uint32_t i = ahead_.queue[ahead_.next];
    Page& p = pages.at(i);
    settle(p);
    if (p.mapped() || p.refs > 0) {  // the step got there first
      ++ahead_.next;
      continue;
    }
    // A spare, or a free chunk the stream may use now; never a new chunk nor a wait for another
    // stream: what that would take is left to the step's own malloc, which knows how.
    const ChunkId chunk = chunks_.has_spare() ? chunks_.any_spare() : steal_free_chunk(stream, Steal::ready);
    if (chunk == kNoChunk) {
      ahead_.next = ahead_.queue.size();
      break;
    }
    ++ahead_.next;
    p.refs = 1;  // the map-ahead's: the chunk is busy, so nobody steals or unmaps it
    p.ahead = 1;
    p.in_flight = 1;
    if (++used_pages_ > interval_peak_used_) note_peak_used();
    note_mapped(plan_arena_, i, chunk);
    job.pages.push_back(i);
    job.chunks.push_back(chunks_.at(chunk).handle);
    job.undone.push_back(0);
    ahead_.booked.push_back(i);
  }
  return !job.pages.empty();
}

void Backing::land_ahead(const MapJob& job, std::uint64_t round) {
  PageTable& pages = arenas_[job.arena]->pages;
  accounting_.stats.num_maps_ahead += static_cast<std::int64_t>(job.mapped);
  // A device failure ends the round; the step maps the rest itself (and meets the failure
  // there, if it lasts).
  if (!land_books(job)) ahead_.next = ahead_.queue.size();
  for (const std::uint32_t i : job.pages) {
    pages.at(i).in_flight = 0;
    if (job.error || round != ahead_.round) give_back_ahead(i);
  }
}

void Backing::give_back_ahead(std::uint32_t index) {
  Page& p = arenas_[plan_arena_]->pages.at(index);
  if (!p.ahead || p.in_flight) return;  // a block's reference now, or its batch lands later
  p.ahead = 0;
  drop_ref(plan_arena_, index, p);  // no stamp: the GPU never used the page through it
}

void Backing::end_map_ahead() {
  for (const std::uint32_t i : ahead_.booked) give_back_ahead(i);
  ahead_.booked.clear();
  ahead_.queue.clear();
  ahead_.next = 0;
}

void Backing::map_ahead_loop() noexcept {
  for (;;) {
    MapJob job;
    std::uint64_t round = 0;
    bool stop = false;
    client_.with_lock([&] {
      while (!ahead_.stop && ahead_.next >= ahead_.queue.size()) client_.wait_for_landing();
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
      ahead_.job_in_flight = true;
      ++slow_mallocs_;  // check_invariants waits for it to land
    });
    if (stop) return;
    if (job.pages.empty()) continue;
    run_job(job);  // without the engine's lock, holding mapping_calls_
    client_.with_lock([&] {
      land_ahead(job, round);
      ahead_.job_in_flight = false;
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
