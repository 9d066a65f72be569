// The leak detector on the real traces (leaks found where the programs leak, nothing elsewhere)
// and on synthetic training loops: a leak that starts late, a cache that grows then plateaus,
// optimizer state created once, a batch prefetched across a step.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>

#include "gmem/leaks.hpp"
#include "gmem/trace.hpp"

namespace gmem {
namespace {

std::string data(const std::string& name) { return std::string(GMEM_TEST_DATA) + "/" + name + ".trace.csv.gz"; }

const LeakFinding* find_site(const std::vector<LeakFinding>& leaks, const std::string& needle) {
  for (const LeakFinding& leak : leaks)
    if (leak.site.find(needle) != std::string::npos) return &leak;
  return nullptr;
}

// Live bytes per user frame after each event, as the program sees them (freed when requested).
class LiveBySite {
 public:
  explicit LiveBySite(const trace::Trace& t) : trace_(t) {}
  void apply(const trace::Event& e) {
    if (e.action == trace::Action::alloc) {
      blocks_[e.addr] = {trace_.frames[e.user_frame], e.size};
      bytes_[trace_.frames[e.user_frame]] += static_cast<std::int64_t>(e.size);
    } else if (e.action == trace::Action::free_requested || e.action == trace::Action::free_completed) {
      auto it = blocks_.find(e.addr);
      if (it == blocks_.end()) return;
      bytes_[it->second.first] -= static_cast<std::int64_t>(it->second.second);
      blocks_.erase(it);
    }
  }
  std::int64_t bytes(const std::string& site) const {
    auto it = bytes_.find(site);
    return it == bytes_.end() ? 0 : it->second;
  }

