// StatsGroup: engines whose statistics are read as one device's (a device's engine and the
// private pools made beside it), with peaks of their sum.
//
// Each engine keeps its own MemoryStats under its own lock, and the engines peak at different
// times, so adding their peaks gives only an upper bound of the peak of the sum: a CUDA graph's
// pool that held 2 GiB during the capture and the device engine that held 3 GiB later read as a
// 5 GiB peak though 3.x was ever allocated at once. Engines in a group also add every change of
// their pooled statistics (allocated, requested, active and reserved bytes; allocation, active
// and segment counts) to the group's counters, with atomic operations, so the group's current
// values are the sum at every moment and its peaks are the peaks of that sum. An engine in no
// group pays one predictable branch per change; one in a group a few atomic operations.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "gmem/stats.hpp"

namespace gmem {

class StatsGroup {
 public:
  // The pooled statistics a group sums (kSummed, in this order); the others (inactive_split*,
  // derived by walking an engine) are left to the reader.
  enum Field : std::size_t {
    kAllocatedBytes, kRequestedBytes, kActiveBytes, kReservedBytes, kAllocation, kActive, kSegment,
    kFields
  };
  static constexpr std::array<PoolStats MemoryStats::*, kFields> kSummed = {
      &MemoryStats::allocated_bytes, &MemoryStats::requested_bytes, &MemoryStats::active_bytes,
      &MemoryStats::reserved_bytes,  &MemoryStats::allocation,      &MemoryStats::active,
      &MemoryStats::segment};

  // One member's statistic changed as Stat::increase (delta > 0), Stat::decrease (delta < 0) or
  // Stat::count_move (a move of `moved` bytes between pools, current unchanged) did.
  void add(Field field, int pool, std::int64_t delta) {
    Counter& c = counters_[field][static_cast<std::size_t>(pool)];
    if (delta > 0) {
      c.allocated.fetch_add(delta, std::memory_order_relaxed);
      raise_peak(c, c.current.fetch_add(delta, std::memory_order_relaxed) + delta);
    } else {
      c.freed.fetch_add(-delta, std::memory_order_relaxed);
      c.current.fetch_add(delta, std::memory_order_relaxed);
    }
  }
  void count_move(Field field, int pool, std::int64_t moved) {
    Counter& c = counters_[field][static_cast<std::size_t>(pool)];
    c.allocated.fetch_add(moved, std::memory_order_relaxed);
    c.freed.fetch_add(moved, std::memory_order_relaxed);
  }

  // An engine joins with what it holds and has counted so far (its own peak is a lower bound of
  // the sum's: the others held nothing less than zero meanwhile; it is the sum's for the first
  // member). It leaves with what it still holds (a pool destroyed: its chunks go back); what it
  // counted stays in the running totals, as a freed pool's blocks stay in PyTorch's.
  void join(const MemoryStats& member) {
    for_each(member, [this](Counter& c, const Stat& s) {
      c.allocated.fetch_add(s.allocated, std::memory_order_relaxed);
      c.freed.fetch_add(s.freed, std::memory_order_relaxed);
      raise_peak(c, c.current.fetch_add(s.current, std::memory_order_relaxed) + s.current);
      raise_peak(c, s.peak);
    });
  }
  void leave(const MemoryStats& member) {
    for_each(member, [](Counter& c, const Stat& s) {
      c.freed.fetch_add(s.current, std::memory_order_relaxed);
      c.current.fetch_sub(s.current, std::memory_order_relaxed);
    });
  }

  // Writes the group's figures over `out`'s summed statistics (those kSummed names).
  void read(MemoryStats& out) const {
    for (std::size_t f = 0; f < kFields; ++f) {
      for (std::size_t p = 0; p < 3; ++p) {
        const Counter& c = counters_[f][p];
        Stat& s = (out.*kSummed[f])[p];
        s.current = c.current.load(std::memory_order_relaxed);
        s.peak = c.peak.load(std::memory_order_relaxed);
        s.allocated = c.allocated.load(std::memory_order_relaxed);
        s.freed = c.freed.load(std::memory_order_relaxed);
      }
    }
  }
  // As Stat's: a peak starts again from the value now; the running totals from zero.
  void reset_peaks() {
    for (auto& pools : counters_)
      for (Counter& c : pools) c.peak.store(c.current.load(std::memory_order_relaxed));
  }
  void reset_accumulated() {
    for (auto& pools : counters_)
      for (Counter& c : pools) {
        c.allocated.store(0, std::memory_order_relaxed);
        c.freed.store(0, std::memory_order_relaxed);
      }
  }

 private:
  struct Counter {
    std::atomic<std::int64_t> current{0}, peak{0}, allocated{0}, freed{0};
  };
  static void raise_peak(Counter& c, std::int64_t value) {
    std::int64_t peak = c.peak.load(std::memory_order_relaxed);
    while (value > peak && !c.peak.compare_exchange_weak(peak, value, std::memory_order_relaxed)) {
    }
  }
  template <class Visit>
  void for_each(const MemoryStats& member, Visit&& visit) {
    for (std::size_t f = 0; f < kFields; ++f)
      for (std::size_t p = 0; p < 3; ++p) visit(counters_[f][p], (member.*kSummed[f])[p]);
  }

  std::array<std::array<Counter, 3>, kFields> counters_;
};

}  // namespace gmem
