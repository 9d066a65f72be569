// Backing: physical memory behind virtual ranges, and the policy that keeps it small. It
// coordinates the pieces below, each owning its own state (docs/design.md has the picture and
// the glossary):
//
//   Arenas       (arenas.hpp)        virtual reservations, one stream each, with their pages
//   Placement    (placement.hpp)     where a range goes: online, kept, or planned; no pages
//   PageBacking  (page_backing.hpp)  page references, chunks and their aliases, freed pages:
//                                    the fast path, no device calls
//   MapCalls     (map_job.hpp)       a MapJob's device calls, made without the engine's lock
//   ChunkSource  (chunk_source.hpp)  a chunk for a page: spares, creates, steals, handovers,
//                                    trimming and the OOM report; all out of line
//   MapAhead     (map_ahead.hpp)     a new plan's pages mapped by a thread of its own
//   Mapper       (mapper.hpp)        a range's slow path: remap, map, set access
//   RangeTaker   (range_taker.hpp)   a placed range backed by pages (fast path or Mapper), and back
//   PlannedTaker (planned_taker.hpp) marked steps' ranges: planned, covered, or online
//
// Dependencies run down this list and never up. The engine asks Backing for a used range backed
// by mapped pages and gives ranges back; it never handles a page or a chunk itself.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/accounting.hpp"
#include "engine/arenas.hpp"
#include "engine/backing_client.hpp"
#include "engine/chunk_source.hpp"
#include "engine/engine_lock.hpp"
#include "engine/map_ahead.hpp"
#include "engine/map_job.hpp"
#include "engine/mapper.hpp"
#include "engine/observer.hpp"
#include "engine/page_backing.hpp"
#include "engine/placement.hpp"
#include "engine/planned_taker.hpp"
#include "engine/range_taker.hpp"
#include "engine/streams.hpp"
#include "gmem/device.hpp"

namespace gmem::detail {

class Backing {
 public:
  struct Options {
    std::size_t page_size = 0;    // EngineOptions::page_size (0: the device's granularity)
    std::size_t alignment = 512;  // every block's (kAlignment): a page holds whole multiples of it
    bool stable_pages = false;    // EngineOptions::stable_pages (a page keeps its chunk, none aliased)
    bool handovers = true;        // EngineOptions::stream_handovers
    bool map_ahead = false;       // EngineOptions::map_ahead
  };
  // Throws Error(invalid_argument) for a device granularity that is not a power of two >= the
  // blocks' alignment, or a page size that is not a power-of-two multiple of it up to
  // kMaxPageSize. `observer` is the engine's (read when a page is mapped or unmapped, or on OOM).
  Backing(Device& device, Streams& streams, Accounting& accounting,
          EngineObserver* const& observer, BackingClient& client, const EngineLock& lock,
          Options options);
  static constexpr std::size_t kMaxPageSize = std::size_t{1} << 30;
  ~Backing();  // unmaps every page, gives back every address range and chunk
  Backing(const Backing&) = delete;
  Backing& operator=(const Backing&) = delete;

  std::size_t granularity() const { return arenas_.page_size(); }  // the page size: bytes per chunk
  // Bytes of chunks that the most pages used at once since begin_interval() need, with the clash
  // rule's allowance: what empty_cache() keeps once it keeps (EmptyCacheRule).
  std::size_t interval_need_bytes() const {
    const std::size_t peak = pages_.interval_peak_used();
    return (peak + chunks_.clash_rule().allowance(peak)) * granularity();
  }
  void begin_interval() { pages_.begin_interval(); }
  void set_arena_size(std::size_t address_space);  // 0: the device's total

