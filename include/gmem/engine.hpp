// gmem's caching engine: a fragmentation-free allocator over a Device.
//
//   Physical memory is held in chunks of the device's granularity (2 MiB) that can be mapped at
//   any virtual address, so a large request is stitched from chunks freed anywhere instead of
//   failing for want of a contiguous range; a chunk is created only when no free one can be
//   mapped instead, so reserved memory follows the pages live blocks touch. Stitched chunks stay
//   mapped where they were too (aliases), so a training loop that repeats its layout makes no
//   device calls after its first steps. Small requests (<= 128 KiB) come from size-classed
//   slabs. Thread-safe. docs/design.md has the design and its numbers.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "gmem/device.hpp"
#include "gmem/error.hpp"
#include "gmem/stats.hpp"
#include "gmem/stats_group.hpp"

namespace gmem {

inline constexpr std::size_t kAlignment = 512;               // every block is aligned to this
// <= this: the small pool, as PyTorch counts it (its stats); slabs serve only up to 128 KiB.
inline constexpr std::size_t kSmallLimit = std::size_t{1} << 20;

struct EngineOptions {
  // Bytes gmem may hold; 0 = the device's total memory. More than the device, or less than a
  // page, is refused (Error(invalid_argument)), here and in set_memory_limit().
  std::size_t memory_limit = 0;
  std::size_t address_space = 0;  // virtual bytes reserved per arena; 0 = the device's total
  // Bytes per page and per physical chunk; 0 = the device's granularity (2 MiB on NVIDIA GPUs).
  // A power of two, a multiple of the granularity, at most 1 GiB; anything else is refused
  // (Error(invalid_argument)). The driver prices each map, set-access and unmap per chunk, not
  // per byte, so larger pages make every mapping cheaper and stitching coarser (docs/notes/2026-11-24-page-size-the-driver-prices-a-call-per-chunk-not-per-byte.md).
  std::size_t page_size = 0;
  // empty_cache() gives back every chunk no live block needs, every time. By default it does
  // so until calls after every step are seen to cost the program time (what one gives back, the
  // next step creates again), and from then on keeps what was used since the call before
  // (docs/notes/2026-11-24-empty-cache-after-every-step.md; MemoryStats::empty_cache_kept_bytes).
  bool strict_empty_cache = false;
  // Once mapped, a page keeps its chunk until empty_cache() or the limit gives it back, and no
  // chunk is mapped at two pages: no stitching, no remapping, no stealing across streams, and
  // no planned step layouts (mark_step() does nothing; plans alias); a page that needs memory
  // gets a new chunk. What a CUDA graph's private pool needs (gmem_pool_create sets it): a
  // replay runs every captured kernel against the mappings of the moment, so a page remapped or
  // aliased after a kernel was captured would move that kernel's memory under it, and with
  // nothing to unmap a malloc never waits for a stream, which a capture forbids. Costs the
  // memory that stitching would have reused at new addresses. Only pages under a block live
  // during a capture (set_capturing) keep their chunks for good: at a capture's first malloc,
  // free pages no capture used give their chunks back for the capture's new pages.
  // Such an engine also serves small blocks from ranges of their own, not slabs, so that
  // malloc_at can put any of them back.
  bool stable_pages = false;
  // Memory another stream freed and may still use (its kernels not known to be done) goes to a
  // stream that needs it, that stream made to wait for them on the GPU (cuStreamWaitEvent), as
  // cudaMallocAsync's pools do by default (cudaMemPoolReuseAllowInternalDependencies): no new
  // memory, no host wait, at the cost of an ordering between the two streams' work. So do the
  // blocks a stream freed that other streams still use (record_stream), once that stream needs
  // memory. Off, such memory moves only once its streams are known to be done, and a stream
  // that cannot wait for it gets new memory (or, under the limit, the host waits).
  // docs/notes/2026-11-25-memory-handed-between-streams.md.
  bool stream_handovers = true;
  // The step that first follows a new plan (mark_step) has its plan-region pages mapped by a
  // thread of the engine's while it runs, in the order it will use them, rather than by its own
  // mallocs: the driver's calls then overlap the program's work (a Llama step: 3,380 maps and
  // set-access calls, 110-180 ms of the step's thread). Off by default here, so that a program
  // on the simulated device (and `gmem replay`) runs the same on every run; the C API and
  // gmem.torch turn it on for a GPU (GMEM_MAP_AHEAD). docs/notes/2026-11-25-maps-made-ahead.md.
  bool map_ahead = false;
};

// A live allocation as the engine sees it (for checks, tracking and snapshots).
struct BlockInfo {
  void* ptr = nullptr;
  std::size_t size = 0;       // rounded size handed out
  std::size_t requested = 0;  // size asked for
  StreamId stream = 0;
  bool small = false;
};

class Engine final {
 public:
  explicit Engine(Device& device, EngineOptions options = {});
  ~Engine();  // releases every chunk and address range back to the device
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Throws Error(invalid_argument) for 0 or absurd sizes, OutOfMemoryError when it cannot serve.
  void* malloc(std::size_t size, StreamId stream = 0);
  // A block of `size` bytes at `ptr` exactly, on the stream whose arena holds `ptr`: what puts a
  // CUDA graph's pool back to a checkpoint (PyTorch's cudagraph trees re-allocate the blocks a
  // recorded graph left live, at their addresses, before recording the next). Only in an engine
  // with stable_pages, whose blocks are all ranges of their own; throws Error(invalid_argument)
  // where [ptr, ptr + size) is not free in one of its arenas, OutOfMemoryError as malloc does.
  void* malloc_at(void* ptr, std::size_t size);
  // Throws Error(double_free) for a block freed lately (the last 1024 frees), Error(invalid_pointer)
  // for anything else that is not a live block's start (interior, one past the end, foreign).
  void free(void* ptr);
  // `ptr` is also used on `stream`: when freed, it is reused only after `stream` has caught up.
  void record_stream(void* ptr, StreamId stream);


