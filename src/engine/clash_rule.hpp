// ClashRule: how many chunks the engine may hold beyond the most pages it ever used at once, so
// that pages that keep clashing (their chunk busy elsewhere when they are needed) get chunks of
// their own. Backing asks it before it buys a chunk for such a page; docs/notes/2026-11-24-what-clashes-cost.md has the measurements behind its numbers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace gmem::detail {

// When a page that keeps clashing (its chunk was busy elsewhere when it was needed) gets a new
// chunk rather than another free one: while reserved memory stays within a share of the most
// pages ever used at once (1/share, plus kPages). Without it, a layout whose pages take turns at
// fewer chunks than they need keeps stitching every step (resnet50 did, 35 pages a step).
//
// Keeps clashing: a page placed online buys once it clashed kClashesToBuy times before, a page of
// a plan once it clashed before. An online layout forms over the first steps (the optimizer's
// state appears at the first, best fit lays out around it), and its first clashes are that;
// buying at the second spent the allowance on chunks the settled layout did not need, for good:
// a distillation loop held 1.014 times its peak where 1.005 settled as well, and gradient
// accumulation held 1.018 and still remapped where, buying from the fourth clash, it holds 1.010
// and settles (docs/notes/2026-11-25-held-out-traces-a-seventh-batch-training-recipes-as-scripts-write-them.md). A plan's layout is fixed when it is made: a
// plan page that clashes again will clash at every step of its shape, and waiting cost two more
// rounds of remaps for no memory saved. Every clash still counts towards the share below.
//
// The share starts at 1/kFirstShare and grows in two ways, the larger of the two holding
// (docs/notes/2026-11-24-what-clashes-cost.md):
// - By count, up to 1/kRecurringShare: each time the clashes reach half the pages in use, a clash
//   at a page that clashed kRecurring times before counting kRecurringWeight times, the share
//   doubles. A loop whose pages take turns in a fixed pattern needs a few more chunks than pages
//   and settles once it has them (gradient accumulation, gpt2_accum: 21 pages a step until then).
//   Measured again (2026-11-26), it changes no trace whose steps repeat, marked or not, gpt2_accum
//   included; it settles a program whose phases come back (resnet50 replayed six times in one
//   engine), and where layouts never repeat it buys 0.4-0.6% for fewer remaps (docs/notes/2026-11-26-the-partial-pages-floor-simulated-and-moving-off-pages-that-would-wait.md).
// - By cost, up to 1/kMinShare: at each such count the share doubles if remapping since it last
//   did took more than 1/kCostlyShare of the host time since then: every clash outside a warm-up,
//   priced kClashUs, and the waits for the stream before its unmap, as measured (with the time
//   spent getting the engine's lock back). The time is the device's clock: the steady clock on a
//   GPU, the modelled one in a replay (one that never moves makes every clash costly), from the
//   first step mark on where steps are marked, less the warm-ups' time (set_counting). A window
//   found cheap and older than kWindowUs starts again, so a program that clashes late is not
//   judged by its quiet start. A window that doubled the share sets how long the next must last
//   before it is weighed: a burst of remaps (a request of a new shape remaps hundreds of pages in
//   milliseconds) is weighed over as long a time as the evidence that bought the last chunks,
//   not alone (bert_large_serve doubled four times in 30 ms on one burst, to 1.10 times its peak,
//   and its remaps cost 3% of its time whether it held 1.10 or 1.03). A program whose layout
//   never repeats (requests of random shapes; shapes taking turns without step marks) clashes
//   whatever it holds, and more chunks only make it clash less often: BERT serving random
//   requests (bert_serve, H100) held 1.18 times its peak at 1/8; it holds 1.04-1.06, and its
//   remaps cost it about 2% of its time. A churn of back-to-back mallocs, where remapping is
//   nearly all the time spent, still buys up to 1/8 and settles.
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

  // Whether clashes count from `now_us` on. Those of a warm-up step do not (Backing), and
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
