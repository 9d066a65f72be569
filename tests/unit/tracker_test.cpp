// The tracker, scopes and call sites: what an engine records per allocation while a tracker is
// attached, the bounded history, the engine's events, leak suspects, grouping, attaching and
// detaching, and use from several threads.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/scope.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/tracker.hpp"

namespace gmem {
namespace {

std::int64_t wall_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// --- scopes ------------------------------------------------------------------------------------

TEST(Scopes, NestAndPop) {
  ASSERT_EQ(scopes::depth(), 0u);
  EXPECT_EQ(scopes::current(), 0u);
  scopes::push("train");
  scopes::push("forward");
  EXPECT_EQ(scopes::path(scopes::current()), "train/forward");
  EXPECT_EQ(scopes::depth(), 2u);
  scopes::pop();
  EXPECT_EQ(scopes::path(scopes::current()), "train");
  scopes::pop();
  scopes::pop();  // one too many: harmless
  EXPECT_EQ(scopes::current(), 0u);
  EXPECT_EQ(scopes::path(0), "");
}

TEST(Scopes, SamePathSameId) {
  scopes::push("a");
  scopes::push("b");
  const ScopeId first = scopes::current();
  scopes::pop_to(0);
  EXPECT_EQ(scopes::intern("a/b"), first);
  EXPECT_NE(scopes::intern("a/c"), first);
}

TEST(Scopes, ModulesReplaceEnclosingModules) {
  Scope train("train");
  scopes::push_module("model");
  scopes::push_module("model.encoder");
  scopes::push_module("model.encoder.layer.0");
  EXPECT_EQ(scopes::path(scopes::current()), "train/model.encoder.layer.0");
  {
    Scope inner("attention_scores");  // a user scope inside a module nests
    EXPECT_EQ(scopes::path(scopes::current()), "train/model.encoder.layer.0/attention_scores");
    scopes::push_module("model.encoder.layer.0.attn");  // a module inside a user scope nests
    EXPECT_EQ(scopes::path(scopes::current()),
              "train/model.encoder.layer.0/attention_scores/model.encoder.layer.0.attn");
  }  // the RAII scope also leaves what was entered inside it and not left
  EXPECT_EQ(scopes::path(scopes::current()), "train/model.encoder.layer.0");
  scopes::pop();
  EXPECT_EQ(scopes::path(scopes::current()), "train/model.encoder");
  scopes::pop_to(1);
  EXPECT_EQ(scopes::path(scopes::current()), "train");
}

TEST(Scopes, PerThread) {
  Scope outer("main_thread_scope");
  ScopeId seen = 99;
  std::thread([&] { seen = scopes::current(); }).join();
  EXPECT_EQ(seen, 0u);
  EXPECT_NE(scopes::current(), 0u);
}

TEST(Scopes, EmptyNameRejected) {
  EXPECT_THROW(scopes::push(""), Error);
  EXPECT_THROW(scopes::push_module(""), Error);
  EXPECT_EQ(scopes::depth(), 0u);
}

// --- call sites --------------------------------------------------------------------------------

TEST(Frames, ParsesPythonStyleLines) {
  const FramesId id = frames::intern("train.py:42:step\nns::f.py:7:outer::inner\nno line here");
  const std::vector<Frame> f = frames::get(id);
  ASSERT_EQ(f.size(), 3u);
  EXPECT_EQ(f[0].filename, "train.py");
  EXPECT_EQ(f[0].line, 42);
  EXPECT_EQ(f[0].name, "step");
  EXPECT_EQ(f[1].filename, "ns::f.py");
  EXPECT_EQ(f[1].line, 7);
  EXPECT_EQ(f[1].name, "outer::inner");
  EXPECT_EQ(f[2].name, "no line here");
  EXPECT_EQ(frames::intern("train.py:42:step\nns::f.py:7:outer::inner\nno line here"), id);
  EXPECT_EQ(frames::intern(""), 0u);
  EXPECT_TRUE(frames::get(0).empty());
}

[[gnu::noinline]] FramesId capture_here() { return frames::capture_backtrace(0, 8); }

TEST(Frames, BacktraceIsCapturedAndInterned) {
  const FramesId a = capture_here();
  ASSERT_NE(a, 0u);
  EXPECT_FALSE(frames::get(a).empty());
  // Two captures from one call site are one stack; from another site, another.
  FramesId same[2];
  static volatile int two = 2;  // an unknown trip count: the loop stays one call site
  for (int i = 0, n = two; i < n && i < 2; ++i) same[i] = capture_here();
  EXPECT_EQ(same[0], same[1]);
  EXPECT_NE(frames::capture_backtrace(0, 8), same[0]);
}

// --- the tracker, attached to an engine ---------------------------------------------------------

constexpr std::size_t kMiB = std::size_t{1} << 20;

class TrackerTest : public ::testing::Test {
 protected:
  SimulatedDevice device{SimDeviceOptions{std::size_t{1} << 30}};
  Engine engine{device};
  void TearDown() override { frames::set_current(""); }
};

std::uintptr_t addr_of(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

TEST_F(TrackerTest, RecordsEachLiveAllocation) {
  Tracker tracker(engine);
  const std::int64_t before = wall_now_ns();
  frames::set_current("model.py:10:forward");
  void* a = nullptr;
  {
    Scope scope("forward");
    a = engine.malloc(1000, 7);
  }
  frames::set_current("");
  tracker.step();
  void* b = engine.malloc(3 * kMiB, 0);
  const std::int64_t after = wall_now_ns();

  const TrackerState s = tracker.state();
  ASSERT_EQ(s.live.size(), 2u);
  const bool a_first = addr_of(a) < addr_of(b);  // live allocations come by address
  const LiveAllocation& la = s.live[a_first ? 0 : 1];
  const LiveAllocation& lb = s.live[a_first ? 1 : 0];
  EXPECT_EQ(la.addr, addr_of(a));
  EXPECT_EQ(la.id, 1u);
  EXPECT_EQ(la.size, engine.block_info(a).size);  // as the engine rounded it
  EXPECT_EQ(la.size, 1024u);
  EXPECT_EQ(la.requested, 1000u);
  EXPECT_EQ(la.stream, 7u);
  EXPECT_EQ(la.step, 0u);
  EXPECT_EQ(scopes::path(la.scope), "forward");
  EXPECT_EQ(frames::to_text(la.frames), "model.py:10:forward");
  EXPECT_GE(la.time_ns, before - 2'000'000);  // the TSC conversion is good to well under 2 ms
  EXPECT_LE(la.time_ns, after + 2'000'000);
  EXPECT_EQ(lb.addr, addr_of(b));
  EXPECT_EQ(lb.id, 2u);
  EXPECT_EQ(lb.size, 3 * kMiB);
  EXPECT_EQ(lb.step, 1u);
  EXPECT_EQ(lb.scope, 0u);
  EXPECT_EQ(lb.frames, 0u);
  EXPECT_GE(lb.time_ns, la.time_ns);
  EXPECT_EQ(tracker.live_count(), 2u);
  EXPECT_EQ(tracker.live_bytes(), 1024u + 3 * kMiB);
  EXPECT_EQ(s.allocations, 2u);
  engine.free(a);
  engine.free(b);
  EXPECT_EQ(tracker.live_count(), 0u);
}

TEST_F(TrackerTest, FreesAreLoggedWithTheirSite) {
  Tracker tracker(engine);
  void* p = engine.malloc(2000, 3);
  frames::set_current("loop.py:5:cleanup");
  engine.free(p);
  frames::set_current("");
  EXPECT_THROW(engine.free(p), Error);  // the engine still checks, and nothing is logged
  EXPECT_EQ(tracker.live_count(), 0u);
  const TrackerState s = tracker.state();
  EXPECT_EQ(s.untracked_frees, 0u);
  std::vector<HistoryEvent> blocks;  // leave out the maps
  for (const HistoryEvent& e : s.history)
    if (e.kind == EventKind::alloc || e.kind == EventKind::free) blocks.push_back(e);
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(blocks[0].kind, EventKind::alloc);
  const HistoryEvent& f = blocks[1];
  EXPECT_EQ(f.kind, EventKind::free);
  EXPECT_EQ(f.addr, addr_of(p));
  EXPECT_EQ(f.size, 2048u);  // the block's size
  EXPECT_EQ(f.stream, 3u);
  EXPECT_EQ(f.id, 1u);
  EXPECT_EQ(frames::to_text(f.frames), "loop.py:5:cleanup");  // where it was freed
  EXPECT_GE(f.time_ns, blocks[0].time_ns);
}

TEST_F(TrackerTest, BlocksFromBeforeAttachingAreNotTracked) {
  void* before = engine.malloc(4096, 0);
  {
    Tracker first(engine);
    void* during = engine.malloc(4096, 0);
    EXPECT_EQ(first.live_count(), 1u);
    engine.free(before);  // allocated untracked: counted, not logged as a tracked free
    EXPECT_EQ(first.state().untracked_frees, 1u);
    before = during;      // live on after `first` is gone
  }
  Tracker second(engine);
  EXPECT_EQ(second.live_count(), 0u);  // the first tracker's blocks are not the second's
  engine.free(before);
  const TrackerState s = second.state();
  EXPECT_EQ(s.untracked_frees, 1u);
  EXPECT_EQ(s.allocations, 0u);
  for (const HistoryEvent& e : s.history) EXPECT_NE(e.kind, EventKind::free);
}

TEST_F(TrackerTest, OneTrackerPerEngine) {
  Tracker first(engine);
  EXPECT_THROW(Tracker second(engine), Error);
  first.detach();
  Tracker third(engine);  // free to attach again
  engine.free(engine.malloc(512, 0));
  EXPECT_EQ(third.state().allocations, 1u);
  EXPECT_EQ(first.state().allocations, 0u);
}

TEST_F(TrackerTest, DetachStopsRecordingAndKeepsHistory) {
  Tracker tracker(engine);
  void* p = engine.malloc(512, 0);
  tracker.annotate("before detach");
  const std::size_t events = tracker.state().history.size();
  tracker.detach();
  tracker.detach();  // twice: harmless
  engine.free(p);
  engine.free(engine.malloc(8 * kMiB, 0));
  const TrackerState s = tracker.state();
  EXPECT_EQ(s.history.size(), events);
  EXPECT_EQ(s.history.back().text, "before detach");
  EXPECT_TRUE(s.live.empty());
  EXPECT_EQ(tracker.live_count(), 0u);
}

TEST_F(TrackerTest, HistoryIsBoundedOldestDropped) {
  engine.free(engine.malloc(512, 0));  // pages mapped before tracking: no map events below
  Tracker tracker(engine, TrackerOptions{4, false, 0});
  std::vector<void*> blocks;
  for (int i = 0; i < 5; ++i) blocks.push_back(engine.malloc(512, 0));
  for (void* p : blocks) engine.free(p);
  const TrackerState s = tracker.state();
  ASSERT_EQ(s.history.size(), 4u);
  EXPECT_EQ(s.dropped_events, 6u);
  for (std::size_t i = 0; i < 4; ++i) {  // the last four frees, oldest first
    EXPECT_EQ(s.history[i].kind, EventKind::free);
    EXPECT_EQ(s.history[i].addr, addr_of(blocks[i + 1]));
  }
  tracker.detach();
  Tracker none(engine, TrackerOptions{0, false, 0});
  void* kept = engine.malloc(512, 0);
  EXPECT_TRUE(none.state().history.empty());
  EXPECT_EQ(none.live_count(), 1u);  // live allocations are kept regardless
  engine.free(kept);
}

TEST_F(TrackerTest, StepsAndAnnotationsAreEvents) {
  Tracker tracker(engine);
  tracker.annotate("epoch 1");
  tracker.step();
  tracker.step();
  EXPECT_EQ(tracker.current_step(), 2u);
  const TrackerState s = tracker.state();
  ASSERT_EQ(s.history.size(), 3u);
  EXPECT_EQ(s.history[0].kind, EventKind::annotation);
  EXPECT_EQ(s.history[0].text, "epoch 1");
  EXPECT_EQ(s.history[1].kind, EventKind::step);
  EXPECT_EQ(s.history[1].step, 1u);
  EXPECT_EQ(s.history[2].step, 2u);
  EXPECT_EQ(s.step, 2u);
}

TEST_F(TrackerTest, FollowsTheEnginesMapsUnmapsAndOoms) {
  void* early = engine.malloc(5 * kMiB, 0);  // mapped before attaching: state, not history
  Tracker tracker(engine);
  const std::size_t early_mapped = tracker.state().mapped.empty() ? 0 : tracker.state().mapped[0].second;
  EXPECT_GE(early_mapped, 5 * kMiB);
  EXPECT_TRUE(tracker.state().history.empty());

  void* big = nullptr;
  void* small = nullptr;
  {
    Scope scope("load");
    big = engine.malloc(9 * kMiB, 0);
    small = engine.malloc(1000, 0);
  }
  TrackerState s = tracker.state();
  std::size_t mapped = 0;
  for (const auto& [addr, size] : s.mapped) mapped += size;
  EXPECT_EQ(static_cast<std::int64_t>(mapped),
            engine.stats().chunks_mapped * engine.stats().granularity);
  ASSERT_FALSE(s.history.empty());
  EXPECT_EQ(s.history[0].kind, EventKind::map);  // pages mapped before the block is handed out
  std::size_t mapped_events = 0;
  for (const HistoryEvent& e : s.history)
    if (e.kind == EventKind::map) mapped_events += e.size;
  EXPECT_EQ(mapped_events + early_mapped, mapped);

  engine.free(big);
  engine.free(small);
  engine.free(early);
  engine.empty_cache();
  s = tracker.state();
  std::size_t unmapped = 0;
  for (const HistoryEvent& e : s.history)
    if (e.kind == EventKind::unmap) unmapped += e.size;
  EXPECT_EQ(unmapped, mapped);
  EXPECT_TRUE(s.mapped.empty());

  engine.set_memory_limit(64 * kMiB);
  EXPECT_THROW(engine.malloc(100 * kMiB, 5), OutOfMemoryError);
  s = tracker.state();
  const HistoryEvent& oom = s.history.back();
  EXPECT_EQ(oom.kind, EventKind::oom);
  EXPECT_EQ(oom.size, 100 * kMiB);
  EXPECT_EQ(oom.stream, 5u);
  EXPECT_EQ(oom.text, "limit");
  EXPECT_EQ(oom.device_free, device.mem_info().free);
  ASSERT_TRUE(tracker.last_oom().has_value());
  EXPECT_EQ(tracker.last_oom()->requested, 100 * kMiB);
  EXPECT_EQ(tracker.last_oom()->limit, 64 * kMiB);
}

TEST_F(TrackerTest, GroupsLiveMemoryByScopeAndSite) {
  Tracker tracker(engine);
  std::vector<void*> blocks;
  auto alloc = [&](const char* scope, const char* site, std::size_t size) {
    Scope s(scope);
    frames::set_current(site);
    blocks.push_back(engine.malloc(size, 0));
    frames::set_current("");
  };
  alloc("mlp", "a.py:1:f", 1000 * 512);
  alloc("mlp", "b.py:2:g", 1000 * 512);
  alloc("attn", "a.py:1:f", 3000 * 512);
  alloc("attn", "a.py:1:f", 512);
  const std::vector<UsageGroup> by_scope = tracker.usage_by_scope();
  ASSERT_EQ(by_scope.size(), 2u);
  EXPECT_EQ(by_scope[0].key, "attn");
  EXPECT_EQ(by_scope[0].bytes, 3001u * 512);
  EXPECT_EQ(by_scope[0].count, 2u);
  EXPECT_EQ(by_scope[1].key, "mlp");
  EXPECT_EQ(by_scope[1].bytes, 2000u * 512);
  const std::vector<UsageGroup> by_site = tracker.usage_by_site();
  ASSERT_EQ(by_site.size(), 2u);
  EXPECT_EQ(by_site[0].key, "a.py:1:f");  // merged across scopes
  EXPECT_EQ(by_site[0].bytes, 4001u * 512);
  EXPECT_EQ(by_site[0].count, 3u);
  EXPECT_EQ(tracker.usage_by_site(1).size(), 1u);
  for (void* p : blocks) engine.free(p);
  EXPECT_TRUE(tracker.usage_by_scope().empty());
}

TEST(Tracker, SiteIsTheProgramsOwnFrame) {
  const FramesId stack = frames::intern(
      "/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py:134:forward\n"
      "/opt/torch/nn/modules/module.py:1790:_call_impl\n"
      "capture.py:73:run\ncapture.py:80:<module>");
  EXPECT_EQ(site_of(0, stack), "capture.py:73:run");
  EXPECT_EQ(site_of(0, frames::intern("/usr/lib/libfoo.so:0:foo()\nmain:0:main")), "/usr/lib/libfoo.so:0:foo()");
  EXPECT_EQ(site_of(scopes::intern("model.mlp"), 0), "model.mlp");
  EXPECT_EQ(site_of(0, 0), "<unknown>");
}

[[gnu::noinline]] void* malloc_here(Engine& engine) { return engine.malloc(512, 0); }
[[gnu::noinline]] void* malloc_there(Engine& engine) { return engine.malloc(512, 0); }

TEST_F(TrackerTest, PythonStacksFallBackToTheThreadsFramesWithoutPython) {
  // This test binary runs no Python interpreter: asking for Python stacks must cost nothing and
  // leave each allocation the frames its thread set.
  ASSERT_FALSE(frames::python_available());
  EXPECT_EQ(frames::capture_python(0, 16), 0u);
  TrackerOptions options;
  options.capture_python = true;
  Tracker tracker(engine, options);
  frames::set_current("model.py:10:forward");
  void* p = engine.malloc(4096, 0);
  frames::set_current("");
  void* q = engine.malloc(4096, 0);
  const TrackerState s = tracker.state();
  for (const LiveAllocation& l : s.live) {
    if (l.addr == addr_of(p)) EXPECT_EQ(frames::to_text(l.frames), "model.py:10:forward");
    if (l.addr == addr_of(q)) EXPECT_EQ(l.frames, 0u);
  }
  engine.free(p);
  engine.free(q);
}

TEST_F(TrackerTest, CapturesBacktracesWhenAsked) {
  Tracker tracker(engine, TrackerOptions{100, true, 16});
  void* here[2];
  static volatile int two = 2;  // an unknown trip count: the loop stays one call site
  for (int i = 0, n = two; i < n && i < 2; ++i) here[i] = malloc_here(engine);
  void* there = malloc_there(engine);
  const TrackerState s = tracker.state();
  ASSERT_EQ(s.live.size(), 3u);
  auto frames_of = [&](void* p) {
    for (const LiveAllocation& l : s.live)
      if (l.addr == addr_of(p)) return l.frames;
    return FramesId{0};
  };
  EXPECT_NE(frames_of(here[0]), 0u);
  EXPECT_EQ(frames_of(here[0]), frames_of(here[1]));  // one call site, one stack
  EXPECT_NE(frames_of(here[0]), frames_of(there));
  EXPECT_FALSE(frames::get(frames_of(there)).empty());
  for (void* p : {here[0], here[1], there}) engine.free(p);
}

TEST_F(TrackerTest, FindsMemoryThatGrowsEveryStep) {
  Tracker tracker(engine);
  std::vector<void*> kept;
  frames::set_current("optim.py:3:init");
  void* state = engine.malloc(64 * kMiB, 0);  // once: optimizer state, not a leak
  for (int step = 0; step < 10; ++step) {
    frames::set_current("train.py:20:forward");
    void* activation = engine.malloc(8 * kMiB, 0);
    frames::set_current("train.py:66:run");  // the loss kept in a list
    kept.push_back(engine.malloc(kMiB, 0));
    engine.free(activation);
    tracker.step();
  }
  frames::set_current("");
  const std::vector<LeakFinding> leaks = tracker.leak_suspects();
  ASSERT_EQ(leaks.size(), 1u);
  EXPECT_EQ(leaks[0].site, "train.py:66:run");
  EXPECT_EQ(leaks[0].bytes_per_step, static_cast<std::int64_t>(kMiB));
  for (void* p : kept) engine.free(p);
  engine.free(state);
}

// Graph tracking: activations saved for a backward that never runs, kept by the outputs a loop
// keeps (inference without no_grad), against a cache of plain tensors and a training loop whose
// backward uses what it saved.
TEST_F(TrackerTest, SavedForABackwardThatNeverRunsIsAGraphKeptAlive) {
  Tracker tracker(engine);
  std::vector<void*> kept;
  for (int step = 0; step < 10; ++step) {
    frames::set_current("infer.py:12:forward");
    void* activation = engine.malloc(4 * kMiB, 0);  // saved by the next layer
    EXPECT_TRUE(tracker.mark_saved(addr_of(activation), true));
    void* output = engine.malloc(kMiB, 0);           // the kept output holds the graph
    kept.push_back(activation);
    kept.push_back(output);
    frames::set_current("cache.py:5:remember");      // a plain tensor cache: never saved
    kept.push_back(engine.malloc(2 * kMiB, 0));
    tracker.step();
  }
  frames::set_current("");
  const std::vector<LeakFinding> leaks = tracker.leak_suspects();
  ASSERT_EQ(leaks.size(), 2u);
  const LeakFinding& graph = leaks[0].site == "infer.py:12:forward" ? leaks[0] : leaks[1];
  const LeakFinding& cache = &graph == &leaks[0] ? leaks[1] : leaks[0];
  EXPECT_EQ(graph.site, "infer.py:12:forward");
  EXPECT_EQ(cache.site, "cache.py:5:remember");
  EXPECT_GT(graph.graph_bytes, graph.surviving_bytes / 2);  // 4 of every 5 MiB kept
  EXPECT_EQ(cache.graph_bytes, 0);
  EXPECT_FALSE(graph.backward_runs);
  EXPECT_FALSE(tracker.mark_saved(addr_of(kept[0]) + 512, true)) << "an interior address";
  EXPECT_FALSE(tracker.mark_saved(0x1234, true)) << "not gmem's";
  // Backward uses (unpacks) what was saved: the flags go, and so does the graph.
  tracker.note_backward();
  for (std::size_t i = 0; i < kept.size(); i += 3) EXPECT_TRUE(tracker.mark_saved(addr_of(kept[i]), false));
  tracker.step();
  for (const LeakFinding& f : tracker.leak_suspects()) {
    EXPECT_EQ(f.graph_bytes, 0) << f.site;
    EXPECT_TRUE(f.backward_runs);
  }
  for (void* p : kept) engine.free(p);
}

TEST_F(TrackerTest, SavedBlocksThatBackwardFreesAreNoLeak) {
  // A training loop: activations saved, backward frees them; only the loss is kept each step.
  Tracker tracker(engine);
  std::vector<void*> losses;
  for (int step = 0; step < 10; ++step) {
    frames::set_current("train.py:20:forward");
    void* activation = engine.malloc(8 * kMiB, 0);
    EXPECT_TRUE(tracker.mark_saved(addr_of(activation), true));
    frames::set_current("train.py:30:loss");
    losses.push_back(engine.malloc(512, 0));
    tracker.note_backward();
    engine.free(activation);  // backward is done with it
    tracker.step();
  }
  frames::set_current("");
  const std::vector<LeakFinding> leaks = tracker.leak_suspects();
  ASSERT_EQ(leaks.size(), 1u);
  EXPECT_EQ(leaks[0].site, "train.py:30:loss");
  EXPECT_EQ(leaks[0].graph_bytes, 0);
  for (void* p : losses) engine.free(p);
}

TEST_F(TrackerTest, BlockReusedAtTheSameAddressIsANewAllocation) {
  // The leak detector learns of frees at steps only: a block freed and another allocated at the
  // same address within one step must not be taken for a survivor.
  Tracker tracker(engine);
  frames::set_current("train.py:9:scratch");
  for (int step = 0; step < 8; ++step) {
    void* p = engine.malloc(kMiB, 0);
    tracker.step();
    engine.free(p);  // lives across one step boundary, never more
  }
  EXPECT_TRUE(tracker.leak_suspects().empty());
}

TEST_F(TrackerTest, TimesAreSampledButOrdered) {
  Tracker tracker(engine);
  std::vector<void*> blocks;
  const std::int64_t before = wall_now_ns();
  for (int i = 0; i < 1000; ++i) blocks.push_back(engine.malloc(512, 0));
  const std::int64_t after = wall_now_ns();
  const TrackerState s = tracker.state();
  std::vector<LiveAllocation> live = s.live;
  std::sort(live.begin(), live.end(), [](auto& x, auto& y) { return x.id < y.id; });
  for (std::size_t i = 0; i < live.size(); ++i) {
    EXPECT_GE(live[i].time_ns, before - 2'000'000);
    EXPECT_LE(live[i].time_ns, after + 2'000'000);
    if (i > 0) EXPECT_GE(live[i].time_ns, live[i - 1].time_ns);
  }
  for (void* p : blocks) engine.free(p);
}

TEST(TrackerThreads, ThreadsFreeEachOthersBlocks) {
  SimulatedDevice device{SimDeviceOptions{std::size_t{1} << 30}};
  Engine engine(device);
  Tracker tracker(engine, TrackerOptions{1000, false, 0});
  engine.free(engine.malloc(512, 0));  // the slab's page is mapped: the history is blocks only
  constexpr int kThreads = 4, kPerThread = 5000;
  // Each thread hands its blocks to its neighbour, which frees them (as PyTorch's autograd
  // thread frees what the main thread allocated), or frees them itself when the box is full;
  // another thread reads the tracker meanwhile.
  std::vector<std::atomic<void*>> mailbox(kThreads);
  std::atomic<bool> done{false};
  std::thread reader([&] {
    while (!done.load()) {
      EXPECT_LE(tracker.state().live.size(), static_cast<std::size_t>(2 * kThreads));
      tracker.usage_by_site();
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        void* p = engine.malloc(512, static_cast<StreamId>(0));
        void* empty = nullptr;
        if (!mailbox[t].compare_exchange_strong(empty, p)) engine.free(p);
        if (void* theirs = mailbox[(t + 1) % kThreads].exchange(nullptr)) engine.free(theirs);
        if (t == 0 && i % 1000 == 999) tracker.step();
      }
    });
  for (std::thread& th : threads) th.join();
  done = true;
  reader.join();
  for (auto& box : mailbox)
    if (void* left = box.exchange(nullptr)) engine.free(left);
  EXPECT_EQ(tracker.live_count(), 0u);
  const TrackerState s = tracker.state();
  EXPECT_EQ(s.allocations, std::uint64_t{kThreads} * kPerThread + 1);
  EXPECT_EQ(s.untracked_frees, 0u);
  EXPECT_EQ(s.history.size(), 1000u);
  EXPECT_EQ(s.step, 5u);
  engine.check_invariants();
}

}  // namespace
}  // namespace gmem
