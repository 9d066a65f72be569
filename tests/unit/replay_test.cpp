// Replaying the real traces through the engine: no failures, consistent state, and the memory
// targets (gmem within 2% of peak allocated, lazily and under a cap).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <unordered_set>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include "gmem/error.hpp"
#include "gmem/trace.hpp"
#include "trace/replay.hpp"

namespace gmem::trace {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr std::size_t kGranule = std::size_t{2} << 20;

std::string data_file(const std::string& name) { return std::string(GMEM_TEST_DATA) + "/" + name; }

// PyTorch's own max_memory_allocated() / max_memory_reserved() for each run, in GiB to three
// decimals, from /work/shared/traces/README.md.
struct Native {
  const char* file;
  double peak_allocated_gib;
  double peak_reserved_gib;
  // PyTorch counts a block as allocated until free_requested; the trace keeps it live until
  // free_completed, later when it waits on another stream (two_streams).
  bool frees_wait_on_streams = false;
  // How far the trace's peak allocated may fall below PyTorch's figure: the history records
  // requested sizes, PyTorch counts whole unsplit blocks (0.7% on llama and generation).
  double allocated_tolerance = 0.005;
  // The smallest device, over peak allocated. Generation grows its KV cache token by token in
  // odd sizes, and partial pages cost it one page more than 1%.
  double min_capacity_bound = 1.01;
};
constexpr Native kTraces[] = {
    {"resnet50.trace.csv.gz", 5.354, 6.531},
    {"gpt2.trace.csv.gz", 12.680, 14.236},
    {"deeplab_varsize.trace.csv.gz", 5.083, 5.391},
    {"leak_losses.trace.csv.gz", 0.364, 0.385},
    {"tiny_leak.trace.csv.gz", 0.034, 0.035},
    {"two_streams.trace.csv.gz", 0.703, 1.213, true},
    // Captured by bench/torch/capture_traces.py on the H100 (bench/torch/README.md).
    {"llama_ckpt_varlen.trace.csv.gz", 10.921, 13.682, false, 0.01},
    {"fasterrcnn_varsize.trace.csv.gz", 15.326, 19.971},
    {"gpt2_generate.trace.csv.gz", 1.288, 1.803, false, 0.01, 1.011},
    // Training with an evaluation every fourth step (2026-11-24; bench/torch/train_eval.sh).
    {"gpt2_train_eval.trace.csv.gz", 4.454, 6.053, false, 0.01},
    {"resnet50_train_eval.trace.csv.gz", 2.867, 4.236, false, 0.01},
    // Held out while gmem was tuned, then kept as kinds no other trace has (2026-11-24,
    // bench/torch/heldout.sh batch2): Inductor's buffers, and blocks sized by an MoE router.
    {"gpt2_compiled.trace.csv.gz", 4.134, 4.361},
    {"moe.trace.csv.gz", 10.049, 11.049},
};

// Replays model a GPU that runs this far behind the host (gmem replay's default).
constexpr double kGpuLagUs = 2000;

std::uint64_t round_up(std::uint64_t value, std::uint64_t to) { return (value + to - 1) / to * to; }

class RealTrace : public ::testing::TestWithParam<Native> {};

TEST_P(RealTrace, ReplaysWithinTargets) {
  const Native& native = GetParam();
  const Trace t = read_trace(data_file(native.file));
  ReplayOptions lagged;
  lagged.lag_us = kGpuLagUs;
  const ReplayResult r = replay(t, lagged);
  ASSERT_FALSE(r.failed) << r.failure;

  std::size_t allocs = 0, frees = 0;
  for (const Event& e : t.events) {
    allocs += e.action == Action::alloc;
    frees += e.action == Action::free_completed;
  }
  EXPECT_EQ(r.mallocs, allocs);
  EXPECT_EQ(r.frees, frees);
  EXPECT_EQ(r.live_at_end, allocs - frees);
  EXPECT_EQ(r.events, t.events.size());
  EXPECT_EQ(r.trace, t.name);

  // The trace's own accounting agrees with what PyTorch measured during the run. Its peak
  // allocated comes out up to 0.4% below PyTorch's (allocations the history did not record).
  EXPECT_NEAR(static_cast<double>(r.recorded_peak_reserved) / kGiB, native.peak_reserved_gib, 0.0015);
  const double allocated_gib = static_cast<double>(r.peak_allocated) / kGiB;
  if (native.frees_wait_on_streams) {
    EXPECT_GT(allocated_gib, native.peak_allocated_gib + 0.0015);
  } else {
    // 0.5%, or the README's rounding to three decimals for the small traces
    EXPECT_LE(allocated_gib, native.peak_allocated_gib + 0.0006);
    EXPECT_GE(allocated_gib, native.peak_allocated_gib * (1 - native.allocated_tolerance) - 0.0006);
  }

  EXPECT_GE(r.peak_reserved, r.peak_allocated);
  EXPECT_GT(r.creates, 0u);
  EXPECT_GT(r.maps, 0u);
  EXPECT_GT(r.ns_per_op, 0.0);
  // The targets: peak reserved within 2% of peak allocated by default, and the smallest device
  // within 1%, or the page rounding no allocator can avoid.
  const auto bound = [&](double share) {
    return std::max<std::uint64_t>(static_cast<std::uint64_t>(share * static_cast<double>(r.peak_allocated)),
                                   round_up(r.peak_allocated, kGranule));
  };
  EXPECT_LE(r.peak_reserved, bound(1.02)) << "peak reserved " << r.peak_reserved << " ("
                                          << r.reserved_ratio() << ") for peak allocated " << r.peak_allocated;

  const std::size_t min_cap = min_capacity(t, kGpuLagUs);
  EXPECT_EQ(min_cap % kGranule, 0u);
  EXPECT_GE(min_cap, r.peak_allocated);
  EXPECT_LE(min_cap, bound(native.min_capacity_bound)) << "min capacity " << min_cap << " (" << r.ratio(min_cap)
                            << ") for peak allocated " << r.peak_allocated;
  // It is the smallest: the replay fits at min_cap and fails one granule below.
  ReplayOptions at = lagged;
  at.capacity = min_cap;
  EXPECT_FALSE(replay(t, at).failed);
  at.capacity = min_cap - kGranule;
  EXPECT_TRUE(replay(t, at).failed);
}

INSTANTIATE_TEST_SUITE_P(SharedTraces, RealTrace, ::testing::ValuesIn(kTraces),
                         [](const ::testing::TestParamInfo<Native>& info) {
                           std::string name = info.param.file;
                           return name.substr(0, name.find('.'));
                         });

TEST(Replay, InvariantsHoldThroughout) {
  const Trace t = read_trace(data_file("two_streams.trace.csv.gz"));
  ReplayOptions options;
  options.check_invariants = true;
  options.check_every = 97;  // ~13 checks over the trace's 1280 operations
  const ReplayResult r = replay(t, options);
  EXPECT_FALSE(r.failed) << r.failure;
}

TEST(Replay, TooSmallADeviceFailsWithTheEvent) {
  const Trace t = read_trace(data_file("tiny_leak.trace.csv.gz"));
  ReplayOptions options;
  options.capacity = 16u << 20;  // the trace needs ~34 MiB
  const ReplayResult r = replay(t, options);
  ASSERT_TRUE(r.failed);
  EXPECT_NE(r.failure.find(t.path + ":"), std::string::npos) << r.failure;
  EXPECT_NE(r.failure.find("alloc of"), std::string::npos) << r.failure;
  EXPECT_LT(r.mallocs, 24u);
}

TEST(Replay, SteadyLoopsStopCallingTheDevice) {
  // Training loops that repeat their steps: once warm, every page their layout needs is mapped,
  // and the host never waits for the GPU. (gpt2_compiled's buffers are Inductor's.)
  for (const char* file : {"resnet50.trace.csv.gz", "gpt2.trace.csv.gz", "gpt2_compiled.trace.csv.gz"}) {
    ReplayOptions lagged;
    lagged.lag_us = kGpuLagUs;
    const ReplayResult r = replay(read_trace(data_file(file)), lagged);
    EXPECT_EQ(r.late_device_calls, 0u) << file << ": creates " << r.creates << " maps " << r.maps
                                       << " unmaps " << r.unmaps;
    EXPECT_EQ(r.late_host_wait_us, 0.0) << file;
    // No call at all on the fixed-shape loops; gpt2_compiled's stream, waited for just before
    // the second half, then marks its next frees (StreamTracker::kMarksWithoutWait): a few event
    // records, under a microsecond each, and nothing else.
    EXPECT_LE(r.late_device_call_us, std::string(file) == "gpt2_compiled.trace.csv.gz" ? 8.0 : 0.0) << file;
  }
}

TEST(Replay, ImagesOfVaryingSizesSettleWithinTheFirstSteps) {
  // fasterrcnn draws its images' sizes anew every step, and its layout settles within the first
  // steps all the same. A page that clashes once more late in the trace is remapped rather than
  // given a chunk of its own (online pages buy from their fourth clash, ClashRule::
  // kClashesToBuy): one such page, an unmap and a map, is what its second half may make.
  ReplayOptions lagged;
  lagged.lag_us = kGpuLagUs;
  const ReplayResult r = replay(read_trace(data_file("fasterrcnn_varsize.trace.csv.gz")), lagged);
  EXPECT_LE(r.late_device_calls, 2u) << "creates " << r.creates << " maps " << r.maps << " unmaps "
                                     << r.unmaps;
  EXPECT_LE(r.late_device_call_us, 62.0);  // one remap: cuMemUnmap 22 + cuMemMap 2 + cuMemSetAccess 38 us
  EXPECT_EQ(r.late_host_wait_us, 0.0);
}

// ReplayOptions::passes: the trace again and again in one engine, each pass's leftovers freed.
TEST(Replay, PassesRunTheTraceAgainInOneEngine) {
  const Trace t = read_trace(data_file("resnet50.trace.csv.gz"));
  ReplayOptions options;
  options.lag_us = kGpuLagUs;
  options.step_ends = {t.events.size() / 3, 2 * t.events.size() / 3};
  options.mark_steps = true;
  const ReplayResult once = replay(t, options);
  options.passes = 3;
  options.check_invariants = true;
  const ReplayResult thrice = replay(t, options);
  ASSERT_FALSE(thrice.failed) << thrice.failure;
  EXPECT_TRUE(once.per_pass.empty());
  ASSERT_EQ(thrice.per_pass.size(), 3u);
  EXPECT_EQ(thrice.mallocs, 3 * once.mallocs);
  EXPECT_EQ(thrice.frees, 3 * once.frees);
  EXPECT_EQ(thrice.steps, 3 * once.steps);
  EXPECT_EQ(thrice.late_steps, once.steps);  // the late part is the last pass
  // The first pass is the single replay, call for call.
  EXPECT_EQ(thrice.per_pass[0].device_calls, once.creates + once.maps + once.unmaps);
  EXPECT_EQ(thrice.per_pass[0].peak_reserved, once.peak_reserved);
  std::uint64_t calls = 0;
  for (const StepFigures& p : thrice.per_pass) calls += p.device_calls;
  EXPECT_EQ(calls, thrice.creates + thrice.maps + thrice.unmaps);
  EXPECT_EQ(thrice.late_device_calls, thrice.per_pass.back().device_calls);
  EXPECT_EQ(thrice.peak_reserved, thrice.per_pass.back().peak_reserved);
  EXPECT_GE(thrice.per_pass[2].peak_reserved, thrice.per_pass[1].peak_reserved);
}

// The steps of a trace between successive markers (allocations from `frame`), kept only where a
// step frees everything it allocates and nothing else: such steps can be replayed in any order.
std::vector<std::pair<std::size_t, std::size_t>> self_contained_steps(const Trace& t,
                                                                      const std::string& frame) {
  std::vector<std::size_t> starts;
  for (std::size_t i = 0; i < t.events.size(); ++i)
    if (t.events[i].action == Action::alloc && t.frames[t.events[i].user_frame] == frame)
      starts.push_back(i);
  std::vector<std::pair<std::size_t, std::size_t>> steps;
  for (std::size_t k = 0; k + 1 < starts.size(); ++k) {
    std::unordered_set<std::uint64_t> live;
    bool closed = true;
    for (std::size_t i = starts[k]; i < starts[k + 1] && closed; ++i) {
      const Event& e = t.events[i];
      if (e.action == Action::alloc) live.insert(e.addr);
      else if (e.action == Action::free_completed) closed = live.erase(e.addr) == 1;
    }
    if (closed && live.empty()) steps.emplace_back(starts[k], starts[k + 1]);
  }
  return steps;
}

// llama_ckpt_varlen's first steps, then its self-contained steps in `rounds` shuffled rounds:
// the trace, where each round ends, and where each step ends (the event before each step marker
// in the first part, then each copied step's last event), for replays that mark steps.
struct ShuffledRounds {
  Trace trace;
  std::size_t prefix_end = 0;  // events before the first round
  std::vector<std::size_t> round_ends, step_ends;
};
ShuffledRounds shuffled_rounds(int rounds, unsigned seed) {
  const char* marker = "models.py:148:step";
  const Trace t = read_trace(data_file("llama_ckpt_varlen.trace.csv.gz"));
  const auto steps = self_contained_steps(t, marker);
  EXPECT_GE(steps.size(), 8u);
  ShuffledRounds out;
  out.trace = t;
  out.prefix_end = steps.back().second;
  std::vector<Event>& events = out.trace.events;
  events.assign(t.events.begin(), t.events.begin() + static_cast<std::ptrdiff_t>(out.prefix_end));
  for (std::size_t i = 1; i < events.size(); ++i)
    if (events[i].action == Action::alloc && t.frames[events[i].user_frame] == marker)
      out.step_ends.push_back(i - 1);
  std::int64_t clock = events.back().time_us;
  std::mt19937 rng(seed);
  for (int round = 0; round < rounds; ++round) {
    auto order = steps;
    std::shuffle(order.begin(), order.end(), rng);
    for (const auto& [begin, end] : order) {
      const std::int64_t start = t.events[begin].time_us;
      for (std::size_t i = begin; i < end; ++i) {
        events.push_back(t.events[i]);
        events.back().time_us = clock + (t.events[i].time_us - start);
      }
      clock = events.back().time_us + 1000;
      out.step_ends.push_back(events.size() - 1);
    }
    out.round_ends.push_back(events.size());
  }
  return out;
}

// Replay options for shuffled rounds under the GPU lag, each step's end marked.
ReplayOptions marked_options(const ShuffledRounds& r) {
  ReplayOptions options;
  options.lag_us = kGpuLagUs;
  options.step_ends = r.step_ends;
  options.mark_steps = true;
  return options;
}

TEST(Replay, ShapesTakingTurnsWithStepMarksSettleAtPeak) {
  // The same shuffled rounds, each step's end marked (Engine::mark_step): once a length has come
  // back after another, its steps follow a plan made from its last occurrence, in a range of
  // their own where blocks of different lifetimes never share bytes. Measured (seeds 1-5): the
  // first round maps the plans' pages (1,435-3,392 device calls; seed 4 also its second round),
  // later rounds 0-4 each, rounds 5-14 none, at 1.013-1.014 times peak allocated throughout
  // (unmarked: 383-2,300 calls in rounds 5-14, ending at 1.127-1.130).
  const ShuffledRounds r = shuffled_rounds(14, 1);
  ReplayOptions marked = marked_options(r);
  auto calls_until = [&](std::size_t event) {
    marked.stop_at_event = event;
    const ReplayResult result = replay(r.trace, marked);
    EXPECT_FALSE(result.failed) << result.failure;
    return std::make_pair(result.creates + result.maps + result.unmaps, result.reserved_ratio());
  };
  const auto [after_fourth, ratio_fourth] = calls_until(r.round_ends[3]);
  const auto [all, ratio] = calls_until(0);
  EXPECT_LE(all - after_fourth, 10u) << "device calls in rounds 5-14";
  EXPECT_LE(ratio_fourth, 1.02);
  EXPECT_LE(ratio, 1.02);
}

TEST(Replay, VaryingLengthsMarkedAtOptimizerStepsSettleAtPeak) {
  // llama_rounds: bench/torch/train_bench.py's Llama schedule captured on the H100
  // (capture_traces.py's llama_rounds, its first 40 steps): each of 24 sequence lengths once,
  // then lengths drawn from them. Steps marked where gmem.torch marks them, after
  // optimizer.step() (models.py:168). Without marks the lengths' layouts keep clashing. The clash
  // rule buys chunks up to 1/100 of the pages in use as clashes accumulate, and more only where
  // the remaps cost a tenth of the program's time; here they cost a few percent, so it
  // stays within 2% of its peak and stitches every step (weighing no cost, the rule bought 1.13
  // times peak allocated, as it did on the H100: 1.131). With marks the first step
  // of each length stitches (a warm-up), the gradients that zero_grad frees after the mark
  // belong to the step, and lengths that come back follow their plans: after the step that maps
  // the plan region (the 26th), 1.004 and about no device call (live, 60 steps: 1.0046, no map in
  // the last 33).
  const Trace t = read_trace(data_file("llama_rounds.trace.csv.gz"));
  ReplayOptions options;
  options.lag_us = kGpuLagUs;
  options.step_ends = step_ends_after_frame(t, "models.py:168");
  ASSERT_EQ(options.step_ends.size(), 40u);
  options.record_steps = true;
  const ReplayResult unmarked = replay(t, options);
  options.mark_steps = true;
  const ReplayResult marked = replay(t, options);
  ASSERT_FALSE(unmarked.failed) << unmarked.failure;
  ASSERT_FALSE(marked.failed) << marked.failure;
  ASSERT_EQ(marked.per_step.size(), 40u);
  ASSERT_EQ(unmarked.per_step.size(), 40u);
  const double peak = static_cast<double>(marked.peak_allocated);
  // After the 24 lengths' first steps: the warm-ups bought no chunks for their clashes.
  EXPECT_LE(static_cast<double>(marked.per_step[23].peak_reserved) / peak, 1.01);
  EXPECT_LE(marked.reserved_ratio(), 1.01);
  EXPECT_LE(unmarked.reserved_ratio(), 1.02);
  std::uint64_t late = 0, late_unmarked = 0;  // device calls in the last ten steps
  double late_unmarked_us = 0;
  for (std::size_t i = 30; i < 40; ++i) {
    late += marked.per_step[i].device_calls;
    late_unmarked += unmarked.per_step[i].device_calls;
    late_unmarked_us += unmarked.per_step[i].device_us;
  }
  EXPECT_LE(late, 10u);
  EXPECT_GT(late_unmarked, 1000u);
  // Steps 2-25 bring the 24 lengths (the first builds the model too) and every later step
  // repeats one of them: a length seen twice before follows its plan and makes about no calls.
  std::size_t seen_twice = 0;
  std::uint64_t seen_twice_calls = 0;
  for (std::size_t i = 0; i < 40; ++i) {
    const StepFigures& s = marked.per_step[i];
    EXPECT_EQ(s.repeats_step != 0, i >= 25) << "step " << i + 1;
    if (s.times_seen >= 2) ++seen_twice, seen_twice_calls += s.device_calls;
  }
  EXPECT_GE(seen_twice, 3u);
  EXPECT_LE(seen_twice_calls, 4 * seen_twice);
  // What the unmarked steps spend remapping stays under the clash rule's tenth of their time.
  const double late_span_us = static_cast<double>(t.events[options.step_ends[39]].time_us -
                                                  t.events[options.step_ends[29]].time_us);
  EXPECT_LT(late_unmarked_us, 0.1 * late_span_us);
  // The steps' figures add up to the replay's.
  std::uint64_t calls = 0;
  for (const StepFigures& s : marked.per_step) calls += s.device_calls;
  EXPECT_EQ(calls, marked.creates + marked.maps + marked.unmaps);
  EXPECT_EQ(marked.per_step.back().peak_reserved, marked.peak_reserved);
  EXPECT_EQ(marked.per_step[0].event, options.step_ends[0]);
}

TEST(Replay, TrainingWithEvaluationSettles) {
  // The loop most programs run (bench/torch/train_eval.sh, captured on the H100): three training
  // steps, then an evaluation on another batch size under no_grad, and again, four rounds. The
  // two phases take turns over the same pages. Marked where gmem.torch marks steps (after
  // optimizer.step(): just before the frees of zero_grad(), models.py:278, since only the first
  // optimizer step allocates; the evaluation then belongs to the step after it), the second half
  // makes no device call; unmarked (a program that never marks steps) its phases clash for a
  // round or two longer (resnet50_train_eval: 17 device calls in the second half), and the last
  // quarter makes none.
  for (const char* file : {"gpt2_train_eval.trace.csv.gz", "resnet50_train_eval.trace.csv.gz"}) {
    const Trace t = read_trace(data_file(file));
    ReplayOptions options;
    options.lag_us = kGpuLagUs;
    const auto zero_grad = [&](std::size_t i) {
      return t.frames[t.events[i].user_frame].find("models.py:278") != std::string::npos;
    };
    for (std::size_t i = 1; i < t.events.size(); ++i) {
      if (zero_grad(i) && !zero_grad(i - 1)) options.step_ends.push_back(i - 1);
    }
    ASSERT_EQ(options.step_ends.size(), 12u) << file;
    options.record_steps = true;
    options.mark_steps = true;
    const ReplayResult marked = replay(t, options);
    ASSERT_FALSE(marked.failed) << marked.failure;
    EXPECT_EQ(marked.late_device_calls, 0u) << file;
    EXPECT_EQ(marked.late_host_wait_us, 0.0) << file;
    EXPECT_LE(marked.reserved_ratio(), 1.02) << file;
    options.mark_steps = false;
    const ReplayResult unmarked = replay(t, options);
    ASSERT_FALSE(unmarked.failed) << unmarked.failure;
    std::uint64_t last_quarter = 0;
    for (std::size_t i = 9; i < 12; ++i) last_quarter += unmarked.per_step[i].device_calls;
    EXPECT_EQ(last_quarter, 0u) << file;
    EXPECT_LE(unmarked.reserved_ratio(), 1.02) << file;
  }
}

TEST(Replay, StepEndsAfterAFrame) {
  // Each run of events from the frame ends a step at its last event; a frame no event has: none.
  // A line is a whole number (train.py:1 is not train.py:10, train.py:42 not train.py:420) and a
  // file a whole name (train.py is not mytrain.py); a file alone names all its lines.
  Trace t;
  t.frames = {"", "train.py:10:step", "train.py:11:step", "train.py:100:step", "mytrain.py:10:step"};
  const std::uint32_t frames[] = {0, 1, 1, 2, 1, 0, 0, 1, 3, 4, 0};
  for (const std::uint32_t f : frames) t.events.push_back(Event{.user_frame = f});
  EXPECT_EQ(step_ends_after_frame(t, "train.py:10"), (std::vector<std::size_t>{2, 4, 7}));
  EXPECT_EQ(step_ends_after_frame(t, "train.py:10:step"), (std::vector<std::size_t>{2, 4, 7}));
  EXPECT_EQ(step_ends_after_frame(t, "train.py"), (std::vector<std::size_t>{4, 8}));
  EXPECT_EQ(step_ends_after_frame(t, "mytrain.py:10"), (std::vector<std::size_t>{9}));
  EXPECT_TRUE(step_ends_after_frame(t, "train.py:1").empty());
  EXPECT_TRUE(step_ends_after_frame(t, "rain.py").empty());
  EXPECT_TRUE(step_ends_after_frame(t, "other.py").empty());
  EXPECT_TRUE(step_ends_after_frame(t, "").empty());
}

TEST(Replay, InvariantsHoldWithStepMarks) {
  // Plans followed, left and made again over two shuffled rounds, checked every ~20k operations.
  const ShuffledRounds r = shuffled_rounds(2, 3);
  ReplayOptions options = marked_options(r);
  options.check_invariants = true;
  options.check_every = 20011;
  const ReplayResult result = replay(r.trace, options);
  EXPECT_FALSE(result.failed) << result.failure;
}

TEST(Replay, InvariantsHoldWithMapAhead) {
  // The same with map-ahead's thread mapping plan regions early and ahead, and its rounds ended
  // by steps that leave their plans (whatever the thread's timing, a page it booked goes back).
  const ShuffledRounds r = shuffled_rounds(2, 3);
  ReplayOptions options = marked_options(r);
  options.engine.map_ahead = true;
  options.check_invariants = true;
  options.check_every = 20011;
  const ReplayResult result = replay(r.trace, options);
  EXPECT_FALSE(result.failed) << result.failure;
}

TEST(Replay, ShapesTakingTurnsWithoutMarksStayAtPeakWhileRemapsAreCheap) {
  // llama_ckpt_varlen draws a sequence length per step, and each length lays its blocks out
  // differently. Its steps replayed again and again in shuffled order, with no step marks: every
  // round remaps pages whose chunks another length's layout took. Only more chunks would stop it
  // (the ten layouts need 1.09 times the pages in use at once), but the remaps cost a few percent
  // of the rounds' time, so the clash rule buys no more than the 1/100 that clashes buy by count:
  // the rounds stay within 2% of their peak and go on remapping. (Weighing no cost, it
  // bought its way to 1.13 and settled by round six; with step marks the rounds settle at their
  // peak: ShapesTakingTurnsWithStepMarksSettleAtPeak.)
  constexpr int kRounds = 14;
  const ShuffledRounds rounds = shuffled_rounds(kRounds, 1);
  const std::vector<std::size_t>& round_ends = rounds.round_ends;
  ReplayOptions lagged;
  lagged.lag_us = kGpuLagUs;
  struct Until {
    std::uint64_t calls = 0;
    double device_us = 0, host_us = 0, ratio = 0;
  };
  auto until = [&](std::size_t event) {
    lagged.stop_at_event = event;
    const ReplayResult r = replay(rounds.trace, lagged);
    EXPECT_FALSE(r.failed) << r.failure;
    return Until{r.creates + r.maps + r.unmaps, r.device_call_us + r.host_wait_us,
                 r.host_clock_us, r.reserved_ratio()};
  };
  const Until before_first = until(rounds.prefix_end);
  const Until after_first = until(round_ends[0]);
  const Until before_last = until(round_ends[kRounds - 2]);
  const Until all = until(0);
  EXPECT_GT(after_first.calls - before_first.calls, 1000u);  // the first round still clashes
  EXPECT_LE(after_first.ratio, 1.02);
  EXPECT_LE(all.ratio, 1.02);
  EXPECT_GT(all.calls - before_last.calls, 1000u) << "device calls in the last round";
  // Rounds 2-14: what the remaps and their waits cost, against the host time they took.
  EXPECT_LT(all.device_us - after_first.device_us, 0.1 * (all.host_us - after_first.host_us));
}

// Prints the shuffled rounds of ShapesTakingTurns... per round (device calls, reserved
// over peak allocated), without and with step marks (planned step layouts): the experiment's
// figures for docs/notes/ (the notebook). Run with --gtest_also_run_disabled_tests.
TEST(Replay, DISABLED_PrintShuffledRounds) {
  const int seed = std::getenv("GMEM_SEED") ? std::atoi(std::getenv("GMEM_SEED")) : 1;
  constexpr int kRounds = 14;
  const ShuffledRounds r = shuffled_rounds(kRounds, static_cast<unsigned>(seed));
  for (const bool marks : {false, true}) {
    ReplayOptions lagged = marked_options(r);
    lagged.mark_steps = marks;
    lagged.stop_at_event = r.prefix_end;
    std::uint64_t before = 0;
    double ns_before = 0, ops_before = 0;  // host time in the engine so far, and operations
    {
      const ReplayResult result = replay(r.trace, lagged);
      before = result.creates + result.maps + result.unmaps;
      ops_before = static_cast<double>(result.mallocs + result.frees);
      ns_before = result.ns_per_op * ops_before;
    }
    std::printf("%s (seed %d): prefix %llu calls\n", marks ? "marked" : "unmarked", seed,
                static_cast<unsigned long long>(before));
    for (int round = 0; round < kRounds; ++round) {
      lagged.stop_at_event = round + 1 == kRounds ? 0 : r.round_ends[round];
      const ReplayResult result = replay(r.trace, lagged);
      EXPECT_FALSE(result.failed) << result.failure;
      const std::uint64_t calls = result.creates + result.maps + result.unmaps;
      const double ops = static_cast<double>(result.mallocs + result.frees), ns = result.ns_per_op * ops;
      std::printf("  round %2d: %6llu calls, ratio %.4f, %.0f ns/op\n", round + 1,
                  static_cast<unsigned long long>(calls - before), result.reserved_ratio(),
                  (ns - ns_before) / (ops - ops_before));
      before = calls;
      ns_before = ns;
      ops_before = ops;
    }
  }
}

class WrittenTrace : public ::testing::Test {
 protected:
  void TearDown() override { std::filesystem::remove(path_); }
  const std::string& write(const std::string& rows) {
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = (std::filesystem::temp_directory_path() /
             ("gmem_replay_test_" + std::string(test->name()) + "_" + std::to_string(::getpid()) + ".csv"))
                .string();
    std::ofstream(path_) << "action,addr,size,stream,time_us,user_frame,lib_frame\n" << rows;
    return path_;
  }
  std::string path_;
};

class BadTrace : public WrittenTrace {
 protected:
  void expect_error(const std::string& path, std::size_t line, const std::string& words) {
    try {
      replay(read_trace(path));  // read_trace refuses what no earlier state explains, replay the rest
      ADD_FAILURE() << "no error";
    } catch (const BadInputError& e) {
      EXPECT_EQ(e.file(), path);
      EXPECT_EQ(e.line(), line);
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  }
};

// A free of a block the history never allocated: the history began mid-run (a ring that wrapped),
// and the block was live when it began (docs/wrapped-histories.md).
TEST_F(BadTrace, FreeOfUnknownAddressIsABlockFromBeforeTheHistory) {
  write("alloc,4096,512,0,1,,\nfree_completed,4096,512,0,2,,\nfree_completed,8192,1024,0,3,,\n");
  const Trace t = read_trace(path_);
  EXPECT_TRUE(t.window.mid_run);
  EXPECT_EQ(t.window.blocks_at_start, 1u);
  EXPECT_EQ(t.window.bytes_at_start, 1024u);
  const ReplayResult r = replay(t);
  ASSERT_FALSE(r.failed) << r.failure;
  EXPECT_EQ(r.events, 3u);  // the file's; the rebuilt alloc is not one of them
  EXPECT_EQ(r.peak_allocated, 1536u);  // live from the start, with the block of line 2
  EXPECT_EQ(r.live_at_end, 0u);
}

TEST_F(BadTrace, DoubleFree) {
  write("alloc,4096,512,0,1,,\nfree_completed,4096,512,0,2,,\nfree_completed,4096,512,0,3,,\n");
  expect_error(path_, 4, "which is not live: line 3 freed it and nothing allocated it since (a double free)");
}

TEST_F(BadTrace, DoubleFreeOfABlockFromBeforeTheHistory) {
  write("free_completed,4096,512,0,1,,\nfree_completed,4096,512,0,2,,\n");
  expect_error(path_, 3, "line 2 freed it");
}

TEST_F(BadTrace, FreeOfUnknownSizeOfABlockFromBeforeTheHistory) {
  write("alloc,8192,512,0,1,,\nfree_completed,4096,0,0,2,,\n");
  expect_error(path_, 3, "of size 0: the size of a block live before the history began cannot be known");
}

TEST_F(BadTrace, AllocOverALiveBlock) {
  write("alloc,4096,512,0,1,,\nalloc,4096,1024,0,2,,\n");
  expect_error(path_, 3, "still live (allocated at line 2)");
}

using SamePlace = WrittenTrace;

TEST_F(SamePlace, CountsBuffersMadeAnewWhereTheTracePutThemAndWhereGmemDid) {
  // 4 MiB made three times at 0x40000000 by the trace's allocator (twice again in its place), and
  // once at 0x50000000 (not counted: nothing of that size was there before). gmem keeps the second
  // in its place, nothing else being free; the third comes after another 4 MiB block took it.
  write("alloc,1073741824,4194304,0,1,,\nfree_completed,1073741824,4194304,0,2,,\n"
        "alloc,1073741824,4194304,0,3,,\nfree_completed,1073741824,4194304,0,4,,\n"
        "alloc,1342177280,4194304,0,5,,\nalloc,1073741824,4194304,0,6,,\n");
  const ReplayResult r = replay(read_trace(path_));
  ASSERT_FALSE(r.failed) << r.failure;
  EXPECT_EQ(r.same_place_recorded, 2u);
  EXPECT_EQ(r.same_place_kept, 1u);
}

TEST_F(BadTrace, RecordedReservedFollowsSegments) {
  write("segment_alloc,0,2097152,0,1,,\nalloc,0,1000,0,2,,\nsegment_alloc,4194304,4194304,0,3,,\n"
        "segment_free,0,2097152,0,4,,\nsegment_alloc,0,1048576,0,5,,\n");
  const ReplayResult r = replay(read_trace(path_));
  EXPECT_EQ(r.recorded_peak_reserved, 6u << 20);
  EXPECT_EQ(r.peak_allocated, 1024u);  // 1000 rounded up to 512 B
  EXPECT_EQ(r.live_at_end, 1u);
}

}  // namespace
}  // namespace gmem::trace

