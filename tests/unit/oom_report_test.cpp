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
#include "temp_files.hpp"

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

LeakFinding leak_at(const char* site, std::size_t per_step, std::size_t steps) {
  LeakFinding leak;
  leak.site = site;
  leak.bytes_per_step = static_cast<std::int64_t>(per_step);
  leak.surviving_bytes = static_cast<std::int64_t>(per_step * steps);
  leak.periods = steps;
  leak.growing_periods = steps;
  return leak;
}

TEST(OomReport, SmallLeakIsListedButNotBlamed) {
  // 40 MiB kept of 1 GiB live, 1 GiB short: a smaller batch is the fix, the leak comes second.
  const OomReport r = build_oom_report(info(GiB, GiB, 0, 0, GiB, GiB), some_live(),
                                       {leak_at("capture.py:67:run", 4 * MiB, 10)}, true, 0);
  EXPECT_NE(r.cause, "leak");
  ASSERT_GE(r.advice.size(), 2u);
  EXPECT_NE(r.advice[0].find("smaller batch"), std::string::npos) << r.advice[0];
  EXPECT_NE(r.advice[1].find("capture.py:67:run"), std::string::npos) << r.advice[1];
  EXPECT_NE(to_text(r).find("Leak suspects"), std::string::npos);
}

// The case: a loop keeping 22 MiB a step under a 3 GiB cap; at the failure the request
// fits under the limit but not in one range. The leak is the cause, not the fragmentation.
TEST(OomCause, LeakBeatsFragmentation) {
  const OomInfo i = info(64 * MiB, 3 * GiB, 0, 0, 3 * GiB, 3 * GiB - 93 * MiB);
  const OomReport leaking = build_oom_report(i, {}, {leak_at("infer.py:12:run", 22 * MiB, 66)}, true, 66);
  EXPECT_EQ(leaking.cause, "leak");
  EXPECT_NE(leaking.explanation.find("infer.py:12:run keeps +22.00 MiB a step"), std::string::npos)
      << leaking.explanation;
  ASSERT_FALSE(leaking.advice.empty());
  EXPECT_NE(leaking.advice[0].find("infer.py:12:run"), std::string::npos);
  EXPECT_NE(leaking.advice[0].find("torch.no_grad()"), std::string::npos);
  EXPECT_NE(leaking.advice[0].find(".detach()"), std::string::npos);
  // The same numbers without the leak: fragmentation, with its evidence.
  const OomReport clean = build_oom_report(i, {}, {}, true, 66);
  EXPECT_EQ(clean.cause, "fragmentation");
  EXPECT_NE(clean.explanation.find("leak test found nothing"), std::string::npos);
  EXPECT_TRUE(mentions({clean.advice.front()}, "persistent buffers"));
}

// The same loop with graph tracking: the kept memory was saved for a backward that never ran.
TEST(OomCause, GraphKeptAliveNamesTheFixForInferenceAndForAKeptLoss) {
  const OomInfo i = info(64 * MiB, 3 * GiB, 0, 0, 3 * GiB, 3 * GiB - 93 * MiB);
  LeakFinding inference = leak_at("infer.py:12:run", 22 * MiB, 66);
  inference.graph_bytes = inference.surviving_bytes - 66 * MiB;  // the outputs themselves are not saved
  const OomReport r = build_oom_report(i, {}, {inference}, true, 66);
  EXPECT_EQ(r.cause, "graph kept alive");
  EXPECT_NE(r.explanation.find("no backward pass has run"), std::string::npos) << r.explanation;
  EXPECT_NE(r.explanation.find("infer.py:12:run keeps +22.00 MiB a step"), std::string::npos);
  ASSERT_FALSE(r.advice.empty());
  EXPECT_EQ(r.advice[0].rfind("Run inference under torch.no_grad()", 0), 0u) << r.advice[0];
  EXPECT_NE(to_text(r).find("saved for a backward pass that never used it"), std::string::npos);
  EXPECT_NE(to_json(r).find("\"graph_bytes\""), std::string::npos);

  LeakFinding loss = inference;
  loss.site = "train.py:80:validate";
  loss.backward_runs = true;
  const OomReport kept = build_oom_report(i, {}, {loss}, true, 66);
  EXPECT_EQ(kept.cause, "graph kept alive");
  EXPECT_NE(kept.explanation.find("backward passes run, but not for these"), std::string::npos);
  EXPECT_EQ(kept.advice[0].rfind("Keep loss.item() or tensor.detach()", 0), 0u) << kept.advice[0];

  // A plain cache growing as fast (no saved tensors) stays a leak, with the cache's advice.
  const OomReport cache = build_oom_report(i, {}, {leak_at("cache.py:5:remember", 22 * MiB, 66)}, true, 66);
  EXPECT_EQ(cache.cause, "leak");
  // Where a graph and a bigger plain leak grow together, the larger share decides.
  LeakFinding small_graph = leak_at("infer.py:12:run", 2 * MiB, 66);
  small_graph.graph_bytes = small_graph.surviving_bytes;
  const OomReport mixed = build_oom_report(i, {}, {leak_at("cache.py:5:remember", 20 * MiB, 66), small_graph}, true, 66);
  EXPECT_EQ(mixed.cause, "leak");
  EXPECT_TRUE(mentions(mixed.advice, "torch.no_grad()"));
}

