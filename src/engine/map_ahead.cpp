#include "engine/map_ahead.hpp"

#include <algorithm>
#include <exception>

namespace gmem::detail {

MapAhead::~MapAhead() {
  if (thread_.joinable()) std::terminate();  // the engine stops it first (stop)
}

void MapAhead::start() {
  const std::vector<StepPlanner::PlannedBlock> blocks = placement_.planner().blocks_of_new_plan();
  if (blocks.empty()) return;
  end();  // a round the last mark did not end (no mark since): what it holds goes back
  const Arena& arena = arenas_[placement_.plan_arena()];
  const int shift = arenas_.page_shift();
  std::vector<std::uint32_t> queue, ordinals;
  std::vector<bool> seen;
  for (const StepPlanner::PlannedBlock& b : blocks) {
    if (b.offset + b.size > arena.ranges.size()) continue;  // PlannedTaker::take sends it online
    const std::size_t first = b.offset >> shift, last = (b.offset + b.size - 1) >> shift;
    if (seen.size() <= last) seen.resize(last + 1);
    for (std::size_t i = first; i <= last; ++i) {
      if (seen[i]) continue;
      seen[i] = true;
      if (arena.pages.get(i).mapped()) continue;
      queue.push_back(static_cast<std::uint32_t>(i));
      ordinals.push_back(b.ordinal);
    }
  }
  if (queue.size() < kMinPages) return;
  queue_ = std::move(queue);
  ordinals_ = std::move(ordinals);
  next_ = reached_ = 0;
  held_ = true;
  wake();
}

std::size_t MapAhead::booking_limit() {
  if (!held_) return queue_.size();
  // The step's mallocs so far: the pages first used by blocks it has asked for are reached.
  const std::size_t asked = placement_.planner().recorded();
  while (reached_ < ordinals_.size() && ordinals_[reached_] < asked) ++reached_;
  return std::min(queue_.size(), reached_ + kWindow);
}

void MapAhead::start_early(std::uint32_t si, std::size_t extent) {
  end();  // an early round the last mark did not end: its candidates are stale
  placement_.add_plan_arena(si, extent, /*for_malloc=*/false);
  const std::uint32_t plan_arena = placement_.plan_arena();
  const Arena& arena = arenas_[plan_arena];
  const std::size_t wanted =
      std::min((extent + arenas_.page_size() - 1) >> arenas_.page_shift(), arena.pages.size());
  std::vector<std::uint32_t> queue;
  for (std::size_t i = 0; i < wanted; ++i) {
    const Page& p = arena.pages.get(i);
    if (!p.mapped() && p.refs == 0 && !p.in_flight) queue.push_back(static_cast<std::uint32_t>(i));
  }
  if (queue.size() < kMinPages) return;
  // The chunks free as this step begins, found through the freed pages (a walk of them all, in
  // the steps before the first plan only): one for each page, each with room for another alias
  // (so that no steal has to unmap one for it), none mapped in the plan region already (two of
  // its pages would share it), none another stream may still use.
  std::vector<std::pair<ChunkId, PageId>> candidates;
  std::vector<bool> seen(pages_.chunks().slots());
  const FreedPages& freed = pages_.freed();
  for (std::size_t k = freed.begin(); k < freed.end(); ++k) {
    const PageId id = freed.at(k);
    if (id == kNoPage) continue;
    Page& p = arenas_.page(id);
    pages_.settle(p);
    if (p.refs > 0 || !p.mapped() || seen[p.chunk]) continue;
    seen[p.chunk] = true;
    if (early_chunk_fits(p.chunk, arena.stream)) candidates.emplace_back(p.chunk, id);
  }
  // Due last first, as a steal weighs them: a chunk whose page the program uses again soon (a
  // block that outlives each step lands there) would be busy when the plan's step wants it.
  const std::uint32_t now = pages_.clock();
  const auto due = [&](const std::pair<ChunkId, PageId>& c) {
    const Page& p = arenas_.page(c.second);
    return static_cast<std::uint32_t>(p.last_use + p.reuse - now);
  };
  std::stable_sort(candidates.begin(), candidates.end(),
                   [&](const auto& a, const auto& b) { return due(a) > due(b); });
  queue_ = std::move(queue);
  next_ = 0;
  held_ = false;
  candidates_ = std::move(candidates);
  next_candidate_ = 0;
  wake();
}

bool MapAhead::early_chunk_fits(ChunkId chunk, std::uint32_t stream) const {
  const Chunk& c = pages_.chunks().at(chunk);
  if (c.handle == 0 || c.maps == 0 || c.maps >= Chunk::kMaxMaps - 1) return false;
  for (std::uint32_t k = 0; k < c.maps; ++k) {
    const PageId alias = c.pages[k];
    if (arena_of(alias) == placement_.plan_arena()) return false;
    const Page& p = arenas_.page(alias);
    if (pages_.refs_of(p) > 0 || p.in_flight) return false;
    if (!arenas_.streams().progress.ordered(stream, arenas_.stream_of(alias), p.free_seq)) return false;
  }
  return true;
}

void MapAhead::wake() {
  if (!thread_.joinable()) {
    try {
      thread_ = std::thread([this] { loop(); });
    } catch (...) {  // no thread: the step maps its pages itself, as without map-ahead
      enabled_ = false;
      end();
      return;
    }
  }
  lock_.landed();  // wakes the thread
}

bool MapAhead::book(MapJob& job) {
  const std::uint32_t plan_arena = placement_.plan_arena();
  const std::uint32_t stream = arenas_[plan_arena].stream;
  PageTable& pages = arenas_[plan_arena].pages;
  ChunkPool& pool = pages_.chunks();
  job.arena = plan_arena;
  job.base = arenas_[plan_arena].ranges.base();
  job.pages.reserve(kBatch);
  job.chunks.reserve(kBatch);
  job.undone.reserve(kBatch);
  booked_.reserve(booked_.size() + kBatch);  // the pushes below cannot throw
  while (job.pages.size() < kBatch && next_ < booking_limit()) {
    const std::uint32_t i = queue_[next_];
    Page& p = pages.at(i);
    pages_.settle(p);
    if (p.mapped() || p.refs > 0) {  // the step got there first
      ++next_;
      continue;
    }
    // A spare, or a free chunk the stream may use now; never a new chunk nor a wait for another
    // stream: what that would take is left to the step's own malloc, which knows how.
    // An early round leaves the step a few free chunks besides those its batch holds: a malloc
    // that found none would create one (and hold it for good) rather than wait for the batch.
    // It ends there; the next step's round goes on.
    if (!held_ && pool.held() < pages_.used_pages() + job.pages.size() + pool.held() / kEarlyReserve) {
      next_ = queue_.size();
      break;
    }
    ChunkId chunk = kNoChunk;
    if (pool.has_spare()) {
      chunk = pool.any_spare();
    } else {
      chunk = held_ ? chunks_.steal(stream, ChunkSource::Steal::ready) : early_chunk(p);
    }
    if (chunk == kNoChunk) {
      next_ = queue_.size();
      break;
    }
    ++next_;
    p.refs = 1;  // the map-ahead's: the chunk is busy, so nobody steals or unmaps it
    p.ahead = 1;
    p.in_flight = 1;
    if (held_) {  // a block takes the page over: it counts as used from now on
      pages_.count_used();
      booked_.push_back(i);
    }
    pages_.note_mapped(plan_arena, i, chunk);
    ++accounting_.stats.num_maps;
    job.pages.push_back(i);
    job.chunks.push_back(pool.at(chunk).handle);
    job.undone.push_back(0);
  }
  return !job.pages.empty();
}

ChunkId MapAhead::early_chunk(Page& page) {
  const std::uint32_t stream = arenas_[placement_.plan_arena()].stream;
  const ChunkPool& pool = pages_.chunks();
  while (next_candidate_ < candidates_.size()) {
    const auto [chunk, found_at] = candidates_[next_candidate_++];
    if (chunk >= pool.slots() || !early_chunk_fits(chunk, stream)) continue;  // used since
    // The page is due when the page its chunk was found through is: a steal weighs the chunk
    // the same through either.
    if (const Chunk& c = pool.at(chunk);
        std::find(c.pages.begin(), c.pages.begin() + c.maps, found_at) != c.pages.begin() + c.maps) {
      Page& source = arenas_.page(found_at);
      pages_.settle(source);
      page.last_use = source.last_use;
      page.reuse = source.reuse;
    }
    return chunk;
  }
  return kNoChunk;
}

bool MapAhead::in_flight(std::uint32_t arena, std::size_t first, std::size_t last) const {
  if (early_in_flight_ && pinned_early(arena, first, last)) [[unlikely]] return true;
  // Only a map-ahead batch claims pages inside a range (a malloc claims its two ends).
  if (!job_in_flight_ || arena != placement_.plan_arena()) return false;
  const PageTable& pages = arenas_[arena].pages;
  for (std::size_t i = first + 1; i < last; ++i)
    if (pages.get(i).in_flight) return true;
  return false;
}

bool MapAhead::pinned_early(std::uint32_t arena, std::size_t first, std::size_t last) const {
  // A page whose chunk an early batch in flight is mapping in the plan region: the batch holds
  // the chunk busy only until it lands (a millisecond), so the malloc waits rather than remap.
  const PageTable& pages = arenas_[arena].pages;
  for (std::size_t i = first; i <= last; ++i) {
    const Page& p = pages.get(i);
    if (!p.aliased || !p.mapped()) continue;
    const Chunk& c = pages_.chunks().at(p.chunk);
    for (std::uint32_t k = 0; k < c.maps; ++k)
      if (arena_of(c.pages[k]) == placement_.plan_arena()) {
        const Page& q = arenas_.page(c.pages[k]);
        if (q.in_flight && q.ahead) return true;
      }
  }
  return false;
}

void MapAhead::land(const MapJob& job, std::uint64_t round, bool held) {
  PageTable& pages = arenas_[job.arena].pages;
  accounting_.stats.num_maps_ahead += static_cast<std::int64_t>(job.mapped);
  // A device failure ends the round; the step maps the rest itself (and meets the failure
  // there, if it lasts).
  if (!calls_.land(job)) next_ = queue_.size();
  for (const std::uint32_t i : job.pages) {
    pages.at(i).in_flight = 0;
    if (!held) {  // an early map's reference, counted nowhere (book), goes back at once
      Page& p = pages.at(i);
      p.ahead = 0;
      pages_.drop_ref(job.arena, i, p, /*counted=*/false);
    } else if (job.error || round != round_) {
      give_back(i);
    }
  }
}

void MapAhead::give_back(std::uint32_t index) {
  const std::uint32_t plan_arena = placement_.plan_arena();
  Page& p = arenas_[plan_arena].pages.at(index);
  if (!p.ahead || p.in_flight) return;  // a block's reference now, or its batch lands later
  p.ahead = 0;
  pages_.drop_ref(plan_arena, index, p);  // no stamp: the GPU never used the page through it
}

void MapAhead::end() {
  ++round_;  // a batch in flight gives its pages back when it lands (land)
  for (const std::uint32_t i : booked_) give_back(i);
  booked_.clear();
  queue_.clear();
  ordinals_.clear();
  next_ = reached_ = 0;
  candidates_.clear();
  next_candidate_ = 0;
  waits_for_step_ = false;
}

bool MapAhead::take_back() {
  if (!job_in_flight_ && booked_.empty()) return false;
  end();
  const double since = device_.host_time();
  while (job_in_flight_) lock_.wait_for_landing();
  accounting_.stats.map_ahead_wait_us += static_cast<std::int64_t>(device_.host_time() - since);
  return true;
}

void MapAhead::loop() noexcept {
  for (;;) {
    MapJob job;
    std::uint64_t round = 0;
    bool stop = false, held = true;
    lock_.with_lock([&] {
      while (!stop_ && next_ >= booking_limit()) {
        waits_for_step_ = next_ < queue_.size();
        lock_.wait_for_landing();
      }
      waits_for_step_ = false;
      if (stop_) {
        stop = true;
        return;
      }
      try {
        if (!book(job)) return;
      } catch (...) {  // a steal's wait or unmap failed: the step maps the rest itself
        next_ = queue_.size();
        if (job.pages.empty()) return;
      }
      round = round_;
      held = held_;
      job_in_flight_ = true;
      early_in_flight_ = !held;
      pages_.add_claim();  // check_invariants waits for it to land
    });
    if (stop) return;
    if (job.pages.empty()) continue;
    calls_.run(job);  // without the engine's lock, holding the calls' order
    lock_.with_lock([&] {
      land(job, round, held);
      job_in_flight_ = early_in_flight_ = false;
      pages_.end_claim();
      lock_.landed();  // mallocs waiting for these pages
    });
  }
}

void MapAhead::stop() {
  if (!thread_.joinable()) return;
  lock_.with_lock([&] {
    stop_ = true;
    lock_.landed();
  });
  thread_.join();
  lock_.with_lock([&] { end(); });
}

}  // namespace gmem::detail
