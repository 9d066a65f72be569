// OOM reports: the cause from the numbers, the breakdowns, the advice, the two formats, and a
// real OOM from the engine with a tracker attached.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "gmem/engine.hpp"
#include "gmem/oom_report.hpp"
#include "gmem/scope.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/tracker.hpp"

namespace gmem {
namespace {

constexpr std::size_t GiB = std::size_t{1} << 30;
constexpr std::size_t MiB = std::size_t{1} << 20;

bool mentions(const std::vector<std::string>& lines, const std::string& part) {
  for (const std::string& line : lines)
    if (line.find(part) != std::string::npos) return true;
  return false;
}

OomInfo info(std::size_t requested, std::size_t limit, std::size_t total, std::size_t free,
             std::size_t reserved, std::size_t allocated) {
  OomInfo i;
  i.requested = requested;
  i.limit = limit;
  i.device_total = total;
  i.device_free = free;
  i.reserved = reserved;
  i.allocated = allocated;
  i.largest_free_range = 64 * MiB;
  i.reason = "limit";
  return i;
}

TEST(OomCause, LiveMemoryOverTheLimit) {
  const OomReport r = build_oom_report(info(2 * GiB, 8 * GiB, 80 * GiB, 70 * GiB, 7 * GiB, 7 * GiB), {});
  EXPECT_EQ(r.cause, "live memory");
  EXPECT_NE(r.explanation.find("limit"), std::string::npos);
  EXPECT_EQ(r.held_outside, 3 * GiB);  // 80 - 70 - 7
  EXPECT_TRUE(mentions(r.advice, "smaller batch"));
  EXPECT_TRUE(mentions(r.advice, "torch.no_grad()"));
  EXPECT_TRUE(mentions(r.advice, "checkpointing"));
  EXPECT_TRUE(mentions(r.advice, "Drop references"));
  EXPECT_TRUE(mentions(r.advice, "raise it with set_memory_limit"));  // limit below the device
}

TEST(OomCause, MemoryHeldByOthers) {
  // A 16 GiB device shared: gmem holds 6, others 9, 1 free; 6 live + 2 asked fits in 16.
  const OomReport r = build_oom_report(info(2 * GiB, 16 * GiB, 16 * GiB, GiB, 6 * GiB, 6 * GiB), {});
  EXPECT_EQ(r.held_outside, 9 * GiB);
  EXPECT_EQ(r.cause, "memory held outside gmem");
  EXPECT_TRUE(mentions(r.advice, "nvidia-smi"));
  EXPECT_TRUE(mentions(r.advice, "set_memory_limit"));
  EXPECT_TRUE(mentions(r.advice, "NCCL"));
}

TEST(OomCause, ContextAloneIsNotBlamed) {
  // Only the CUDA context (0.5 GiB) is outside gmem, and the program needs more than the device.
  const OomReport r = build_oom_report(
      info(GiB, 16 * GiB, 16 * GiB, GiB / 5, 16 * GiB - GiB / 2 - GiB / 5, 15 * GiB), {});
  EXPECT_EQ(r.cause, "live memory");
  EXPECT_NE(r.explanation.find("device"), std::string::npos);
  EXPECT_FALSE(mentions(r.advice, "raise it"));  // the limit is the device's: nothing to raise
}

TEST(OomCause, Fragmentation) {
  // 5 GiB live of an 8 GiB limit, all 8 held: 1 GiB more would fit, but not as one range.
  const OomReport r = build_oom_report(info(GiB, 8 * GiB, 80 * GiB, 60 * GiB, 8 * GiB, 5 * GiB), {});
  EXPECT_EQ(r.cause, "fragmentation");
  EXPECT_EQ(r.free_in_gmem, 3 * GiB);
  EXPECT_TRUE(mentions(r.advice, "headroom"));
}

std::vector<LiveAllocation> some_live() {
  std::vector<LiveAllocation> live;
  auto add = [&](const char* scope, const char* site, std::size_t size, std::uint64_t step) {
    LiveAllocation a;
    a.addr = 0x10000 + live.size() * 0x100000;
    a.size = size;
    a.step = step;
    a.scope = scopes::intern(scope);
    a.frames = frames::intern(site);
    live.push_back(a);
  };
  add("model.h.0.mlp", "m.py:10:forward", 300 * MiB, 1);
  add("model.h.0.mlp", "m.py:10:forward", 100 * MiB, 1);
  add("model.h.1.attn", "a.py:5:forward", 350 * MiB, 2);
  for (int i = 0; i < 12; ++i) add("optimizer", "o.py:3:step", MiB, 0);
  return live;
}

TEST(OomReport, BreaksLiveMemoryDown) {
  const OomReport r = build_oom_report(info(GiB, GiB, 0, 0, 800 * MiB, 762 * MiB), some_live());
  ASSERT_EQ(r.by_scope.size(), 3u);
  EXPECT_EQ(r.by_scope[0].key, "model.h.0.mlp");
  EXPECT_EQ(r.by_scope[0].bytes, 400 * MiB);
  EXPECT_EQ(r.by_scope[0].count, 2u);
  EXPECT_EQ(r.by_scope[1].key, "model.h.1.attn");
  EXPECT_EQ(r.by_scope[2].key, "optimizer");
  EXPECT_EQ(r.by_scope[2].count, 12u);
  ASSERT_EQ(r.by_site.size(), 3u);
  EXPECT_EQ(r.by_site[0].key, "m.py:10:forward");
  ASSERT_EQ(r.largest.size(), 10u);  // capped
  EXPECT_EQ(r.largest[0].size, 350 * MiB);
  EXPECT_EQ(r.largest[0].scope, "model.h.1.attn");
  EXPECT_EQ(r.largest[0].site, "a.py:5:forward");
  EXPECT_EQ(r.largest[1].size, 300 * MiB);
  EXPECT_EQ(r.largest[9].size, MiB);
  EXPECT_EQ(r.held_outside, 0u);  // device unknown
}

TEST(OomReport, LeakSuspectsComeFirstInTheAdvice) {
  LeakFinding leak;
  leak.site = "capture.py:67:run";
  leak.bytes_per_step = 4 * MiB;
  leak.surviving_bytes = 40 * MiB;
  leak.periods = 10;
  const OomReport r =
      build_oom_report(info(GiB, GiB, 0, 0, GiB, GiB), some_live(), std::vector<LeakFinding>{leak});
  ASSERT_FALSE(r.advice.empty());
  EXPECT_NE(r.advice[0].find("capture.py:67:run"), std::string::npos);
  EXPECT_NE(to_text(r).find("Leak suspects"), std::string::npos);
}

TEST(OomReport, TextCarriesTheNumbers) {
  const OomReport r = build_oom_report(info(2 * GiB, 8 * GiB, 80 * GiB, 70 * GiB, 7 * GiB, 7 * GiB),
                                       some_live());
  const std::string text = to_text(r);
  for (const char* part : {"tried to allocate 2.00 GiB", "cause: live memory", "limit 8.00 GiB",
                           "7.00 GiB reserved", "80.00 GiB total", "70.00 GiB free",
                           "3.00 GiB held outside gmem", "largest free range 64.00 MiB",
                           "Live memory by scope:", "model.h.0.mlp", "Largest live allocations:",
                           "What to do:"})
    EXPECT_NE(text.find(part), std::string::npos) << part << "\n" << text;
  const std::string untracked = to_text(build_oom_report(r.info, nullptr));
  EXPECT_NE(untracked.find("enable tracking"), std::string::npos);
  EXPECT_EQ(untracked.find("by scope"), std::string::npos);
}

bool have_python() { return std::system("python3 -c pass >/dev/null 2>&1") == 0; }

TEST(OomReport, JsonIsValidAndComplete) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: JSON validity not checked";
  const OomReport r = build_oom_report(info(2 * GiB, 8 * GiB, 80 * GiB, 70 * GiB, 7 * GiB, 7 * GiB),
                                       some_live());
  const std::string path = testing::TempDir() + "oom_report.json";
  std::ofstream(path) << to_json(r);
  const std::string check =
      "python3 -c \"import json,sys; d=json.load(open(sys.argv[1])); "
      "assert d['request']['size']==2*2**30 and d['limit']==8*2**30; "
      "assert d['device']=={'total':80*2**30,'free':70*2**30,'held_outside_gmem':3*2**30}; "
      "assert d['cause']=='live memory' and d['tracked'] is True; "
      "assert d['by_scope'][0]=={'key':'model.h.0.mlp','bytes':400*2**20,'count':2}; "
      "assert len(d['largest'])==10 and d['largest'][0]['site']=='a.py:5:forward'; "
      "assert any('checkpointing' in a for a in d['advice'])\" " +
      path;
  EXPECT_EQ(std::system(check.c_str()), 0);
}

TEST(OomReport, FromARealOomWithATracker) {
  SimulatedDevice device(SimDeviceOptions{GiB});
  EngineOptions options;
  options.memory_limit = 256 * MiB;
  Engine engine(device, options);
  Tracker tracker(engine);
  std::vector<void*> kept;
  OomInfo seen;
  bool failed = false;
  {
    Scope scope("model.h.3.mlp");
    try {
      for (int i = 0; i < 100; ++i) kept.push_back(engine.malloc(40 * MiB, 0));
    } catch (const OutOfMemoryError& e) {
      seen = e.info();
      failed = true;
    }
  }
  ASSERT_TRUE(failed);
  ASSERT_TRUE(tracker.last_oom().has_value());
  EXPECT_EQ(tracker.last_oom()->requested, seen.requested);
  const OomReport r = build_oom_report(seen, &tracker);
  EXPECT_EQ(r.cause, "live memory");
  EXPECT_EQ(r.info.limit, 256 * MiB);
  ASSERT_FALSE(r.by_scope.empty());
  EXPECT_EQ(r.by_scope[0].key, "model.h.3.mlp");
  EXPECT_EQ(r.by_scope[0].count, kept.size());
  EXPECT_EQ(r.by_scope[0].bytes, kept.size() * 40 * MiB);
  bool logged = false;
  for (const HistoryEvent& e : tracker.state().history) logged = logged || e.kind == EventKind::oom;
  EXPECT_TRUE(logged);
  for (void* p : kept) engine.free(p);
}

}  // namespace
}  // namespace gmem