  // A training step ends here (after the optimizer's step, or before the forward; frees before
  // the next step's first range malloc still count as this step's). Once steps are marked, the
  // engine records each step's block requests and lifetimes and lays out the next occurrence of
  // the same step from that record (a plan), so that its blocks need
  // only as many pages as the plan's extent and a repeated step maps nothing. Without marks
  // nothing changes. docs/notes/2026-11-24-planned-step-layouts.md.
  void mark_step();

  // A CUDA graph is being captured on the device (true), or no capture is any longer (false).
  // Meanwhile the engine records, polls and waits for no event, as PyTorch's allocator: a query
  // would invalidate the capture, and an event recorded on a capturing stream is a node of the
  // graph, not the stream's progress. Blocks used on other streams (record_stream) and freed
  // meanwhile are reused only once the capture is over and those streams have caught up.
  // gmem.torch calls it for every engine of the device when a capture begins and ends.
  void set_capturing(bool capturing);

  // Gives every free chunk back to the device (waits for streams where needed). Once calls after
  // every step are seen to cost the program time (what one gives back, the next step creates
  // again), a call keeps what the last steps used and gives back the rest, unless
  // EngineOptions::strict_empty_cache; with no block live it gives back everything.
  void empty_cache();
  void set_memory_limit(std::size_t bytes);  // 0 = the device's total; see EngineOptions
  // Of the device's total, in (0, 1], rounded down to pages; a fraction below one page is refused.
  void set_memory_fraction(double fraction);
  std::size_t memory_limit() const;
  // The options this engine was made with, memory_limit as it is now: what a pool made beside
  // it copies (gmem_pool_create), so that one process's settings hold for all its engines.
  EngineOptions options() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  // From now on this engine's statistics also count in `group`, read as one with the other
  // engines there (a device's engine and its pools: gmem_device_stats), whose peaks are then the
  // peaks of their sum. It joins with what it holds; nullptr (or destroying the engine) leaves,
  // taking what it still holds out of the group. stats() stays this engine's own.
  void join_stats_group(std::shared_ptr<StatsGroup> group);
  // The counters (PyTorch's names and gmem's own), in O(1): what users poll. The fields derived
  // by walking the engine (largest_free_range, inactive_split*) read 0 here.
  MemoryStats stats() const;
  // stats() plus the derived fields: for summaries and OOM reports, not for polling.
  MemoryStats detailed_stats() const;

  // The live allocation at `ptr` (its start); throws Error(invalid_pointer) when there is none.
  BlockInfo block_info(const void* ptr) const;
  // Calls `visit` for every live allocation, under the engine's lock.
  void for_each_block(const std::function<void(const BlockInfo&)>& visit) const;
  // Verifies every internal invariant (no overlaps, mapping and stats consistent); throws
  // std::logic_error describing the first violation. Slow: for tests.
  void check_invariants() const;

  Device& device() const;

  // The engine's internals (src/engine/engine_impl.hpp), named so that gmem's own layers reach
  // them through src/engine/ (tracking: locked_engine.hpp) with no friend; incomplete elsewhere.
  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace gmem
