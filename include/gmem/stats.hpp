// Memory statistics under the names PyTorch users know (`allocated_bytes.all.current`, ...),
// plus gmem's own (maps, unmaps, chunks held, largest free range, where reserved memory went).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace gmem {

// One statistic: its value now, its peak since the last reset, and the running totals.
struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  // total increases
  std::int64_t freed = 0;      // total decreases

  void increase(std::int64_t amount) {
    current += amount;
    allocated += amount;
    if (current > peak) peak = current;
  }
  void decrease(std::int64_t amount) {
    current -= amount;
    freed += amount;
  }
  // `amount` moves between two parts of this total (bytes from one pool to the other): the total
  // stays, and its running totals count the move as the parts do, so that they remain their sum.
  void count_move(std::int64_t amount) {
    allocated += amount;
    freed += amount;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = freed = 0; }
};

enum StatPool : int { kAllPools = 0, kSmallPool = 1, kLargePool = 2 };
using PoolStats = std::array<Stat, 3>;  // indexed by StatPool

struct MemoryStats {
  // Bytes. allocated: handed out and live (rounded to 512 B); requested: as asked for;
  // active: allocated plus freed blocks still waiting on other streams (record_stream);
  // reserved: physical memory held from the device (small pool: slabs of size-classed blocks);
  // inactive_split: free bytes sharing a page or slab with live blocks.
  PoolStats allocated_bytes, requested_bytes, active_bytes, reserved_bytes, inactive_split_bytes;
  // Counts of the same things. segment: physical chunks held (large pool) plus the small pool's
  // slabs and ranges carved from them (small pool); .all is their sum.
  // In every pooled statistic, .all's current, allocated and freed are the sums of the two pools'
  // (reserved bytes moved between pools count as freed by one and allocated by the other, in .all
  // too); peaks are each row's own, reached at different times, and need not add up.
  PoolStats allocation, active, segment, inactive_split;

  std::int64_t num_alloc_retries = 0;  // mallocs that had to reclaim memory before succeeding
  std::int64_t num_ooms = 0;           // mallocs that failed
  std::int64_t num_device_alloc = 0;   // chunks created (cuMemCreate)
  std::int64_t num_device_free = 0;    // chunks released (cuMemRelease)
  std::int64_t num_sync_all_streams = 0;  // times gmem had to wait for streams to reclaim memory

  // gmem's own.
  std::int64_t num_maps = 0;            // cuMemMap calls
  // Of those, made by the engine's map-ahead thread while a step ran (EngineOptions::map_ahead),
  // and the microseconds mallocs waited for its batches (the step caught up with it).
  std::int64_t num_maps_ahead = 0;
  std::int64_t map_ahead_wait_us = 0;
  std::int64_t num_unmaps = 0;          // cuMemUnmap calls
  std::int64_t num_stitches = 0;        // mallocs that remapped chunks freed elsewhere
  // Memory another stream freed and may still use, handed to a stream made to wait for it on
  // the GPU (cuStreamWaitEvent) rather than on the host or with new memory: the waits made.
  std::int64_t num_stream_handovers = 0;
  std::int64_t num_empty_cache = 0;     // empty_cache() calls
  // Bytes the last empty_cache() kept beyond the pages in use then, because calls after every
  // step were giving back what the next step created again (EngineOptions::strict_empty_cache).
  std::int64_t empty_cache_kept_bytes = 0;
  std::int64_t chunks_held = 0;         // physical chunks created and not released
  std::int64_t chunks_mapped = 0;       // chunks mapped at one page or more
  std::int64_t mapped_pages = 0;        // pages mapped (a chunk may be mapped at several)
  std::int64_t granularity = 0;         // bytes per chunk
  std::int64_t memory_limit = 0;
  // Planned step layouts (Engine::mark_step; docs/design.md): steps marked, plans made, steps
  // that began on a plan, mallocs placed at their planned offset, steps that left their plan
  // (a request of another size), planned offsets found taken, the largest plan's extent; plans
  // made in the background, and the microseconds mallocs spent making plans or waiting for one.
  std::int64_t steps_marked = 0;
  std::int64_t plans = 0;
  std::int64_t plan_steps_followed = 0;
  std::int64_t plan_hits = 0;
  std::int64_t plan_mismatches = 0;
  std::int64_t plan_conflicts = 0;
  std::int64_t plan_extent_bytes = 0;
  std::int64_t plans_ahead = 0;
  std::int64_t plan_wait_us = 0;
  // What the device's memory calls cost the host (Device::call_times): microseconds in cuMemCreate,
  // cuMemMap, cuMemSetAccess, cuMemUnmap and cuMemRelease, and blocked waiting for a stream to
  // catch up before a page it may still use is unmapped or reused. Measured on a GPU, modelled
  // on the simulated device. A steady state adds nothing to either.
  std::int64_t device_call_us = 0;
  std::int64_t stream_wait_us = 0;
  // Derived (Engine::detailed_stats() only): the largest free virtual range backed by memory
  // that is ready to use.
  std::int64_t largest_free_range = 0;
  // The device as the driver sees it (cuMemGetInfo), and what of it others hold: the CUDA
  // context, NCCL's buffers, other processes (total - free - gmem's reserved; 0 when unknown).
  std::int64_t device_total_bytes = 0;
  std::int64_t device_free_bytes = 0;
  std::int64_t outside_bytes = 0;
  // Reserved but not allocated, by cause (they add up to reserved - allocated):
  std::int64_t free_mapped_bytes = 0;   // whole pages mapped and free (cached mappings)
  std::int64_t free_unmapped_bytes = 0; // chunks held but not mapped
  std::int64_t partial_page_bytes = 0;  // free bytes in pages shared with live large blocks
  std::int64_t small_slack_bytes = 0;   // free slots and rounding inside small-class slabs
  std::int64_t pending_free_bytes = 0;  // freed blocks held until other streams catch up
                                        // (record_stream): active, no longer allocated

  // Another engine's figures on the same device added into these (a device's engine and its
  // private pools, read as one): counts, bytes and times summed, peaks too, which gives an upper
  // bound of the sum's peak (StatsGroup keeps the sum's own). What describes the device rather
  // than an engine stays as it is: the device's total and free memory, the driver's time (one
  // Device serves them all), the page size and the limit; outside_bytes follows the new total.
  void add_engine(const MemoryStats& other);

  // Flat list in PyTorch's naming: "allocated_bytes.all.current" etc.
  std::vector<std::pair<std::string, std::int64_t>> flatten() const;
  // One value of flatten() by name, without building the list (what gmem_stat polls).
  std::optional<std::int64_t> find(std::string_view name) const;
  // Whether `name` is one of the fields only Engine::detailed_stats() fills in.
  static bool is_derived(std::string_view name);
};

}  // namespace gmem
