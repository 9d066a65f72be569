// When empty_cache() gives back everything, and when only what the program stopped using.
//
// Many programs call torch.cuda.empty_cache() after every step. Each call then gives back what
// the next step maps again, and gmem's chunks are 2 MiB: every one costs an unmap and a release
// on the way out and a create, a map and a set-access on the way back, ~93 us on an H100. GPT-2
// (12.7 GiB at its peak) took 687 ms a step that way against 71 without the call, where
// PyTorch's allocator took 97 (docs/notes/2026-11-24-empty-cache-after-every-step.md).
//
// So a call gives back every chunk no page in use needs, as PyTorch's does, until two calls in
// a row find that the program created again at least half of what the call before gave back,
// at a price (the H100's per chunk) of more than a tenth of the time since that call. From then
// on a call keeps the chunks that the pages used between calls needed at their peak (with the
// clash rule's allowance), the most of the last kWindow such intervals, so that steps of
// varying shapes keep what their largest needs, and gives back the rest: memory the program
// stopped using still goes back, kWindow calls later. A call with no block live gives back
// everything (the program is done with it, or between passes). EngineOptions::
// strict_empty_cache (GMEM_EMPTY_CACHE=strict) gives back everything every time, for a program
// that hands memory to another library or process right after the call.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

namespace gmem::detail {

class EmptyCacheRule {
 public:
  static constexpr double kReleaseUs = 38;  // cuMemUnmap 22 + cuMemRelease 16, per chunk
  static constexpr double kRegrowUs = 55;   // cuMemCreate 15 + cuMemMap 2 + cuMemSetAccess 38
  static constexpr double kCostlyShare = 10;
  static constexpr int kCostlyCalls = 2;
  static constexpr std::size_t kWindow = 8;

  explicit EmptyCacheRule(bool strict) : strict_(strict) {}

  // A call begins at `now_us` (the device's host clock), `created` chunks created so far in
  // all: does it keep what the pages used since the last call needed?
  bool keeps(double now_us, std::uint64_t created) {
    if (strict_ || keeping_) return keeping_;
    if (calls_ > 0 && released_last_ > 0) {
      // (the counter restarts at reset_accumulated_stats)
      const std::uint64_t regrown = created >= created_at_last_ ? created - created_at_last_ : created;
      const double cost = static_cast<double>(released_last_) * kReleaseUs +
                          static_cast<double>(regrown) * kRegrowUs;
      const bool costly = 2 * regrown >= released_last_ && cost * kCostlyShare > now_us - last_us_;
      costly_in_a_row_ = costly ? costly_in_a_row_ + 1 : 0;
      keeping_ = costly_in_a_row_ >= kCostlyCalls;
    } else {
      costly_in_a_row_ = 0;
    }
    return keeping_;
  }
  // The call that began at `began_us` gave back `released` chunks; `created` as for keeps().
  void called(double began_us, std::uint64_t created, std::uint64_t released) {
    ++calls_;
    last_us_ = began_us;
    created_at_last_ = created;
    released_last_ = released;
  }
  // Bytes a keeping call keeps: the most that the last kWindow intervals needed, this one's
  // (`interval_need`: the pages used since the last call at their peak) included.
  std::size_t keep_bytes(std::size_t interval_need) {
    needs_[calls_ % kWindow] = interval_need;
    return *std::max_element(needs_.begin(), needs_.end());
  }

 private:
  bool strict_;
  bool keeping_ = false;
  int costly_in_a_row_ = 0;
  std::uint64_t calls_ = 0;
  double last_us_ = 0;
  std::uint64_t created_at_last_ = 0;
  std::uint64_t released_last_ = 0;
  std::array<std::size_t, kWindow> needs_{};  // by call, in a ring
};

}  // namespace gmem::detail
