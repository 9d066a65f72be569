// The tracker, scopes and call sites: what is recorded per allocation, the bounded history, the
// engine's events, leak suspects, grouping, and use from several threads.
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

void* fake(std::uintptr_t addr) { return reinterpret_cast<void*>(addr); }
constexpr std::uintptr_t kBase = 0x7f0000000000;

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

// --- the tracker -------------------------------------------------------------------------------

TEST(Tracker, RecordsEachLiveAllocation) {
  Tracker tracker;
  const std::int64_t before = wall_now_ns();
  frames::set_current("model.py:10:forward");
  {
    Scope scope("forward");
    tracker.on_malloc(fake(kBase), 1024, 1000, 7);
  }
  frames::set_current("");
  tracker.step();
  tracker.on_malloc(fake(kBase + 4096), 512, 512, 0);
  const std::int64_t after = wall_now_ns();

  const TrackerState s = tracker.state();
  ASSERT_EQ(s.live.size(), 2u);
  const LiveAllocation& a = s.live[0];
  EXPECT_EQ(a.addr, kBase);
  EXPECT_EQ(a.id, 1u);
  EXPECT_EQ(a.size, 1024u);
  EXPECT_EQ(a.requested, 1000u);
  EXPECT_EQ(a.stream, 7u);
  EXPECT_EQ(a.step, 0u);
  EXPECT_EQ(scopes::path(a.scope), "forward");
  EXPECT_EQ(frames::to_text(a.frames), "model.py:10:forward");
  EXPECT_GE(a.time_ns, before - 2'000'000);  // the TSC conversion is good to well under 2 ms
  EXPECT_LE(a.time_ns, after + 2'000'000);
  const LiveAllocation& b = s.live[1];
  EXPECT_EQ(b.id, 2u);
  EXPECT_EQ(b.step, 1u);
  EXPECT_EQ(b.scope, 0u);
  EXPECT_EQ(b.frames, 0u);
  EXPECT_GE(b.time_ns, a.time_ns);
  EXPECT_EQ(tracker.live_count(), 2u);
  EXPECT_EQ(tracker.live_bytes(), 1536u);
  EXPECT_EQ(s.allocations, 2u);
}

TEST(Tracker, FreeRemovesAndIsLogged) {
  Tracker tracker;
  tracker.on_malloc(fake(kBase), 2048, 2000, 3);
  frames::set_current("loop.py:5:cleanup");
  tracker.on_free(fake(kBase));
  frames::set_current("");
  tracker.on_free(fake(kBase));       // twice: unknown now
  tracker.on_free(fake(kBase + 512));  // never seen
  EXPECT_EQ(tracker.live_count(), 0u);
  EXPECT_EQ(tracker.live_bytes(), 0u);
  const TrackerState s = tracker.state();
  EXPECT_EQ(s.untracked_frees, 2u);
  ASSERT_EQ(s.history.size(), 2u);
  EXPECT_EQ(s.history[0].kind, EventKind::alloc);
  const HistoryEvent& f = s.history[1];
  EXPECT_EQ(f.kind, EventKind::free);
  EXPECT_EQ(f.addr, kBase);
  EXPECT_EQ(f.size, 2048u);  // the block's size, from its record
  EXPECT_EQ(f.stream, 3u);
  EXPECT_EQ(f.id, 1u);
  EXPECT_EQ(frames::to_text(f.frames), "loop.py:5:cleanup");  // where it was freed
}

TEST(Tracker, MallocOfLiveAddressReplacesIt) {
  Tracker tracker;
  tracker.on_malloc(fake(kBase), 4096, 4096, 0);
  tracker.on_malloc(fake(kBase), 512, 100, 0);  // the free was missed
  EXPECT_EQ(tracker.live_count(), 1u);
  EXPECT_EQ(tracker.live_bytes(), 512u);
  EXPECT_EQ(tracker.state().live[0].id, 2u);
}

