// SimCallLedger: what the simulated device's calls cost the host, on a modelled clock. Every
// call is counted by kind and priced (kDeviceCallPrices); the Nth call of a kind can be made to
// fail; the host clock moves as a replay or a test tells it, and on to an event's completion
// when the host waits for one, the time waited counted apart from the calls' price.
//
// Thread-safe: one mutex, held by each member function and by nothing else, so it is a leaf
// (no other lock is taken while it is held).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "gmem/device.hpp"
#include "gmem/device_calls.hpp"

namespace gmem {

class SimCallLedger {
 public:
  // --- calls ---
  // Counts a call of `call` and prices it: `units` chunks or mappings (at least one: a call that
  // does nothing costs as one) of `granules` granules in all. Then throws a DeviceError named
  // after the call if this is the call fail_call chose; failed calls are counted and priced too.
  void count(DeviceCall call, std::size_t units = 1, std::size_t granules = 1);
  std::uint64_t calls(DeviceCall call) const;
  void reset_call_counts();  // and modelled_call_us(), which follows the counts
  // Make the nth call of `call` from now on (1 = the next one) throw a DeviceError; 0 cancels a
  // pending one. When `out_of_memory` is set the error reads as the device running out of memory.
  void fail_call(DeviceCall call, std::uint64_t nth = 1, bool out_of_memory = false);

  // --- modelled time (microseconds) ---
  // The host clock: starts at 0, never runs backwards (an earlier time is ignored). A replay
  // advances it by the gaps between its trace's timestamps; a wait (wait_until) moves it on to
  // the event's completion, and the trace's later events follow from there.
  void set_host_time(double us);
  void advance_host_time(double us);  // by `us` more (negative: ignored)
  double host_time() const;
  // The host blocks until its clock reads `us` (a synchronize_event): the clock moves on to it and
  // the time waited adds to modelled_wait_us(). A time already past is no wait.
  void wait_until(double us);
  // Host time spent in calls, priced by kDeviceCallPrices (failed calls too). It is an account,
  // not a clock: the host clock does not move, so calls and waits add up without one shortening
  // the other.
  double modelled_call_us() const;
  // Host time spent waiting for a stream to reach an event (wait_until).
  double modelled_wait_us() const;
  Device::CallTimes call_times() const;  // the two above

 private:
  static constexpr std::size_t kKinds = static_cast<std::size_t>(DeviceCall::count_);
  struct Failure {
    std::uint64_t at = 0;  // absolute call number that fails; 0 = none
    bool out_of_memory = false;
  };

  mutable std::mutex mutex_;  // guards everything below
  // Calls of each kind since construction or the last reset_call_counts.
  std::array<std::uint64_t, kKinds> calls_{};
  // Pending failure of each kind. Invariant: at == 0 or at > calls_ of its kind (it is still
  // ahead); count() clears it when it fires.
  std::array<Failure, kKinds> failures_{};
  double call_us_ = 0;       // price of the calls counted in calls_
  double host_time_us_ = 0;  // the host clock; never decreases
  double wait_us_ = 0;       // total of the waits; never decreases
};

}  // namespace gmem
