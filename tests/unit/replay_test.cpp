// Replaying the real traces through the engine: no failures, consistent state, and the memory
// targets (gmem within 2% of peak allocated, lazily and under a cap).
#include <gtest/gtest.h>

#include <algorithm>
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
};
constexpr Native kTraces[] = {
    {"resnet50.trace.csv.gz", 5.354, 6.531},
    {"gpt2.trace.csv.gz", 12.680, 14.236},
    {"deeplab_varsize.trace.csv.gz", 5.083, 5.391},
    {"leak_losses.trace.csv.gz", 0.364, 0.385},
    {"tiny_leak.trace.csv.gz", 0.034, 0.035},
    {"two_streams.trace.csv.gz", 0.703, 1.213, true},
};

std::uint64_t round_up(std::uint64_t value, std::uint64_t to) { return (value + to - 1) / to * to; }

class RealTrace : public ::testing::TestWithParam<Native> {};

TEST_P(RealTrace, ReplaysWithinTargets) {
  const Native& native = GetParam();
  const Trace t = read_trace(data_file(native.file));
  const ReplayResult r = replay(t);
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
    EXPECT_NEAR(allocated_gib, native.peak_allocated_gib, std::max(0.005 * native.peak_allocated_gib, 0.0006));
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

  const std::size_t min_cap = min_capacity(t);
  EXPECT_EQ(min_cap % kGranule, 0u);
  EXPECT_GE(min_cap, r.peak_allocated);
  EXPECT_LE(min_cap, bound(1.01)) << "min capacity " << min_cap << " (" << r.ratio(min_cap)
                            << ") for peak allocated " << r.peak_allocated;
  // It is the smallest: the replay fits at min_cap and fails one granule below.
  ReplayOptions at;
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
  // Training loops that repeat their steps: once warm, every page their layout needs is mapped.
  for (const char* file : {"resnet50.trace.csv.gz", "gpt2.trace.csv.gz"}) {
    const ReplayResult r = replay(read_trace(data_file(file)));
    EXPECT_EQ(r.late_device_calls, 0u) << file << ": creates " << r.creates << " maps " << r.maps
                                       << " unmaps " << r.unmaps;
  }
}

class BadTrace : public ::testing::Test {
 protected:
  void TearDown() override { std::filesystem::remove(path_); }
  const std::string& write(const std::string& rows) {
    path_ = (std::filesystem::temp_directory_path() /
             ("gmem_replay_test_" + std::to_string(::getpid()) + ".csv")).string();
    std::ofstream(path_) << "action,addr,size,stream,time_us,user_frame,lib_frame\n" << rows;
    return path_;
  }
  void expect_error(const std::string& path, std::size_t line, const std::string& words) {
    const Trace t = read_trace(path);
    try {
      replay(t);
      ADD_FAILURE() << "no error";
    } catch (const BadInputError& e) {
      EXPECT_EQ(e.file(), path);
      EXPECT_EQ(e.line(), line);
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  }
  std::string path_;
};

TEST_F(BadTrace, FreeOfUnknownAddress) {
  write("alloc,4096,512,0,1,,\nfree_completed,4096,512,0,2,,\nfree_completed,8192,512,0,3,,\n");
  expect_error(path_, 4, "free of 0x2000, which is not live");
}

TEST_F(BadTrace, DoubleFree) {
  write("alloc,4096,512,0,1,,\nfree_completed,4096,512,0,2,,\nfree_completed,4096,512,0,3,,\n");
  expect_error(path_, 4, "not live");
}

TEST_F(BadTrace, AllocOverALiveBlock) {
  write("alloc,4096,512,0,1,,\nalloc,4096,1024,0,2,,\n");
  expect_error(path_, 3, "still live (allocated at line 2)");
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
