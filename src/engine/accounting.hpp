// The engine's counters: MemoryStats (PyTorch's per-pool figures, gmem's device-call counts) and
// the byte totals that stats() derives partial pages and slab slack from. Kept in one place so
// that each rule of how a malloc, a free, a slab or a chunk moves the pools is written once; the
// engine decides, this only counts. Inline: malloc and free count on their fast path.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "engine/blocks.hpp"
#include "gmem/stats.hpp"
#include "gmem/stats_group.hpp"

namespace gmem::detail {

class Accounting {
 public:
  MemoryStats stats;                  // what Engine::stats() starts from
  std::size_t range_bytes = 0;        // ranges of blocks (live or pending), slabs not included
  std::size_t small_range_bytes = 0;  // the part of range_bytes in the small pool
  mutable PoolStats split_bytes{}, split_counts{};  // inactive split, as detailed_stats() saw it

  // A block handed out.
  void count_malloc(const Record& record) {
    malloc_rule(Own{stats}, record);
    if (group_) [[unlikely]]
      mirror([&](Grouped to) { malloc_rule(to, record); });
  }
  // A block freed by the program (its memory may stay active, waiting for other streams).
  void count_free(const Record& record) {
    free_rule(Own{stats}, record);
    if (group_) [[unlikely]]
      mirror([&](Grouped to) { free_rule(to, record); });
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
    release_rule(Own{stats}, record);
    if (group_) [[unlikely]]
      mirror([&](Grouped to) { release_rule(to, record); });
    if (!record.in_slab) {
      range_bytes -= record.size;
      if (record.small) {
        small_range_bytes -= record.size;
        move_reserved_to_small(-static_cast<std::int64_t>(record.size));
      }
    }
  }
  // Reserved memory is chunks; the small pool's share is what its slabs and ranges cover.
  // Negative: back to the large pool.
  void move_reserved_to_small(std::int64_t bytes) {
    move_rule(Own{stats}, bytes);
    if (group_) [[unlikely]]
      mirror([&](Grouped to) { move_rule(to, bytes); });
  }
  // A chunk created (held from the device) or released: reserved memory, in the large pool.
  void count_chunk_created(std::size_t bytes) {
    ++stats.num_device_alloc;
    chunk_rule(Own{stats}, static_cast<std::int64_t>(bytes));
    if (group_) [[unlikely]]
      mirror([&](Grouped to) { chunk_rule(to, static_cast<std::int64_t>(bytes)); });
  }
  void count_chunk_released(std::size_t bytes) {
    ++stats.num_device_free;
    chunk_rule(Own{stats}, -static_cast<std::int64_t>(bytes));
    if (group_) [[unlikely]]
      mirror([&](Grouped to) { chunk_rule(to, -static_cast<std::int64_t>(bytes)); });
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
    stats.num_stream_handovers = stats.num_maps_ahead = stats.map_ahead_wait_us = 0;
  }

  // From now on every change is added to `group` too (Engine::join_stats_group); nullptr: to
  // none, after leaving with what the engine still holds.
  void join(std::shared_ptr<StatsGroup> group) {
    if (group_) group_->leave(stats);
    group_ = std::move(group);
    if (group_) group_->join(stats);
  }

 private:
  using Field = StatsGroup::Field;

  // How each event moves the pooled statistics, written once and applied to this engine's own
  // figures (Own) and, in a group, to the group's (Grouped).
  template <class To>
  static void malloc_rule(To to, const Record& record) {
    const auto r = static_cast<std::int64_t>(record.size);
    const auto q = static_cast<std::int64_t>(record.requested);
    for (int pool : {static_cast<int>(kAllPools), static_cast<int>(record.small ? kSmallPool : kLargePool)}) {
      to.change(Field::kAllocatedBytes, pool, r);
      to.change(Field::kActiveBytes, pool, r);
      to.change(Field::kRequestedBytes, pool, q);
      to.change(Field::kAllocation, pool, 1);
      to.change(Field::kActive, pool, 1);
    }
  }
  template <class To>
  static void free_rule(To to, const Record& record) {
    const auto r = static_cast<std::int64_t>(record.size);
    const auto q = static_cast<std::int64_t>(record.requested);
    for (int pool : {static_cast<int>(kAllPools), static_cast<int>(record.small ? kSmallPool : kLargePool)}) {
      to.change(Field::kAllocatedBytes, pool, -r);
      to.change(Field::kRequestedBytes, pool, -q);
      to.change(Field::kAllocation, pool, -1);
    }
  }
  template <class To>
  static void release_rule(To to, const Record& record) {
    for (int pool : {static_cast<int>(kAllPools), static_cast<int>(record.small ? kSmallPool : kLargePool)}) {
      to.change(Field::kActiveBytes, pool, -static_cast<std::int64_t>(record.size));
      to.change(Field::kActive, pool, -1);
    }
  }
  // All pools' total does not change, but counts the move as the pools do (stats.hpp: .all's
  // running totals are the pools' sums).
  template <class To>
  static void move_rule(To to, std::int64_t bytes) {
    const std::int64_t sign = bytes > 0 ? 1 : -1;
    to.count_move(Field::kReservedBytes, kAllPools, bytes * sign);
    to.change(Field::kReservedBytes, kSmallPool, bytes);
    to.change(Field::kReservedBytes, kLargePool, -bytes);
    to.change(Field::kSegment, kSmallPool, sign);
    to.change(Field::kSegment, kAllPools, sign);
  }
  template <class To>
  static void chunk_rule(To to, std::int64_t bytes) {
    for (int pool : {kAllPools, kLargePool}) {
      to.change(Field::kReservedBytes, pool, bytes);
      to.change(Field::kSegment, pool, bytes > 0 ? 1 : -1);
    }
  }

  struct Own {
    MemoryStats& stats;
    void change(Field f, int pool, std::int64_t delta) const {
      Stat& s = (stats.*StatsGroup::kSummed[f])[static_cast<std::size_t>(pool)];
      if (delta > 0) s.increase(delta);
      else s.decrease(-delta);
    }
    void count_move(Field f, int pool, std::int64_t moved) const {
      (stats.*StatsGroup::kSummed[f])[static_cast<std::size_t>(pool)].count_move(moved);
    }
  };
  struct Grouped {
    StatsGroup& group;
    void change(Field f, int pool, std::int64_t delta) const { group.add(f, pool, delta); }
    void count_move(Field f, int pool, std::int64_t moved) const {
      group.count_move(f, pool, moved);
    }
  };
  // Out of line: engines in no group (every engine but a device's with pools) skip it.
  template <class Rule>
  [[gnu::noinline]] void mirror(const Rule& rule) {
    rule(Grouped{*group_});
  }

  std::shared_ptr<StatsGroup> group_;  // the engines read as one with this one, if any

  std::array<PoolStats*, 9> pool_stats() {
    return {&stats.allocated_bytes, &stats.requested_bytes, &stats.active_bytes,
            &stats.reserved_bytes,  &stats.inactive_split_bytes, &stats.allocation,
            &stats.active,          &stats.segment,         &stats.inactive_split};
  }
};

}  // namespace gmem::detail