namespace gmem::trace {
namespace {

// --- the GPU lagging behind the host (ReplayOptions::lag_us) ---

constexpr double kLagUs = 2000;

// Without a lag, stream work completes at once, as before the lag existed: the trace's
// timestamps change nothing, and the host never waits.
TEST(ReplayLag, ZeroLagIgnoresTheClock) {
  const Trace t = read_trace(data_file("two_streams.trace.csv.gz"));
  Trace stretched = t;  // the same program, a thousand times slower
  for (Event& e : stretched.events) e.time_us *= 1000;
  Trace instant = t;
  for (Event& e : instant.events) e.time_us = 0;
  for (std::size_t limit : {std::size_t{0}, std::size_t{800} << 20}) {  // lazily, and capped
    ReplayOptions options;
    options.engine.memory_limit = limit;
    ASSERT_EQ(options.lag_us, 0.0);  // the default
    const ReplayResult r = replay(t, options);
    ASSERT_FALSE(r.failed) << r.failure;
    EXPECT_EQ(r.host_wait_us, 0.0);
    EXPECT_GT(r.unmaps, 0u) << "pages move between the streams";
    for (const Trace* other : {&stretched, &instant}) {
      const ReplayResult o = replay(*other, options);
      EXPECT_EQ(o.peak_reserved, r.peak_reserved);
      EXPECT_EQ(o.creates, r.creates);
      EXPECT_EQ(o.maps, r.maps);
      EXPECT_EQ(o.unmaps, r.unmaps);
      EXPECT_EQ(o.late_device_calls, r.late_device_calls);
      EXPECT_EQ(o.device_call_us, r.device_call_us);
      EXPECT_EQ(o.host_wait_us, 0.0);
    }
  }
}

TEST(ReplayLag, ReportsModelledDeviceTime) {
  for (const char* file : {"two_streams.trace.csv.gz", "leak_losses.trace.csv.gz"}) {
    const Trace t = read_trace(data_file(file));
    ReplayOptions options;
    options.lag_us = kLagUs;
    const ReplayResult r = replay(t, options);
    ASSERT_FALSE(r.failed) << file << ": " << r.failure;
    EXPECT_EQ(r.lag_us, kLagUs);
    // At least the priced chunk calls the result counts (cuMemSetAccess and events come on top).
    EXPECT_GE(r.device_call_us, 15.0 * static_cast<double>(r.creates) + 2.0 * static_cast<double>(r.maps) +
                                    22.0 * static_cast<double>(r.unmaps)) << file;
    EXPECT_GT(r.device_call_us, 0.0) << file;
    EXPECT_LE(r.late_device_call_us, r.device_call_us) << file;
    EXPECT_LE(r.late_host_wait_us, r.host_wait_us) << file;
    EXPECT_EQ(r.late_device_call_us > 0, r.late_device_calls > 0) << file;
    // The host clock: the trace's span, plus whatever the host waited.
    std::int64_t first = -1, last = 0;
    for (const Event& e : t.events) {
      if (e.action != Action::alloc && e.action != Action::free_completed) continue;
      if (first < 0) first = e.time_us;
      last = e.time_us;
    }
    EXPECT_EQ(r.host_clock_us, static_cast<double>(last - first) + r.host_wait_us) << file;
  }
}

TEST(ReplayLag, MinCapacityReplaysUnderTheLag) {
  const Trace t = read_trace(data_file("two_streams.trace.csv.gz"));
  const std::size_t min_cap = min_capacity(t, kLagUs);
  ReplayOptions at;
  at.lag_us = kLagUs;
  at.capacity = min_cap;
  const ReplayResult r = replay(t, at);
  EXPECT_FALSE(r.failed) << r.failure;
  EXPECT_GE(min_cap, r.peak_allocated);
  at.capacity = min_cap - kGranule;
  EXPECT_TRUE(replay(t, at).failed);
}

class LagTrace : public WrittenTrace {};

// Two streams take turns with the whole device: each handoff waits for the GPU to catch up
// with the stream that freed the memory, and everything after a wait happens that much later.
TEST_F(LagTrace, HandoffsBetweenStreamsWaitForTheGpu) {
  write("alloc,4194304,4194304,1,0,,\n"
        "free_completed,4194304,4194304,1,10,,\n"
        "alloc,8388608,4194304,2,20,,\n"
        "free_completed,8388608,4194304,2,30,,\n"
        "alloc,12582912,4194304,1,5000,,\n");
  const Trace t = read_trace(path_);
  ReplayOptions options;
  options.capacity = 4u << 20;  // room for one block: the other stream's pages must be reused
  options.lag_us = kLagUs;
  const ReplayResult r = replay(t, options);
  ASSERT_FALSE(r.failed) << r.failure;
  // Two handoffs, each made by the taking stream waiting on the GPU (a handover): the host does
  // not wait, and the memory moves without any created.
  EXPECT_EQ(r.stream_handovers, 2u);
  EXPECT_EQ(r.host_wait_us, 0.0);
  EXPECT_EQ(r.host_clock_us, 5000.0);
  EXPECT_EQ(r.creates, 2u);
  EXPECT_GT(r.device_call_us, 0.0);

  options.lag_us = 0;
  const ReplayResult at_once = replay(t, options);
  ASSERT_FALSE(at_once.failed) << at_once.failure;
  EXPECT_EQ(at_once.host_wait_us, 0.0);
  EXPECT_EQ(at_once.host_clock_us, 5000.0);
}

TEST_F(LagTrace, CountsTheStepsGiven) {
  std::string rows;
  for (int i = 0; i < 4; ++i) {  // events 2i (alloc) and 2i + 1 (free): one step each
    const std::string addr = std::to_string(4096 * (i + 1));
    rows += "alloc," + addr + ",512,0," + std::to_string(10 * i) + ",,\n";
    rows += "free_completed," + addr + ",512,0," + std::to_string(10 * i + 5) + ",,\n";
  }
  const Trace t = read_trace(write(rows));
  ReplayOptions options;
  options.step_ends = {1, 3, 5, 7};
  ReplayResult r = replay(t, options);
  EXPECT_EQ(r.steps, 4u);
  EXPECT_EQ(r.late_steps, 2u);  // the second half starts at event 4
  options.stop_at_event = 6;    // events 0-5: the second half starts at event 3
  r = replay(t, options);
  EXPECT_EQ(r.steps, 3u);
  EXPECT_EQ(r.late_steps, 2u);
  EXPECT_EQ(replay(t).steps, 0u);  // unknown
}

// --steps says which earlier step a step repeats: same sizes on the same streams, in order.
TEST_F(LagTrace, NamesTheStepAStepRepeats) {
  // Steps of requests A (1 MiB then 3 MiB), B (1 MiB, stream 7), A, A with its order swapped, A.
  const std::vector<std::vector<std::pair<int, int>>> steps = {
      {{1, 0}, {3, 0}}, {{1, 7}}, {{1, 0}, {3, 0}}, {{3, 0}, {1, 0}}, {{1, 0}, {3, 0}}};
  std::string rows;
  std::vector<std::size_t> ends;
  std::size_t event = 0;
  int time = 0;
  for (const auto& step : steps) {
    for (const auto& [mib, stream] : step) {
      const std::string size = std::to_string(mib << 20), addr = std::to_string((100 + event) << 22);
      rows += "alloc," + addr + "," + size + "," + std::to_string(stream) + "," + std::to_string(time++) + ",,\n";
      rows += "free_completed," + addr + "," + size + "," + std::to_string(stream) + "," +
              std::to_string(time++) + ",,\n";
      event += 2;
    }
    ends.push_back(event - 1);
  }
  const Trace t = read_trace(write(rows));
  ReplayOptions options;
  options.step_ends = ends;
  options.record_steps = true;
  const ReplayResult r = replay(t, options);
  ASSERT_EQ(r.per_step.size(), 5u);
  const std::size_t repeats[] = {0, 0, 1, 0, 1}, seen[] = {0, 0, 1, 0, 2};
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(r.per_step[i].repeats_step, repeats[i]) << "step " << i + 1;
    EXPECT_EQ(r.per_step[i].times_seen, seen[i]) << "step " << i + 1;
  }
}

}  // namespace
}  // namespace gmem::trace