  // --- the fast path (the steady state makes no device call) ------------------------------------
  using Taken = RangeTaker::Taken;
  // A used range of `bytes` in one of stream `si`'s arenas, backed by mapped pages; throws
  // OutOfMemoryError (for `requested` bytes) or DeviceError with nothing changed. `plannable`:
  // a block's own range (not a slab's), which a planned step layout may place (mark_step). Both
  // branches are common: gmem.torch marks steps by default, C programs rarely do.
  Taken take_range(std::uint32_t si, std::size_t bytes, std::size_t requested,
                   bool plannable = false) {
    if (plannable && placement_.planning()) return planned_.take(si, bytes, requested);
    return taker_.take_online(si, bytes, requested);
  }
  // A free on arena `arena`'s stream: its stamp (StreamTracker::stamp), which release_range and
  // keep_range take, so that a free held back for other streams can be stamped when it was made.
  std::uint64_t free_stamp(std::uint32_t arena) {
    return streams_.progress.stamp(arenas_[arena].stream);
  }
  // free_stamp for a block other streams hold back (record_stream): an event marks the free.
  std::uint64_t held_free_stamp(std::uint32_t arena) {
    return streams_.progress.stamp_marked(arenas_[arena].stream);
  }
  // The used range `node` goes back, freed on its stream at `freed_at` (free_stamp).
  void release_range(std::uint32_t arena, NodeId node, std::uint64_t freed_at) {
    taker_.release(arena, node, freed_at);
  }
  // release_range for a block whose place a CUDA graph may have captured (RangeTaker::keep).
  void keep_range(std::uint32_t arena, NodeId node, std::uint32_t birth, std::uint64_t freed_at) {
    taker_.keep(arena, node, birth, freed_at);
  }
  // The used range [addr, addr + bytes), as take_range's (RangeTaker::take_at). What
  // Engine::malloc_at puts a block back with.
  Taken take_at(DevicePtr addr, std::size_t bytes, std::size_t requested) {
    return taker_.take_at(addr, bytes, requested);
  }

  // --- planned step layouts (step_plan.hpp) -----------------------------------------------------
  // A malloc of stream `si` in a slab's slot, and a training step's end (PlannedTaker).
  void count_slot_malloc(std::uint32_t si) { planned_.count_slot_malloc(si); }
  void mark_step() { planned_.mark_step(); }
  const StepPlanner::Stats& plan_stats() const { return placement_.planner().stats(); }
  // Stops and joins the map-ahead thread (called without the engine's lock, before the engine
  // goes), and gives back what its round still holds.
  void stop_map_ahead() { ahead_.stop(); }

  // --- captures into a pool (stable pages) ------------------------------------------------------
  // A pool's pages keep their chunks because a CUDA graph's kernels were captured against them;
  // but only pages under a block live during a capture can be in a graph. The others (a warm-up's,
  // which cudagraph trees run eagerly in the pool) may give their chunks back for the capture's
  // new pages, which take spares before they create chunks. So, in a stable engine:
  // pin_used_pages() pins every page a live block or slab uses; release_unpinned_pages() unmaps
  // the free pages no capture pinned whose streams are known to be done (their chunks go spare;
  // no event call); after set_pinning(true), every range taken pins its pages.
  bool stable() const { return chunks_.stable_pages(); }
  void pin_used_pages() { pages_.pin_used_pages(); }
  void release_unpinned_pages() { chunks_.release_unpinned_pages(); }
  void set_pinning(bool pinning) { pages_.set_pinning(pinning); }

  // --- the parts, to read (and ChunkSource for the limit and trimming) ----------------------------
  const Arenas& arenas() const { return arenas_; }
  const PageBacking& pages() const { return pages_; }
  ChunkSource& chunk_source() { return chunks_; }
  const ChunkSource& chunk_source() const { return chunks_; }
  // Verifies pages, chunks and the freed-page list against the arenas' ranges; throws
  // std::logic_error (engine_checks.cpp). Returns the bytes of used ranges.
  std::int64_t check_invariants() const;

 private:
  Device& device_;
  Streams& streams_;
  Arenas arenas_;
  Placement placement_;
  PageBacking pages_;
  MapCalls calls_;
  ChunkSource chunks_;
  MapAhead ahead_;
  Mapper mapper_;
  RangeTaker taker_;
  PlannedTaker planned_;
};

}  // namespace gmem::detail