 private:
  const trace::Trace& trace_;
  std::map<std::uint64_t, std::pair<std::string, std::uint64_t>> blocks_;
  std::map<std::string, std::int64_t> bytes_;
};

TEST(LeakDetectorTrace, LeakLossesNamesCapture66WithItsGrowthPerStep) {
  const trace::Trace t = trace::read_trace(data("leak_losses"));
  const LeakReport report = find_leaks(t);
  const LeakFinding* leak = find_site(report.leaks, "capture.py:66");
  ASSERT_NE(leak, nullptr) << format_leaks(report);

  // Independently: how much more capture.py:66 holds at the start of step 40 than at the start of
  // step 20, steps counted by the loop's first allocation (capture.py:65).
  LiveBySite live(t);
  std::int64_t held20 = 0, held40 = 0, steps = 0;
  for (const trace::Event& e : t.events) {
    if (e.action == trace::Action::alloc && t.frames[e.user_frame] == "capture.py:65:run") {
      ++steps;
      if (steps == 20) held20 = live.bytes("capture.py:66:run");
      if (steps == 40) held40 = live.bytes("capture.py:66:run");
    }
    live.apply(e);
  }
  ASSERT_EQ(steps, 40);  // the program's steps, as the README says
  const double expected = static_cast<double>(held40 - held20) / 20.0;
  EXPECT_NEAR(static_cast<double>(leak->bytes_per_step), expected, 0.02 * expected);
  EXPECT_GE(leak->periods, 30u);
  EXPECT_GT(leak->surviving_bytes, 30 * leak->bytes_per_step);
  EXPECT_NE(leak->sample.stack.find("capture.py:66"), std::string::npos);
  EXPECT_GT(leak->first_seen_us, 0);
  EXPECT_LE(leak->sample.size, static_cast<std::uint64_t>(leak->bytes_per_step));
}

TEST(LeakDetectorTrace, TinyLeakNamesTheKeptOutputs) {
  const trace::Trace t = trace::read_trace(data("tiny_leak"));
  const LeakReport report = find_leaks(t);
  ASSERT_EQ(report.leaks.size(), 1u) << format_leaks(report);
  const LeakFinding& leak = report.leaks[0];
  EXPECT_NE(leak.site.find("capture2.py:73"), std::string::npos);
  // Every kept tensor is 64 KiB: the growth per step is a whole number of them.
  EXPECT_GT(leak.bytes_per_step, 0);
  EXPECT_EQ(leak.bytes_per_step % 65536, 0);
  EXPECT_EQ(leak.sample.size, 65536u);
  // What it says survived is at most what that line held at the end of the loop (its last alloc).
  std::size_t last_alloc = 0;
  for (std::size_t i = 0; i < t.events.size(); ++i)
    if (t.events[i].action == trace::Action::alloc) last_alloc = i;
  LiveBySite live(t);
  for (std::size_t i = 0; i <= last_alloc; ++i) live.apply(t.events[i]);
  EXPECT_LE(leak.surviving_bytes, live.bytes("capture2.py:73:run"));
}

class LeakFreeTrace : public ::testing::TestWithParam<const char*> {};

TEST_P(LeakFreeTrace, ReportsNothing) {
  const LeakReport report = find_leaks(trace::read_trace(data(GetParam())));
  EXPECT_GE(report.periods, 4u) << "steps not found";
  EXPECT_TRUE(report.leaks.empty()) << format_leaks(report);
  EXPECT_NE(leaks_json(report).find("\"leaks\":[]"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(RealTraces, LeakFreeTrace,
                         ::testing::Values("resnet50", "gpt2", "deeplab_varsize", "two_streams"));

// --- synthetic training loops ----------------------------------------------------------------------

struct Loop {
  int steps = 30;
  int leak_from = -1;        // from this step on, 512 KiB a step kept at "train.py:20:train"
  int leak_every = 1;        // ... every this many steps
  int cache_until = -1;      // until this step, 1 MiB a step added to a cache at "cache.py:5:get"
  bool workspace_at_leak = false;  // a 64 MiB one-off at the leak's site in its first step
  int micro_batches = 1;     // forward and backward this many times a step (gradient accumulation)
};

constexpr std::uint64_t kMiB = 1 << 20;

// Drives a LeakDetector (explicit steps) or writes a trace (no markers) with the same program:
// parameters, then per step an input batch prefetched one step ahead, forward activations,
// backward, optimizer state created in step 0, and the optional leak and cache.
class Program {
 public:
  explicit Program(const Loop& loop) : loop_(loop) { trace_.frames.push_back(""); }

  // With `teardown`, everything still live is freed at the end, as when a program exits.
  template <class Sink>
  void run(Sink& sink, bool teardown) {
    std::uint64_t next_batch = alloc(sink, "train.py:8:load", 8 * kMiB);
    for (int i = 0; i < 10; ++i) alloc(sink, "train.py:3:<module>", 16 * kMiB);  // parameters
    for (int s = 0; s < loop_.steps; ++s) {
      const std::uint64_t batch = next_batch;
      next_batch = alloc(sink, "train.py:8:load", 8 * kMiB);  // prefetch: lives across one boundary
      std::uint64_t loss = 0;
      for (int micro = 0; micro < loop_.micro_batches; ++micro) {
        std::vector<std::uint64_t> activations;
        for (int i = 0; i < 20; ++i) activations.push_back(alloc(sink, "model.py:50:forward", 32 * kMiB));
        if (micro > 0) free(sink, loss);
        loss = alloc(sink, "train.py:12:train", 512);
        if (micro == 0 && loop_.leak_from >= 0 && s >= loop_.leak_from &&
            (s - loop_.leak_from) % loop_.leak_every == 0) {
          if (loop_.workspace_at_leak && s == loop_.leak_from) alloc(sink, "train.py:20:train", 64 * kMiB);
          alloc(sink, "train.py:20:train", kMiB / 2);
        }
        if (micro == 0 && s < loop_.cache_until) alloc(sink, "cache.py:5:get", kMiB);
        for (int i = 19; i >= 0; --i) {
          const std::uint64_t grad = alloc(sink, "", 32 * kMiB);  // backward: no user frame
          free(sink, activations[static_cast<std::size_t>(i)]);
          free(sink, grad);
        }
      }
      if (s == 0)
        for (int i = 0; i < 20; ++i) alloc(sink, "optim.py:30:step", 16 * kMiB);  // optimizer state
      free(sink, loss);
      free(sink, batch);
      step(sink);
    }
    if (!teardown) return;
    for (std::uint64_t addr : std::vector<std::uint64_t>(live_.begin(), live_.end())) free(sink, addr);
  }

  trace::Trace& trace() { return trace_; }

 private:
  template <class Sink>
  std::uint64_t alloc(Sink& sink, const std::string& site, std::uint64_t size) {
    const std::uint64_t addr = next_addr_;
    next_addr_ += size + 512;
    live_.push_back(addr);
    sink.alloc(*this, addr, size, site, ++time_);
    return addr;
  }
  template <class Sink>
  void free(Sink& sink, std::uint64_t addr) {
    live_.erase(std::find(live_.begin(), live_.end(), addr));
    sink.free(*this, addr, ++time_);
  }
  template <class Sink>
  void step(Sink& sink) {
    sink.step(++time_);
  }

 public:
  void add(trace::Action action, std::uint64_t addr, std::uint64_t size, const std::string& site, std::int64_t time) {
    trace::Event e;
    e.action = action;
    e.addr = addr;
    e.size = size;
    e.time_us = time;
    if (!site.empty()) {
      e.user_frame = static_cast<std::uint32_t>(trace_.frames.size());
      trace_.frames.push_back(site);
    }
    trace_.events.push_back(e);
  }

 private:
  Loop loop_;
  trace::Trace trace_;
  std::vector<std::uint64_t> live_;
  std::uint64_t next_addr_ = 1 << 30;
  std::int64_t time_ = 1000;
};

// Feeds the detector directly, with a marker at every step end.
struct DetectorSink {
  LeakDetector detector;
  void alloc(Program&, std::uint64_t addr, std::uint64_t size, const std::string& site, std::int64_t t) {
    detector.on_alloc(addr, size, site.empty() ? "<backward>" : site, t, site);
  }
  void free(Program&, std::uint64_t addr, std::int64_t) { detector.on_free(addr); }
  void step(std::int64_t t) { detector.on_step(t); }
};

// Writes a PyTorch-like trace: no step markers.
struct TraceSink {
  void alloc(Program& p, std::uint64_t addr, std::uint64_t size, const std::string& site, std::int64_t t) {
    p.add(trace::Action::alloc, addr, size, site, t);
  }
  void free(Program& p, std::uint64_t addr, std::int64_t t) { p.add(trace::Action::free_requested, addr, 0, "", t); }
  void step(std::int64_t) {}
};

std::vector<LeakFinding> with_markers(const Loop& loop) {
  Program program(loop);
  DetectorSink sink;
  program.run(sink, false);  // asked while the program runs
  return sink.detector.findings();
}

LeakReport without_markers(const Loop& loop) {
  Program program(loop);
  TraceSink sink;
  program.run(sink, true);
  program.trace().name = "synthetic";
  return find_leaks(program.trace());
}

TEST(LeakDetectorSynthetic, SteadyLoopWithOptimizerStateIsClean) {
  EXPECT_TRUE(with_markers(Loop{}).empty());
  const LeakReport report = without_markers(Loop{});
  EXPECT_EQ(report.periods, 29u) << report.period_source;
  EXPECT_TRUE(report.leaks.empty()) << format_leaks(report);
}

TEST(LeakDetectorSynthetic, LateLeakIsFlaggedFromItsFirstStep) {
  Loop loop;
  loop.leak_from = 18;
  const auto leaks = with_markers(loop);
  ASSERT_EQ(leaks.size(), 1u);
  EXPECT_EQ(leaks[0].site, "train.py:20:train");
  EXPECT_EQ(leaks[0].bytes_per_step, static_cast<std::int64_t>(kMiB / 2));
  EXPECT_EQ(leaks[0].first_step, 18u);
  EXPECT_EQ(leaks[0].sample.size, kMiB / 2);

  const LeakReport report = without_markers(loop);
  ASSERT_EQ(report.leaks.size(), 1u) << format_leaks(report);
  EXPECT_EQ(report.leaks[0].site, "train.py:20:train");
  EXPECT_EQ(report.leaks[0].bytes_per_step, static_cast<std::int64_t>(kMiB / 2));
}

TEST(LeakDetectorSynthetic, CacheThatPlateausIsNotFlagged) {
  Loop loop;
  loop.cache_until = 12;
  EXPECT_TRUE(with_markers(loop).empty());
  EXPECT_TRUE(without_markers(loop).leaks.empty());
}

TEST(LeakDetectorSynthetic, CacheStillGrowingAtTheEndIsFlagged) {
  Loop loop;
  loop.cache_until = loop.steps;  // never stops: indistinguishable from a leak, and reported
  const auto leaks = with_markers(loop);
  ASSERT_EQ(leaks.size(), 1u);
  EXPECT_EQ(leaks[0].site, "cache.py:5:get");
  EXPECT_EQ(leaks[0].bytes_per_step, static_cast<std::int64_t>(kMiB));
}

TEST(LeakDetectorSynthetic, LeakNextToAPlateauedCacheIsTheOnlyFinding) {
  Loop loop;
  loop.cache_until = 10;
  loop.leak_from = 5;
  const LeakReport report = without_markers(loop);
  ASSERT_EQ(report.leaks.size(), 1u) << format_leaks(report);
  EXPECT_EQ(report.leaks[0].site, "train.py:20:train");
}

TEST(LeakDetectorSynthetic, LeakEveryOtherStepAveragesPerStep) {
  Loop loop;
  loop.leak_from = 4;
  loop.leak_every = 2;
  const auto leaks = with_markers(loop);
  ASSERT_EQ(leaks.size(), 1u);
  // 13 leaked blocks counted (steps 4..28) over the 25 steps since: about half a block a step.
  EXPECT_NEAR(static_cast<double>(leaks[0].bytes_per_step), kMiB / 4.0, kMiB / 40.0);
}

TEST(LeakDetectorSynthetic, GradientAccumulationLeakIsFoundAtItsRhythm) {
  Loop loop;
  loop.micro_batches = 4;  // without markers, each micro-batch looks like a step
  loop.leak_from = 6;
  const LeakReport report = without_markers(loop);
  EXPECT_GE(report.periods, 4u * 29u);
  ASSERT_EQ(report.leaks.size(), 1u) << format_leaks(report);
  EXPECT_EQ(report.leaks[0].site, "train.py:20:train");
  // Half a MiB a step is an eighth of a MiB per micro-batch period.
  EXPECT_NEAR(static_cast<double>(report.leaks[0].bytes_per_step), kMiB / 8.0, kMiB / 80.0);

  loop.leak_from = -1;
  loop.cache_until = 10;
  EXPECT_TRUE(without_markers(loop).leaks.empty());
}

TEST(LeakDetectorSynthetic, OneOffWorkspaceAtTheLeakingSiteIsNotGrowth) {
  Loop loop;
  loop.leak_from = 10;
  loop.workspace_at_leak = true;
  const auto leaks = with_markers(loop);
  ASSERT_EQ(leaks.size(), 1u);
  EXPECT_EQ(leaks[0].bytes_per_step, static_cast<std::int64_t>(kMiB / 2));
  EXPECT_EQ(leaks[0].first_step, 10u);
  EXPECT_EQ(leaks[0].sample.size, kMiB / 2);  // a leaked block, not the workspace
}

TEST(LeakDetectorSynthetic, TooFewStepsIsNoTrend) {
  Loop loop;
  loop.steps = 3;  // two growth steps at most: not yet a trend
  loop.leak_from = 0;
  EXPECT_TRUE(with_markers(loop).empty());
}

TEST(LeakDetectorOnline, FreesOfUnknownAddressesAndReusedAddressesAreHandled) {
  LeakDetector detector;
  detector.on_free(12345);  // allocated before tracking began
  detector.on_alloc(1, 100, "a", 0);
  detector.on_alloc(1, 200, "b", 1);  // its free was missed
  EXPECT_EQ(detector.live_count(), 1u);
  detector.on_free(1);
  EXPECT_EQ(detector.live_count(), 0u);
  detector.on_step(2);
  EXPECT_EQ(detector.steps(), 1u);
}

TEST(LeakDetectorOnline, HistoryClearedEveryFewStepsIsNotALeak) {
  LeakDetector detector;
  std::vector<std::uint64_t> kept;
  for (int s = 0; s < 20; ++s) {
    kept.push_back(1000 + static_cast<std::uint64_t>(s));
    detector.on_alloc(kept.back(), 4096, "history.py:1:append", s);
    if (s % 8 == 7) {  // logged and cleared: a bounded history, not a leak
      for (std::uint64_t addr : kept) detector.on_free(addr);
      kept.clear();
    }
    detector.on_step(s);
  }
  EXPECT_TRUE(detector.findings().empty());
}

TEST(LeakDetectorOnline, GrowthBeyondAnEarlierDropIsALeak) {
  LeakDetector detector;
  for (int s = 0; s < 20; ++s) {
    detector.on_alloc(1000 + static_cast<std::uint64_t>(s), 4096, "history.py:1:append", s);
    if (s == 3)  // cleared once, then never again
      for (std::uint64_t addr = 1000; addr <= 1003; ++addr) detector.on_free(addr);
    detector.on_step(s);
  }
  const auto leaks = detector.findings();
  ASSERT_EQ(leaks.size(), 1u);
  EXPECT_EQ(leaks[0].bytes_per_step, 4096);
}

TEST(LeakReportFormat, JsonHasTheRequiredFields) {
  Loop loop;
  loop.leak_from = 3;
  const std::string json = leaks_json(without_markers(loop));
  for (const char* field : {"\"leaks\":[{", "\"site\":\"train.py:20:train\"", "\"bytes_per_step\":524288",
                            "\"surviving_bytes\":", "\"first_seen_us\":", "\"sample\":{"})
    EXPECT_NE(json.find(field), std::string::npos) << field << " in " << json;
}

}  // namespace
}  // namespace gmem