TEST(OomCause, LeakHoldingTheShortfallIsBlamed) {
  // 8 GiB limit, 7.5 live, 1 asked: 0.5 short; the leak keeps 0.6 GiB (8% of live) > shortfall.
  const OomReport r = build_oom_report(info(GiB, 8 * GiB, 0, 0, 8 * GiB, 7 * GiB + GiB / 2), {},
                                       {leak_at("train.py:40:step", 60 * MiB, 10)}, true, 10);
  EXPECT_EQ(r.cause, "leak");
  EXPECT_NE(r.explanation.find("more than the 512.00 MiB the request was short"), std::string::npos)
      << r.explanation;
}

std::vector<LiveAllocation> steps_live(std::size_t kept, std::size_t this_step, std::uint64_t step) {
  std::vector<LiveAllocation> live(2);
  live[0].addr = 0x1000;
  live[0].size = kept;
  live[0].step = 0;
  live[1].addr = 0x2000000;
  live[1].size = this_step;
  live[1].step = step;
  return live;
}

TEST(OomCause, BatchTooLargeWhenThisStepHoldsTheShortfall) {
  // 2 GiB of weights, 5 GiB of this step's activations, 2 GiB more asked of an 8 GiB limit.
  const OomReport r = build_oom_report(info(2 * GiB, 8 * GiB, 0, 0, 7 * GiB, 7 * GiB),
                                       steps_live(2 * GiB, 5 * GiB, 4), {}, true, 4);
  EXPECT_EQ(r.cause, "batch too large");
  EXPECT_EQ(r.step_bytes, 5 * GiB);
  EXPECT_NE(r.explanation.find("this step's allocations hold 5.00 GiB"), std::string::npos) << r.explanation;
  EXPECT_NE(r.advice.front().find("smaller batch"), std::string::npos);
  // ... and how to find the largest batch that fits, in one line the user can run.
  EXPECT_NE(r.advice.front().find("gmem.fit_batch_size(step)"), std::string::npos) << r.advice.front();
}

TEST(OomCause, ModelTooLargeWhenEarlierStepsHoldIt) {
  // 7 GiB kept since step 0, 0.5 GiB this step, 2 GiB asked: a smaller batch cannot help.
  const OomReport r = build_oom_report(info(2 * GiB, 8 * GiB, 0, 0, 8 * GiB, 7 * GiB + GiB / 2),
                                       steps_live(7 * GiB, GiB / 2, 4), {}, true, 4);
  EXPECT_EQ(r.cause, "model and state too large");
  EXPECT_NE(r.advice.front().find("shard the optimizer state"), std::string::npos);
}

TEST(OomCause, WithoutStepsLiveMemoryAsksForMarkers) {
  const OomReport r = build_oom_report(info(2 * GiB, 8 * GiB, 0, 0, 7 * GiB, 7 * GiB),
                                       steps_live(2 * GiB, 5 * GiB, 0), {}, true, 0);
  EXPECT_EQ(r.cause, "live memory");
  EXPECT_NE(r.explanation.find("no step markers"), std::string::npos);
  EXPECT_TRUE(mentions(r.advice, "gmem.torch.watch(optimizer)"));
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
  const gmem::testing::TempPath path("oom_report.json");
  std::ofstream(path.str()) << to_json(r);
  const std::string check =
      "python3 -c \"import json,sys; d=json.load(open(sys.argv[1])); "
      "assert d['request']['size']==2*2**30 and d['limit']==8*2**30; "
      "assert d['device']=={'total':80*2**30,'free':70*2**30,'held_outside_gmem':3*2**30}; "
      "assert d['cause']=='live memory' and d['tracked'] is True; "
      "assert d['by_scope'][0]=={'key':'model.h.0.mlp','bytes':400*2**20,'count':2}; "
      "assert len(d['largest'])==10 and d['largest'][0]['site']=='a.py:5:forward'; "
      "assert any('checkpointing' in a for a in d['advice'])\" " +
      path.str();
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
