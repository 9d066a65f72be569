// Engine::Impl: the engine's one lock and the pieces it composes, each with one job. It is
// shared by engine.cpp (the fast paths and the public face) and engine_checks.cpp (stats and the
// invariant check); docs/design.md describes the design and the data structures together.
//
//   Backing          (backing.hpp)     arenas, placement, pages, chunks, mapping: every device
//                                      call and every placement decision (its parts: backing.hpp)
//   SlabAllocator    (slab_allocator)  blocks up to 128 KiB, in slabs carved from Backing's ranges
//   live_            (PointerMap)      each live block's Record, read and tagged by tracking too
//   CrossStreamFrees (blocks.hpp)      record_stream: frees that wait for other streams
//   RecentFrees      (blocks.hpp)      the last frees, to tell a double free
//   Accounting       (accounting.hpp)  MemoryStats and the byte totals behind it
//   Streams          (streams.hpp)     each stream's index, arenas, and progress
//
// Everything below mutex_ is guarded by it; tracking takes it only through a LockedEngine
// (locked_engine.hpp), which attaches, and reads and tags live_'s records. One lock per malloc
// is what makes tracking cheap; the only other one, MapCalls' calls_order(), orders device calls
// made without it (a malloc's maps against another's clash unmap).
#pragma once

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "common/pointer_map.hpp"
#include "engine/accounting.hpp"
#include "engine/backing.hpp"
#include "engine/blocks.hpp"
#include "engine/empty_cache_rule.hpp"
#include "engine/engine_lock.hpp"
#include "engine/observer.hpp"
#include "engine/slab_allocator.hpp"
#include "engine/streams.hpp"
#include "gmem/engine.hpp"

namespace gmem {

class Engine::Impl final : private detail::BackingClient {
 public:
  Impl(Device& device, EngineOptions options);
  ~Impl() { backing_.stop_map_ahead(); }  // its thread takes the lock: before anything goes
  // The Impl behind a public Engine, for gmem's own layers that work on the engine's internals
  // (LockedEngine): a nested class may read Engine's private members, so no friend is needed.
  static Impl& of(Engine& engine) noexcept { return *engine.impl_; }

  void* malloc(std::size_t size, StreamId stream);
  void* malloc_at(void* ptr, std::size_t size);
  void free(void* ptr);
  void record_stream(void* ptr, StreamId stream);
  void empty_cache();
  void mark_step();
  void set_capturing(bool capturing);
  void set_memory_limit(std::size_t bytes);
  void reset_peak_stats();
  void reset_accumulated_stats();
  MemoryStats stats(bool derived) const;
  void check_invariants() const;

  void attach(detail::EngineObserver* observer);  // nullptr detaches; under the lock
  // What is mapped now, as [begin, end) ranges by address (adjacent pages merged); under the lock.
  std::vector<std::pair<DevicePtr, DevicePtr>> mapped_ranges() const {
    return backing_.arenas().mapped_ranges();
  }

  // Empty slabs kept (SlabAllocator): a class's first may be kept while all of them hold up to
  // 1/kFirstSpareShare of the most memory ever used at once (0.4%), or kSpareFloor bytes in a
  // small program; further ones up to 1/kKeptSlabShare (0.1%).
  static constexpr std::size_t kFirstSpareShare = 256;
  static constexpr std::size_t kKeptSlabShare = 1024;
  static constexpr std::size_t kSpareFloor = 4 * detail::kSlabTarget;
  detail::SlabAllocator::KeepBudget spare_budget() const {
    const std::size_t peak = backing_.pages().peak_used() * backing_.granularity();
    return {std::max(peak / kFirstSpareShare, kSpareFloor), peak / kKeptSlabShare};
  }

  Device& device_;
  const EngineOptions options_;  // as made; Backing holds the memory limit as it is now
  detail::CaptureHook capture_;  // read before the lock
  mutable std::mutex mutex_;     // guards everything below
  // Signalled when a malloc's slow path ends (Mapper::map_missing releases the lock while it
  // creates chunks, unmaps or waits): mallocs that need its pages, and check_invariants, wait.
  mutable std::condition_variable landed_;
  const detail::EngineLock lock_{mutex_, landed_};  // how the parts below take and release mutex_
  detail::EngineObserver* observer_ = nullptr;  // tracking, when attached
  detail::Accounting accounting_;
  detail::Streams streams_;
  detail::Backing backing_;
  detail::SlabAllocator slabs_;
  detail::PointerMap<detail::Record> live_;
  detail::CrossStreamFrees cross_stream_;  // destroyed before backing_: its events go first
  detail::RecentFrees recent_frees_;
  detail::EmptyCacheRule empty_cache_rule_;
  // A stable engine (a pool) between set_capturing(true) and its first malloc on a capturing
  // stream (capture_begins_if).
  bool watch_for_capture_ = false;
  std::uint32_t range_births_ = 0;  // range blocks made so far (wraps): Record::birth

 private:
  // The fast paths (engine.cpp): take the memory for a block and fill in its record (all but
  // the tag), give it back.
  DevicePtr malloc_slab(std::size_t size, std::size_t rounded, std::uint32_t si,
                        detail::Record& record);
  DevicePtr malloc_range(std::size_t size, std::size_t rounded, std::uint32_t si,
                         detail::Record& record);
  // A block's own range, taken: where it is in the record, and counted.
  DevicePtr note_range(const detail::Backing::Taken& range, detail::Record& record);
  // A block taken (malloc, malloc_at): observed, listed live, counted.
  void* hand_out(DevicePtr ptr, detail::Record& record, std::uint32_t context);
  // The freed block's memory goes back: a range's pages as freed on its stream at `freed_at`
  // (Backing::free_stamp, taken when the program freed it).
  void release_record(DevicePtr ptr, const detail::Record& record, std::uint64_t freed_at);
  // The stamp a block's free gets on its stream (Backing::free_stamp; `held`: other streams hold
  // it back, Backing::held_free_stamp). A slab's block gets none: its pages go back with the slab,
  // stamped then (release_slab).
  std::uint64_t free_stamp(const detail::Record& record, bool held) {
    if (record.in_slab) return 0;
    return held ? backing_.held_free_stamp(record.arena) : backing_.free_stamp(record.arena);
  }
  void release_slab(detail::SlabId id);  // gives an empty slab's range back to its arena
  void process_pending(bool wait);
  void capture_begins_if(StreamId stream);  // a pool's first malloc in a capture (set_capturing)
  void release_spare_slabs();
  [[noreturn]] void throw_bad_free(const char* call, DevicePtr ptr) const;

  // BackingClient
  void arena_added() override { slabs_.add_arena(); }
  void reclaim() override;
  std::size_t hand_over_held(StreamId stream) override;
};

}  // namespace gmem
