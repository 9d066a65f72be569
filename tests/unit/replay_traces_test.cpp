// Replaying the real traces through the engine: no failures, consistent state, and the memory
// targets (gmem within 2% of peak allocated, lazily and under a cap); small written traces.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "gmem/error.hpp"
#include "gmem/trace.hpp"
#include "replay_test_support.hpp"
#include "trace/replay.hpp"

namespace gmem::trace {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

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
  const Trace t = read_trace(path());
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
  expect_error(path(), 4, "which is not live: line 3 freed it and nothing allocated it since (a double free)");
}

TEST_F(BadTrace, DoubleFreeOfABlockFromBeforeTheHistory) {
  write("free_completed,4096,512,0,1,,\nfree_completed,4096,512,0,2,,\n");
  expect_error(path(), 3, "line 2 freed it");
}

TEST_F(BadTrace, FreeOfUnknownSizeOfABlockFromBeforeTheHistory) {
  write("alloc,8192,512,0,1,,\nfree_completed,4096,0,0,2,,\n");
  expect_error(path(), 3, "of size 0: the size of a block live before the history began cannot be known");
}

TEST_F(BadTrace, AllocOverALiveBlock) {
  write("alloc,4096,512,0,1,,\nalloc,4096,1024,0,2,,\n");
  expect_error(path(), 3, "still live (allocated at line 2)");
}

using SamePlace = WrittenTrace;

TEST_F(SamePlace, CountsBuffersMadeAnewWhereTheTracePutThemAndWhereGmemDid) {
  // 4 MiB made three times at 0x40000000 by the trace's allocator (twice again in its place), and
  // once at 0x50000000 (not counted: nothing of that size was there before). gmem keeps the second
  // in its place, nothing else being free; the third comes after another 4 MiB block took it.
  write("alloc,1073741824,4194304,0,1,,\nfree_completed,1073741824,4194304,0,2,,\n"
        "alloc,1073741824,4194304,0,3,,\nfree_completed,1073741824,4194304,0,4,,\n"
        "alloc,1342177280,4194304,0,5,,\nalloc,1073741824,4194304,0,6,,\n");
  const ReplayResult r = replay(read_trace(path()));
  ASSERT_FALSE(r.failed) << r.failure;
  EXPECT_EQ(r.same_place_recorded, 2u);
  EXPECT_EQ(r.same_place_kept, 1u);
}

TEST_F(BadTrace, RecordedReservedFollowsSegments) {
  write("segment_alloc,0,2097152,0,1,,\nalloc,0,1000,0,2,,\nsegment_alloc,4194304,4194304,0,3,,\n"
        "segment_free,0,2097152,0,4,,\nsegment_alloc,0,1048576,0,5,,\n");
  const ReplayResult r = replay(read_trace(path()));
  EXPECT_EQ(r.recorded_peak_reserved, 6u << 20);
  EXPECT_EQ(r.peak_allocated, 1024u);  // 1000 rounded up to 512 B
  EXPECT_EQ(r.live_at_end, 1u);
}

}  // namespace
}  // namespace gmem::trace
