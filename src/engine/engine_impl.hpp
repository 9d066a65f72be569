// Engine internals, shared by engine.cpp (the hot paths and the public face), backing.cpp
// (placement, mapping, stitching, reclaiming under pressure) and engine_checks.cpp (stats and
// the invariant check). docs/engine.md describes the design and the data structures together.
//
//   virtual side   Arena: one virtual range per stream (more when one fills up), its ranges
//                  (RangeAllocator: blocks and slabs) and its pages (PageTable: refs, chunk)
//   physical side  ChunkPool: chunks held and the pages each is mapped at (aliases)
//   blocks         SlabAllocator (<= 128 KiB), live records, frees waiting on other streams
//   streams        Streams: each stream's index, arenas, and how far its work has progressed
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common/pointer_map.hpp"
#include "engine/chunk_pool.hpp"
#include "engine/freed_pages.hpp"
#include "engine/observer.hpp"
#include "engine/page_table.hpp"
#include "engine/range_allocator.hpp"
#include "engine/slab_allocator.hpp"
#include "engine/streams.hpp"
#include "gmem/engine.hpp"

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
  BlockTag tag;               // the observer's, while one is attached
};

// One virtual address reservation, used by one stream.
struct Arena {
  Arena(DevicePtr base, std::size_t size, std::size_t page_count, std::uint32_t stream_index)
      : ranges(base, size), pages(page_count), stream(stream_index) {}
  RangeAllocator ranges;
  PageTable pages;
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
  MemoryStats stats(bool derived) const;
  void check_invariants() const;

  // --- configuration ---------------------------------------------------------------------------
  Device& device_;
  EngineOptions options_;
  std::size_t granularity_;
  int page_shift_;
  std::size_t device_total_;
  std::size_t limit_;
  std::size_t arena_size_;
  // What the observer wants gathered before the lock (read without it, hence atomic).
  std::atomic<std::uint32_t (*)(int, int)> capture_{nullptr};
  std::atomic<int> capture_depth_{0};
  std::atomic<bool> capture_frees_{false};
  mutable std::mutex mutex_;                 // guards everything below
  detail::EngineObserver* observer_ = nullptr;  // tracking, when attached
  void attach(detail::EngineObserver* observer);  // nullptr detaches; under the lock
  std::uint32_t gather_context(bool for_free) const {
    const auto capture = capture_.load(std::memory_order_acquire);
    if (capture == nullptr || (for_free && !capture_frees_.load(std::memory_order_relaxed))) return 0;
    return capture(0, capture_depth_.load(std::memory_order_relaxed));
  }

  // --- streams ---------------------------------------------------------------------------------
  detail::Streams streams_;

  // --- virtual and physical memory -------------------------------------------------------------
  std::vector<std::unique_ptr<detail::Arena>> arenas_;
  detail::ChunkPool chunks_;
  detail::FreedPages freed_pages_;  // where stitching looks for free chunks
  std::size_t used_pages_ = 0;    // pages with refs > 0 (each pins one busy chunk)
  std::size_t peak_used_ = 0;     // most pages used at once
  static constexpr std::size_t kFirstClashShare = 200;  // see backing.cpp
  std::size_t clash_share_ = kFirstClashShare;
  std::size_t clashes_ = 0;
  std::uint32_t clock_ = 0;       // ranges taken so far (wraps): the pages' time of use
  std::size_t free_pages_ = 0;    // mapped pages with refs == 0

  // --- blocks ----------------------------------------------------------------------------------
  detail::SlabAllocator slabs_;
  detail::PointerMap<detail::Record> live_;
  std::unordered_map<DevicePtr, std::vector<StreamId>> shared_streams_;
  // The last frees, so that a second free of one of them reads as a double free and not as an
  // interior pointer (one store per free; read only when a free fails).
  std::array<DevicePtr, 1024> recently_freed_{};
  std::size_t freed_count_ = 0;
  std::vector<detail::PendingFree> pending_;

  // --- accounting ------------------------------------------------------------------------------
  MemoryStats stats_;
  std::size_t range_bytes_ = 0;        // ranges of blocks (live or pending), slabs not included
  std::size_t small_range_bytes_ = 0;  // the part of range_bytes_ in the small pool
  std::string oom_reason_ = "limit";   // why the last growth failed
  mutable PoolStats split_bytes_{}, split_counts_{};  // inactive split, as seen by stats()

  // engine.cpp ------------------------------------------------------------------------------------
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
  [[noreturn]] void throw_bad_free(const char* call, DevicePtr ptr) const;
  // A limit in bytes as given (0: the device's total), or Error(invalid_argument) for one above
  // the device or below a page: a limit never quietly becomes no limit.
  std::size_t checked_limit(std::size_t bytes, const char* what) const;

  // backing.cpp -----------------------------------------------------------------------------------
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
  Placement place(std::uint32_t si, std::size_t bytes);
  // Whether the free page's chunk may serve its arena now without a device call.
  bool page_ready(std::uint32_t arena, std::size_t index, const detail::Page& page) const;
  bool chunk_free_for(detail::ChunkId chunk, std::uint32_t stream, bool poll);
  bool chunk_busy(detail::ChunkId chunk) const;  // used through one of its pages
  std::uint32_t add_arena(std::uint32_t si, std::size_t min_bytes);
  std::pair<std::size_t, std::size_t> page_span(std::uint32_t arena, DevicePtr addr,
                                                std::size_t bytes) const;
  bool back_pages(std::uint32_t arena, DevicePtr addr, std::size_t bytes);
  void unref_pages(std::uint32_t arena, DevicePtr addr, std::size_t bytes, std::uint64_t stamp);
  detail::ChunkId acquire_chunk(std::uint32_t stream, int& stage, bool clashed_before);
  detail::ChunkId create_chunk();  // kNoChunk when the limit or the device says no
  detail::ChunkId steal_free_chunk(std::uint32_t stream, bool wait);
  detail::Page& page_at(detail::PageId id) {
    return arenas_[detail::arena_of(id)]->pages.at(detail::index_of(id));
  }
  void map_page(std::uint32_t arena, std::size_t index, detail::ChunkId chunk);
  void unmap_page(detail::PageId id);
  bool unmap_chunk(detail::ChunkId chunk, bool wait);  // every alias; false if still in use
  void release_spare_slabs();
  void trim_to(std::size_t bytes, bool wait);
  void release_chunk(detail::ChunkId chunk);
  [[noreturn]] void throw_oom(std::size_t requested, StreamId stream);
  std::size_t largest_free_range() const;
  // What is mapped now, as [begin, end) ranges by address (adjacent pages merged).
  std::vector<std::pair<DevicePtr, DevicePtr>> mapped_ranges() const;

  // Calls visit(arena, node) for each free range of each arena, in address order.
  template <class F>
  void for_each_free_range(F&& visit) const {
    for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
      const detail::RangeAllocator& ranges = arenas_[a]->ranges;
      for (detail::NodeId id = ranges.first(); id != detail::kNoNode; id = ranges.node(id).next) {
        const detail::RangeNode& n = ranges.node(id);
        if (n.free) visit(*arenas_[a], n);
      }
    }
  }
};

}  // namespace gmem
