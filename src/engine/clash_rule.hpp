// ClashRule: how many chunks the engine may hold beyond the most pages it ever used at once, so
// that pages that keep clashing (their chunk busy elsewhere when they are needed) get chunks of
// their own. ChunkSource asks it before it buys a chunk for such a page.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace gmem::detail {

// The rule, in short (the programs behind each number: docs/notes/2026-11-28-the-clash-rule.md):
// - a page placed online buys a chunk of its own once it clashed kClashesToBuy times before, a
//   page of the plan region once it clashed before; a warm-up step's clashes never buy;
// - while reserved memory stays within peak pages used + peak / share + kPages;
// - the share starts at 1/kFirstShare; it doubles by count (up to 1/kRecurringShare) each time
//   the clashes, recurring ones weighted, reach half the pages in use, and by cost (up to
//   1/kMinShare) when remapping took more than 1/kCostlyShare of the host time of its window.
class ClashRule {
 public:
  static constexpr std::size_t kFirstShare = 200;
  static constexpr std::size_t kRecurringShare = 100;
  static constexpr std::size_t kMinShare = 8;
  static constexpr std::size_t kPages = 4;
  static constexpr std::uint32_t kClashesToBuy = 3;
  static constexpr std::uint32_t kRecurring = 7;
  static constexpr std::size_t kRecurringWeight = 64;
  static constexpr double kClashUs = 62;  // cuMemUnmap 22 + cuMemMap 2 + cuMemSetAccess 38 (H100)
  static constexpr double kCostlyShare = 10;
  static constexpr double kWindowUs = 30e6;
  explicit ClashRule(double start_us) : window_start_us_(start_us) {}

  // Whether clashes count from `now_us` on. Those of a warm-up step do not (ChunkSource), and
  // neither does its time: the window weighs the clashes that count against the time in which
  // they could. Weighed against all the time, a program whose steps were all warm-ups for a while
  // (shapes new in every step: DLRM's sparse gradients took 64 steps to be found so) never found
  // its remaps costly, though they took half of its step (docs/notes/2026-11-25-held-out-traces-a-fifth-batch-shapes-new-every-step-two-optimizers.md).
  bool counting() const { return counting_; }
  void set_counting(bool counting, double now_us) {
    if (counting == counting_) return;
    counting_ = counting;
    if (counting)
      window_start_us_ += std::max(0.0, now_us - paused_at_us_);
    else
      paused_at_us_ = now_us;
  }
  // Steps are first marked: the time before (building the model, loading data, a first pass) is
  // not the loop's, whose clashes are weighed from here.
  void restart_window(double now_us) {
    window_clashes_ = 0;
    window_waits_us_ = 0;
    window_start_us_ = now_us;
    paused_at_us_ = now_us;
  }

  // A page was remapped outside a warm-up, after waiting `waited_us` for its stream.
  void count_cost(double waited_us) {
    ++window_clashes_;
    window_waits_us_ += std::max(0.0, waited_us);
  }
  // A page clashed again (`clashes_before` > 0 times before; `planned`: a page of the plan
  // region); may it have a new chunk, with `held` chunks held now? `now_us`: the device's host
  // clock. Every such clash is weighed, whether it may buy or not.
  bool allows_new_chunk(std::size_t held, std::size_t peak_used, std::uint32_t clashes_before,
                        bool planned, double now_us) {
    weighted_ += clashes_before >= kRecurring ? kRecurringWeight : 1;
    if (weighted_ > peak_used / 2) {
      weighted_ = 0;
      if (by_count_ > kRecurringShare) by_count_ = std::max(kRecurringShare, by_count_ / 2);
    }
    if (++since_weighed_ > peak_used / 2 && now_us - window_start_us_ >= min_window_us_) {
      since_weighed_ = 0;
      const double spent_us = static_cast<double>(window_clashes_) * kClashUs + window_waits_us_;
      const double window_us = now_us - window_start_us_;
      const bool costly = spent_us * kCostlyShare > window_us;
      if (costly && by_cost_ > kMinShare) {
        by_cost_ = std::max(kMinShare, by_cost_ / 2);
        min_window_us_ = std::min(window_us, kWindowUs);
      }
      if (costly || window_us > kWindowUs) {
        window_clashes_ = 0;
        window_waits_us_ = 0;
        window_start_us_ = now_us;
      }
    }
    const std::uint32_t needed = planned ? 1 : kClashesToBuy;
    return clashes_before >= needed && held < peak_used + allowance(peak_used);
  }
  // Chunks the engine may hold beyond `peak_used` pages used at once.
  std::size_t allowance(std::size_t peak_used) const {
    return peak_used / std::min(by_count_, by_cost_) + kPages;
  }

 private:
  std::size_t by_count_ = kFirstShare;  // the share's two bounds: 1/by_count_, 1/by_cost_
  std::size_t by_cost_ = kFirstShare;
  std::size_t weighted_ = 0;            // clashes towards the next count, recurring ones weighted
  std::size_t since_weighed_ = 0;       // clashes since the cost was last weighed
  std::size_t window_clashes_ = 0;      // remaps in the cost's window, and their waits
  double window_waits_us_ = 0;
  double window_start_us_;
  double min_window_us_ = 0;            // how long the window that last doubled the share lasted
  bool counting_ = true;                // clashes count (no warm-up step is running)
  double paused_at_us_ = 0;             // when they stopped counting, if they do not
};

}  // namespace gmem::detail