TEST(Tracker, HistoryIsBoundedOldestDropped) {
  Tracker tracker(TrackerOptions{4, false, 0});
  for (std::uintptr_t i = 0; i < 5; ++i) tracker.on_malloc(fake(kBase + i * 512), 512, 512, 0);
  for (std::uintptr_t i = 0; i < 5; ++i) tracker.on_free(fake(kBase + i * 512));
  const TrackerState s = tracker.state();
  ASSERT_EQ(s.history.size(), 4u);
  EXPECT_EQ(s.dropped_events, 6u);
  for (std::size_t i = 0; i < 4; ++i) {  // the last four frees, oldest first
    EXPECT_EQ(s.history[i].kind, EventKind::free);
    EXPECT_EQ(s.history[i].addr, kBase + (i + 1) * 512);
  }
  Tracker none(TrackerOptions{0, false, 0});
  none.on_malloc(fake(kBase), 512, 512, 0);
  EXPECT_TRUE(none.state().history.empty());
  EXPECT_EQ(none.live_count(), 1u);  // live allocations are kept regardless
}

TEST(Tracker, StepsAndAnnotationsAreEvents) {
  Tracker tracker;
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

TEST(Tracker, ListensToMapsUnmapsAndOoms) {
  Tracker tracker;
  const std::size_t page = std::size_t{2} << 20;
  tracker.on_map(kBase, 2 * page);
  tracker.on_map(kBase + 2 * page, page);  // adjacent: one range
  tracker.on_map(kBase + 10 * page, page);
  tracker.on_unmap(kBase + page, page);    // splits the first
  OomInfo info;
  info.requested = 123;
  info.device_free = 456;
  info.reason = "limit";
  tracker.on_oom(info);

  const TrackerState s = tracker.state();
  using Range = std::pair<std::uintptr_t, std::size_t>;
  const std::vector<Range> expected = {{kBase, page}, {kBase + 2 * page, page}, {kBase + 10 * page, page}};
  EXPECT_EQ(s.mapped, expected);
  ASSERT_EQ(s.history.size(), 5u);
  EXPECT_EQ(s.history[0].kind, EventKind::map);
  EXPECT_EQ(s.history[0].size, 2 * page);
  EXPECT_EQ(s.history[3].kind, EventKind::unmap);
  const HistoryEvent& oom = s.history[4];
  EXPECT_EQ(oom.kind, EventKind::oom);
  EXPECT_EQ(oom.size, 123u);
  EXPECT_EQ(oom.device_free, 456u);
  EXPECT_EQ(oom.text, "limit");
  ASSERT_TRUE(tracker.last_oom().has_value());
  EXPECT_EQ(tracker.last_oom()->requested, 123u);
}

TEST(Tracker, GroupsLiveMemoryByScopeAndSite) {
  Tracker tracker;
  std::uintptr_t next = kBase;
  auto alloc = [&](const char* scope, const char* site, std::size_t size) {
    Scope s(scope);
    frames::set_current(site);
    tracker.on_malloc(fake(next), size, size, 0);
    next += size;
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

TEST(Tracker, CapturesBacktracesWhenAsked) {
  Tracker tracker(TrackerOptions{100, true, 16});
  auto from_here = [&](std::uintptr_t addr) { tracker.on_malloc(fake(addr), 512, 512, 0); };
  from_here(kBase);
  tracker.on_malloc(fake(kBase + 512), 512, 512, 0);
  const TrackerState s = tracker.state();
  ASSERT_EQ(s.live.size(), 2u);
  EXPECT_NE(s.live[0].frames, 0u);
  EXPECT_NE(s.live[0].frames, s.live[1].frames);  // two call sites
  EXPECT_FALSE(frames::get(s.live[0].frames).empty());
}

TEST(Tracker, FindsMemoryThatGrowsEveryStep) {
  Tracker tracker;
  std::uintptr_t next = kBase;
  frames::set_current("optim.py:3:init");
  tracker.on_malloc(fake(next), 64 << 20, 64 << 20, 0);  // once: optimizer state, not a leak
  next += 64 << 20;
  for (int step = 0; step < 10; ++step) {
    frames::set_current("train.py:20:forward");
    void* activation = fake(next);
    tracker.on_malloc(activation, 8 << 20, 8 << 20, 0);
    next += 8 << 20;
    frames::set_current("train.py:66:run");  // the loss kept in a list
    tracker.on_malloc(fake(next), 1 << 20, 1 << 20, 0);
    next += 1 << 20;
    tracker.on_free(activation);
    tracker.step();
  }
  frames::set_current("");
  const std::vector<LeakFinding> leaks = tracker.leak_suspects();
  ASSERT_EQ(leaks.size(), 1u);
  EXPECT_EQ(leaks[0].site, "train.py:66:run");
  EXPECT_EQ(leaks[0].bytes_per_step, 1 << 20);
}

TEST(Tracker, ThreadsFreeEachOthersBlocks) {
  Tracker tracker(TrackerOptions{1000, false, 0});
  constexpr int kThreads = 4, kPerThread = 20000;
  // Each thread hands its blocks to its neighbour, which frees them (as PyTorch's autograd
  // thread frees what the main thread allocated), or frees them itself when the box is full.
  std::vector<std::atomic<std::uintptr_t>> mailbox(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const std::uintptr_t addr = kBase + (static_cast<std::uintptr_t>(t) << 32) +
                                    static_cast<std::uintptr_t>(i) * 512;
        tracker.on_malloc(fake(addr), 512, 512, static_cast<StreamId>(t));
        std::uintptr_t empty = 0;
        if (!mailbox[t].compare_exchange_strong(empty, addr)) tracker.on_free(fake(addr));
        if (const std::uintptr_t theirs = mailbox[(t + 1) % kThreads].exchange(0))
          tracker.on_free(fake(theirs));
      }
    });
  for (std::thread& th : threads) th.join();
  for (auto& box : mailbox)
    if (const std::uintptr_t left = box.exchange(0)) tracker.on_free(fake(left));
  EXPECT_EQ(tracker.live_count(), 0u);
  const TrackerState s = tracker.state();
  EXPECT_EQ(s.allocations, std::uint64_t{kThreads} * kPerThread);
  EXPECT_EQ(s.untracked_frees, 0u);
  EXPECT_EQ(s.history.size(), 1000u);
  EXPECT_EQ(s.dropped_events, 2u * kThreads * kPerThread - 1000);
}

// --- with an engine ------------------------------------------------------------------------------

TEST(TrackingResource, ReportsAllocationsAndEngineEvents) {
  SimulatedDevice device(SimDeviceOptions{std::size_t{1} << 30});
  Engine engine(device);
  Tracker tracker;
  {
    TrackingResource resource(engine, tracker);
    void* big = nullptr;
    void* small = nullptr;
    {
      Scope scope("load");
      big = resource.allocate(5 << 20, 0);
      small = resource.allocate(1000, 0);
    }
    const TrackerState s = tracker.state();
    ASSERT_EQ(s.live.size(), 2u);
    for (const LiveAllocation& a : s.live) {
      const BlockInfo info = engine.block_info(fake(a.addr));
      EXPECT_EQ(a.size, info.size);  // the tracker's rounding is the engine's
      EXPECT_EQ(a.requested, info.requested);
      EXPECT_EQ(scopes::path(a.scope), "load");
    }
    // The engine mapped pages for them and said so.
    std::size_t mapped = 0;
    for (const auto& [addr, size] : s.mapped) mapped += size;
    EXPECT_EQ(static_cast<std::int64_t>(mapped), engine.stats().chunks_mapped * engine.stats().granularity);
    EXPECT_GE(mapped, std::size_t{6} << 20);
    bool saw_map_before_alloc = false;
    for (const HistoryEvent& e : s.history) {
      if (e.kind == EventKind::alloc) break;
      saw_map_before_alloc = saw_map_before_alloc || e.kind == EventKind::map;
    }
    EXPECT_TRUE(saw_map_before_alloc);
    resource.deallocate(big);
    resource.deallocate(small);
    EXPECT_EQ(tracker.live_count(), 0u);
    EXPECT_THROW(resource.deallocate(big), Error);  // the engine still checks
    engine.empty_cache();
    std::size_t unmapped = 0;
    for (const HistoryEvent& e : tracker.state().history)
      if (e.kind == EventKind::unmap) unmapped += e.size;
    EXPECT_EQ(unmapped, mapped);
    EXPECT_TRUE(tracker.state().mapped.empty());
  }
  // Gone: the engine no longer reports to the tracker.
  const std::size_t events = tracker.state().history.size();
  engine.free(engine.malloc(8 << 20, 0));
  EXPECT_EQ(tracker.state().history.size(), events);
}

}  // namespace
}  // namespace gmem
