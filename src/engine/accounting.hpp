// The engine's counters: MemoryStats (PyTorch's per-pool figures, gmem's device-call counts) and
// the byte totals that stats() derives partial pages and slab slack from. Kept in one place so
// that each rule of how a malloc, a free, a slab or a chunk moves the pools is written once; the
// engine decides, this only counts. Inline: malloc and free count on their fast path.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "engine/blocks.hpp"
#include "gmem/stats.hpp"

namespace gmem::detail {

class Accounting {
 public:
  MemoryStats stats;                  // what Engine::stats() starts from
  std::size_t range_bytes = 0;        // ranges of blocks (live or pending), slabs not included
  std::size_t small_range_bytes = 0;  // the part of range_bytes in the small pool
  mutable PoolStats split_bytes{}, split_counts{};  // inactive split, as detailed_stats() saw it

  // A block handed out.
  void count_malloc(const Record& record) {
    const auto r = static_cast<std::int64_t>(record.size);
    const auto q = static_cast<std::int64_t>(record.requested);
    const int own = record.small ? kSmallPool : kLargePool;
    for (int pool : {static_cast<int>(kAllPools), own}) {
      stats.allocated_bytes[pool].increase(r);
      stats.active_bytes[pool].increase(r);
      stats.requested_bytes[pool].increase(q);
      stats.allocation[pool].increase(1);
      stats.active[pool].increase(1);
    }
  }
  // A block freed by the program (its memory may stay active, waiting for other streams).
  void count_free(const Record& record) {
    const auto r = static_cast<std::int64_t>(record.size);
    const auto q = static_cast<std::int64_t>(record.requested);
    const int pool = record.small ? kSmallPool : kLargePool;
    for (int i : {static_cast<int>(kAllPools), pool}) {
      stats.allocated_bytes[i].decrease(r);
      stats.requested_bytes[i].decrease(q);
      stats.allocation[i].decrease(1);
    }
  }
  // A block of its own range (not a slab's slot) was placed.
  void count_range_taken(std::size_t bytes, bool small) {
    range_bytes += bytes;
    if (small) {
      small_range_bytes += bytes;
      move_reserved_to_small(static_cast<std::int64_t>(bytes));
    }
  }
  // A freed block's memory is reused from now on: no longer active; a range's bytes go back.
  void count_release(const Record& record) {
    const int pool = record.small ? kSmallPool : kLargePool;
    for (int i : {static_cast<int>(kAllPools), pool}) {
      stats.active_bytes[i].decrease(static_cast<std::int64_t>(record.size));
      stats.active[i].decrease(1);
    }
    if (!record.in_slab) {
      range_bytes -= record.size;
      if (record.small) {
        small_range_bytes -= record.size;
        move_reserved_to_small(-static_cast<std::int64_t>(record.size));
      }
    }
  }
  // Reserved memory is chunks; the small pool's share is what its slabs and ranges cover. All
  // pools' total does not change, but counts the move as the pools do (stats.hpp: .all's
  // running totals are the pools' sums). Negative: back to the large pool.
  void move_reserved_to_small(std::int64_t bytes) {
    stats.reserved_bytes[kAllPools].count_move(bytes > 0 ? bytes : -bytes);
    if (bytes > 0) {
      stats.reserved_bytes[kSmallPool].increase(bytes);
      stats.reserved_bytes[kLargePool].decrease(bytes);
      stats.segment[kSmallPool].increase(1);
      stats.segment[kAllPools].increase(1);
    } else {
      stats.reserved_bytes[kSmallPool].decrease(-bytes);
      stats.reserved_bytes[kLargePool].increase(-bytes);
      stats.segment[kSmallPool].decrease(1);
      stats.segment[kAllPools].decrease(1);
    }
  }
  // A chunk created (held from the device) or released: reserved memory, in the large pool.
  void count_chunk_created(std::size_t bytes) {
    ++stats.num_device_alloc;
    for (int pool : {kAllPools, kLargePool}) {
      stats.reserved_bytes[pool].increase(static_cast<std::int64_t>(bytes));
      stats.segment[pool].increase(1);
    }
  }
  void count_chunk_released(std::size_t bytes) {
    ++stats.num_device_free;
    for (int pool : {kAllPools, kLargePool}) {
      stats.reserved_bytes[pool].decrease(static_cast<std::int64_t>(bytes));
      stats.segment[pool].decrease(1);
    }
  }

  void reset_peaks() {
    for (PoolStats* s : pool_stats())
      for (Stat& stat : *s) stat.reset_peak();
  }
  void reset_accumulated() {
    for (PoolStats* s : pool_stats())
      for (Stat& stat : *s) stat.reset_accumulated();
    stats.num_alloc_retries = stats.num_ooms = stats.num_device_alloc = 0;
    stats.num_device_free = stats.num_sync_all_streams = 0;
    stats.num_maps = stats.num_unmaps = stats.num_stitches = stats.num_empty_cache = 0;
  }

 private:
  std::array<PoolStats*, 9> pool_stats() {
    return {&stats.allocated_bytes, &stats.requested_bytes, &stats.active_bytes,
            &stats.reserved_bytes,  &stats.inactive_split_bytes, &stats.allocation,
            &stats.active,          &stats.segment,         &stats.inactive_split};
  }
};

}  // namespace gmem::detail
