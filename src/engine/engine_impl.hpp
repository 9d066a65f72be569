// Engine internals shared by engine.cpp (hot paths), backing.cpp (physical memory: mapping,
// stitching, reclaiming under pressure) and engine_checks.cpp (stats recount, invariants).
#pragma once

#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common/pointer_map.hpp"
#include "engine/page_table.hpp"
#include "engine/range_allocator.hpp"
#include "engine/slab_allocator.hpp"
#include "engine/stream_tracker.hpp"
#include "gmem/engine.hpp"
#include "tracking/tracking_log.hpp"

namespace gmem {

namespace detail {

// A live allocation.
struct Record {
  std::size_t size = 0;       // rounded to 512 B
  std::size_t requested = 0;
  StreamId stream = 0;
  std::uint32_t arena = 0;
  std::uint32_t id = 0;       // SlabId when in_slab, else the RangeAllocator node
  bool small = false;         // the small pool (<= 1 MiB), as PyTorch counts it
  bool in_slab = false;
  bool shared = false;        // record_stream() added streams
  AllocTag tag;               // set while a tracker is attached
};

// One virtual address reservation, used by one stream.
struct Arena {
  Arena(DevicePtr base, std::size_t size, std::uint32_t stream_index)
      : ranges(base, size), stream(stream_index) {}
  RangeAllocator ranges;
  std::uint32_t stream;
};

// A freed allocation waiting for the other streams it was used on (record_stream).
struct PendingFree {
  DevicePtr ptr;
  Record record;
  std::vector<EventHandle> events;
};

}  // namespace detail

class Engine::Impl {
 public:
  Impl(Device& device, EngineOptions options);
  ~Impl();

  void* malloc(std::size_t size, StreamId stream);
  void free(void* ptr);
  void record_stream(void* ptr, StreamId stream);
  void empty_cache();
  void set_memory_limit(std::size_t bytes);
  void reset_peak_stats();
  void reset_accumulated_stats();
  MemoryStats stats() const;
  void check_invariants() const;

  Device& device_;
  EngineOptions options_;
  std::size_t granularity_;
  int page_shift_;
  std::size_t device_total_;
  std::size_t limit_;
  std::size_t arena_size_;
  detail::TrackingLog* log_ = nullptr;  // the attached tracker's, if any
  mutable std::mutex mutex_;

  detail::StreamTracker streams_;
  std::vector<std::vector<std::uint32_t>> stream_arenas_;  // by stream index
  std::vector<std::pair<StreamId, std::uint32_t>> stream_index_;
  StreamId last_stream_ = 0;
  std::uint32_t last_stream_index_ = 0;
  std::vector<std::unique_ptr<detail::Arena>> arenas_;
  detail::PageTable pages_;
  detail::SlabAllocator slabs_;
  detail::PointerMap<detail::Record> live_;
  std::vector<ChunkHandle> spare_chunks_;  // held, not mapped
  std::size_t chunks_held_ = 0;
  std::size_t range_bytes_ = 0;        // ranges of blocks (live or pending), slabs not included
  std::size_t small_range_bytes_ = 0;  // the part of range_bytes_ in the small pool
  std::unordered_map<DevicePtr, std::vector<StreamId>> shared_streams_;
  std::vector<detail::PendingFree> pending_;
  MemoryStats stats_;
  // Growth budget (options_.cache_slack): reserved grows freely to the allocated high-water
  // mark, including the request being served, plus the slack; beyond it cached pages are
  // reused (stitched) before new chunks are created.
  static constexpr std::size_t kTopDownBytes = std::size_t{16} << 20;  // see take_range
  static constexpr double kMaxSlack = 0.5;
  double slack_;                     // starts at options_.cache_slack; see note_stitch()
  std::size_t stitched_bytes_ = 0;   // stitched within the budget since slack_ last rose
  std::size_t high_water_ = 0;  // most bytes ever allocated (not reset by reset_peak_stats)
  std::size_t allocating_ = 0;  // allocated bytes plus the request being served
  mutable PoolStats split_bytes_{}, split_counts_{};  // inactive split, as seen by stats()

  // engine.cpp
  // The stream's index; the last one used is answered inline (one stream per thread is usual).
  std::uint32_t stream_index(StreamId stream) {
    if (stream == last_stream_ && !stream_index_.empty()) return last_stream_index_;
    return lookup_stream(stream);
  }
  std::uint32_t lookup_stream(StreamId stream);  // registers a new stream
  // Take the memory for a block and fill in its record (all but the tag).
  DevicePtr malloc_slab(std::size_t size, std::size_t rounded, std::uint32_t si,
                        detail::Record& record);
  DevicePtr malloc_range(std::size_t size, std::size_t rounded, std::uint32_t si,
                         detail::Record& record);
  void count_malloc(const detail::Record& record);
  void move_reserved_to_small(std::int64_t bytes);  // negative: back to the large pool
  void release_record(DevicePtr ptr, const detail::Record& record);
  void free_shared(DevicePtr ptr, const detail::Record& record);
  void process_pending(bool wait);
  [[noreturn]] void throw_bad_free(DevicePtr ptr) const;

  // backing.cpp
  // A used range of `bytes` in one of stream `si`'s arenas, backed by mapped pages; throws
  // OutOfMemoryError (for `requested` bytes) or DeviceError with nothing changed.
  std::pair<std::uint32_t, detail::NodeId> take_range(std::uint32_t si, std::size_t bytes,
                                                      std::size_t requested);
  void release_range(std::uint32_t arena, detail::NodeId node);
  struct Placement {
    std::uint32_t arena;
    detail::NodeId node;
    std::size_t offset;  // into the free range
  };
  Placement best_fit(std::uint32_t si, std::size_t bytes) const;
  Placement cheapest_fit(std::uint32_t si, std::size_t bytes) const;
  std::size_t unmapped_pages(std::uint32_t arena, DevicePtr addr, std::size_t bytes) const;
  std::uint32_t add_arena(std::uint32_t si, std::size_t min_bytes);
  bool back_pages(std::uint32_t arena, DevicePtr addr, std::size_t bytes);
  void unref_pages(std::uint32_t arena, DevicePtr addr, std::size_t bytes, std::uint64_t stamp);
  ChunkHandle acquire_chunk(int& stage);
  ChunkHandle create_chunk();  // 0 when the limit or the device says no
  std::size_t growth_budget() const;
  void note_stitch();
  ChunkHandle steal_cached_page(bool wait);
  void unmap_page(detail::PageId id);
  void release_spare_slabs();
  void trim_to(std::size_t bytes, bool wait);
  void release_chunk(ChunkHandle chunk);
  [[noreturn]] void throw_oom(std::size_t requested, StreamId stream);
  std::string oom_reason_ = "limit";  // why the last growth failed: "limit" or "device"
  std::size_t largest_free_range() const;
  // What is mapped now, as [begin, end) ranges by address (adjacent pages merged).
  std::vector<std::pair<DevicePtr, DevicePtr>> mapped_ranges() const;

  // Calls visit(ranges, pages, node) for each free range of each arena, in address order.
  template <class F>
  void for_each_free_range(F&& visit) const {
    for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
      const detail::RangeAllocator& ranges = arenas_[a]->ranges;
      const std::vector<detail::Page>& pages = pages_.arena(a);
      for (detail::NodeId id = ranges.first(); id != detail::kNoNode; id = ranges.node(id).next) {
        const detail::RangeNode& n = ranges.node(id);
        if (n.free) visit(ranges, pages, n);
      }
    }
  }
};

}  // namespace gmem
