// Timestamps for the tracker's hot path: the CPU's time-stamp counter where there is one (a few
// ns, against ~20-30 ns for clock_gettime), turned into wall-clock time only when read.
#pragma once

#include <chrono>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#define GMEM_HAVE_TSC 1
#endif

namespace gmem::detail {

inline std::uint64_t ticks() noexcept {
#ifdef GMEM_HAVE_TSC
  return __rdtsc();
#else
  return static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}

// Converts ticks to wall-clock nanoseconds since the Unix epoch. Calibrated when made, against a
// reference taken the first time any converter (or tick_origin) was used; the longer between the
// two, the more exact (a make() right after the reference waits a few ms to measure the rate).
class TickClock {
 public:
  static TickClock make();
  std::int64_t wall_ns(std::uint64_t tick) const noexcept;

 private:
  std::uint64_t tick0_ = 0;
  std::int64_t wall0_ = 0;
  double ns_per_tick_ = 1.0;
};

// Takes the calibration reference now if not yet taken (trackers call it when created).
void tick_origin() noexcept;

}  // namespace gmem::detail
