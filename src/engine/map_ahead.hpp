// MapAhead: a new plan's pages mapped by a thread of its own (EngineOptions::map_ahead).
//
// The step that first follows a plan maps the plan region's pages (a Llama step: 3,380 of them,
// 110-180 ms of driver calls, serialized by the driver), on the program's thread, in a step the
// host is the bottleneck of. The same calls made by another thread while the step runs cost it
// 6-8 ms (H100: bench/torch/overlap_maps.py). So at that step's first malloc, the pages its plan
// uses that are not mapped are queued in the order the step will first use them, and the thread
// maps them a batch at a time: each batch is booked under the engine's lock (a spare chunk or a
// free one the stream may use now, never a new one: where there is none, the rest is left to
// the step, as without map-ahead), each page holding a reference of the map-ahead's (Page::ahead)
// so that its chunk stays busy; its calls are made without the lock, and it lands under it. The
// first block that takes such a page takes that reference over; a block that needs a page still
// in flight waits for its batch (Mapper::map_missing). The step's mark gives back the references
// no block took.
//
// That step's mallocs catch up with the thread (a Llama step's forward pass takes most of the
// plan's extent within tens of milliseconds), so the region is also mapped early: during the
// steps before any plan is followed, while they keep beginning new shapes (they will come back),
// as much of it as the largest step recorded held at once in its own blocks
// (StepPlanner::extent_to_map_early). Those maps are aliases of chunks that were free as such a
// step began (a step's temporaries: free again when the plan's step begins), one chunk to a page,
// none aliased in the region already; each page holds a reference only while its batch is in
// flight (so that no chunk of the batch is stolen or unmapped meanwhile; a malloc whose page
// shares such a chunk waits for the batch instead of remapping), counted nowhere, and is a free
// mapped page once it lands. A page whose chunk is busy when the plan's step reaches it is
// remapped then, as any alias would be.
#pragma once

#include <cstddef>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "engine/accounting.hpp"
#include "engine/arenas.hpp"
#include "engine/chunk_source.hpp"
#include "engine/engine_lock.hpp"
#include "engine/map_job.hpp"
#include "engine/page_backing.hpp"
#include "engine/placement.hpp"

namespace gmem::detail {

class MapAhead {
 public:
  MapAhead(bool enabled, Device& device, Arenas& arenas, Placement& placement, PageBacking& pages,
           ChunkSource& chunks, MapCalls& calls, Accounting& accounting, const EngineLock& lock)
      : enabled_(enabled), device_(device), arenas_(arenas), placement_(placement),
        pages_(pages), chunks_(chunks), calls_(calls), accounting_(accounting), lock_(lock) {}
  ~MapAhead();  // the thread is stopped by then (stop)
  MapAhead(const MapAhead&) = delete;
  MapAhead& operator=(const MapAhead&) = delete;

  bool enabled() const { return enabled_; }
  // At a plan step's first malloc: queues the new plan's pages that are not mapped.
  void start();
  // Maps `extent` bytes of the plan region early, for stream `si`'s plan.
  void start_early(std::uint32_t si, std::size_t extent);
  // The round ends: what it holds goes back (a batch in flight gives its pages back when it lands).
  void end();
  // Whether a round holds pages or has pages left to book (a mark ends it).
  bool under_way() const { return !booked_.empty() || next_ < queue_.size(); }
  // A step that left its plan: the pages booked for the plan's later blocks go back.
  bool holds_booked() const { return held_ && !booked_.empty(); }
  // The step reached further: wakes the thread if it waits for that.
  void step_went_on() {
    if (waits_for_step_) [[unlikely]] lock_.landed();
  }
  // Ends the round and waits for its batch in flight: false when map-ahead held no chunk. For a
  // malloc at the limit that found no free chunk: an OOM with them held would be one that
  // stopping the thread avoids.
  bool take_back();
  // Stops and joins the thread (called without the engine's lock, before the engine goes), and
  // gives back what the round still holds.
  void stop();

  // A malloc's pages [first, last] of `arena` meet a batch in flight: claimed by it (in the plan
  // region), or sharing a chunk an early batch is mapping there.
  bool in_flight(std::uint32_t arena, std::size_t first, std::size_t last) const;
  bool batch_in_flight() const { return job_in_flight_; }
  // The pages booked this round (check_invariants: a page's map-ahead reference is one of them).
  const std::vector<std::uint32_t>& booked() const { return booked_; }

 private:
  bool book(MapJob& job);                // the next batch; false: nothing left
  ChunkId early_chunk(Page& page);        // the next chunk for an early map; kNoChunk: none left
  // Whether a chunk may be mapped early (free, on the stream's order, room for an alias, none of
  // its pages in the plan region).
  bool early_chunk_fits(ChunkId chunk, std::uint32_t stream) const;
  void wake();                            // starts the thread if there is none, and wakes it
  bool pinned_early(std::uint32_t arena, std::size_t first, std::size_t last) const;
  void land(const MapJob& job, std::uint64_t round, bool held);
  void give_back(std::uint32_t index);    // one page's reference, unless a block took it
  std::size_t booking_limit();            // the pages a held round may book by now
  void loop() noexcept;

  static constexpr std::size_t kBatch = 32;  // pages a batch: ~1 ms of calls
  // A held round books at most this many pages beyond those the step has reached (~1 ms of
  // calls): each holds its chunk from its booking, and a step that leaves its plan, or places
  // long-lived blocks online, needs the chunks the plan's later pages would otherwise hold.
  static constexpr std::size_t kWindow = 32;
  // An early round leaves the step at least 1/kEarlyReserve of the chunks held free.
  static constexpr std::size_t kEarlyReserve = 16;
  static constexpr std::size_t kMinPages = 16;  // fewer are mapped by the step

  bool enabled_;
  Device& device_;
  Arenas& arenas_;
  Placement& placement_;
  PageBacking& pages_;
  ChunkSource& chunks_;
  MapCalls& calls_;
  Accounting& accounting_;
  const EngineLock& lock_;

  std::vector<std::uint32_t> queue_;  // the plan region's pages, in the order of first use
  std::size_t next_ = 0;              // queue_[next_...] not booked yet
  // A held round's: the ordinal of the block that first uses each page of the queue, and how
  // many of them the step has reached (booking_limit).
  std::vector<std::uint32_t> ordinals_;
  std::size_t reached_ = 0;
  bool waits_for_step_ = false;        // the thread waits for the step to reach more of the queue
  std::vector<std::uint32_t> booked_;  // pages booked this round (the reference may be a block's since)
  std::uint64_t round_ = 0;            // rounds ended: a batch of an earlier round gives back all
  // The round maps early (held: false): its candidate chunks, free as its step began, with the
  // page each was found through (whose next use the early page takes on).
  bool held_ = true;
  std::vector<std::pair<ChunkId, PageId>> candidates_;
  std::size_t next_candidate_ = 0;
  bool job_in_flight_ = false;
  bool early_in_flight_ = false;  // the batch in flight maps early
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace gmem::detail
