// Histories that begin mid-run (a ring that wrapped): gmem's own snapshots and PyTorch's, cut at
// several points of every trace in tests/data, must be read, rebuilt to the state the history
// began from, and agree with the whole trace in live bytes at every event from the cut on; leak
// detection over the window counts the blocks older than it as such; a file no earlier state
// explains is refused naming its line (docs/wrapped-histories.md).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <map>
#include <random>
#include <thread>
#include <unordered_map>

#include "gmem/engine.hpp"
#include "gmem/error.hpp"
#include "gmem/leaks.hpp"
#include "gmem/scope.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/snapshot.hpp"
#include "gmem/trace.hpp"
#include "gmem/tracker.hpp"
#include "trace/replay.hpp"
#include "tracking/pickle_writer.hpp"

namespace gmem {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

std::vector<std::string> data_traces() {
  std::vector<std::string> paths;
  for (const auto& entry : std::filesystem::directory_iterator(GMEM_TEST_DATA))
    if (entry.path().string().ends_with(".trace.csv.gz")) paths.push_back(entry.path().string());
  std::sort(paths.begin(), paths.end());
  return paths;
}

// Bytes live after each event (allocs add their size, free_completed takes the block's away), as
// replay counts them; throws where a free finds nothing live, which a rebuilt trace must not do.
std::vector<std::uint64_t> live_after_each_event(const trace::Trace& t) {
  std::unordered_map<std::uint64_t, std::uint64_t> live;
  std::vector<std::uint64_t> curve;
  curve.reserve(t.events.size());
  std::uint64_t bytes = 0;
  for (const trace::Event& e : t.events) {
    if (e.action == trace::Action::alloc) {
      live[e.addr] = e.size;
      bytes += e.size;
    } else if (e.action == trace::Action::free_completed) {
      auto it = live.find(e.addr);
      if (it == live.end()) throw std::runtime_error("free of a block not live at line " + std::to_string(e.line));
      bytes -= it->second;
      live.erase(it);
    }
    curve.push_back(bytes);
  }
  return curve;
}

// The blocks live after the whole trace, by address: what a snapshot's segments would hold.
std::map<std::uint64_t, trace::Event> live_at_end(const trace::Trace& t) {
  std::map<std::uint64_t, trace::Event> live;
  for (const trace::Event& e : t.events) {
    if (e.action == trace::Action::alloc) live[e.addr] = e;
    else if (e.action == trace::Action::free_completed) live.erase(e.addr);
  }
  return live;
}

// PyTorch's snapshot of `t` as its _record_memory_history(max_entries=N) ring would keep it: only
// the events from `cut` on in device_traces, and the segments holding the blocks live at the end.
std::string pytorch_snapshot(const trace::Trace& t, std::size_t cut) {
  detail::PickleWriter p;
  p.begin_dict();
  p.key("segments").begin_list();
  for (const auto& [addr, e] : live_at_end(t)) {  // one segment a block: the layout does not matter here
    p.begin_dict();
    p.key("device").integer(0);
    p.key("address").unsigned_integer(addr);
    p.key("total_size").unsigned_integer(e.size);
    p.key("stream").unsigned_integer(e.stream);
    p.key("blocks").begin_list();
    p.begin_dict();
    p.key("address").unsigned_integer(addr);
    p.key("size").unsigned_integer(e.size);
    p.key("requested_size").unsigned_integer(e.size);
    p.key("state").string("active_allocated");
    p.key("frames").begin_list().end_list();
    p.end_dict();
    p.end_list();
    p.end_dict();
  }
  p.end_list();
  p.key("device_traces").begin_list().begin_list();
  for (std::size_t i = cut; i < t.events.size(); ++i) {
    const trace::Event& e = t.events[i];
    p.begin_dict();
    p.key("action").string(trace::action_name(e.action));
    p.key("addr").unsigned_integer(e.addr);
    p.key("size").unsigned_integer(e.size);
    p.key("stream").unsigned_integer(e.stream);
    p.key("time_us").integer(e.time_us);
    p.key("frames").begin_list().end_list();
    p.end_dict();
  }
  p.end_list().end_list();
  p.end_dict();
  return p.finish();
}

// From the cut on, the cut trace (after its rebuilt allocs) and the whole one agree in live bytes
// at every event; the rebuilt state is exactly what was live before the cut.
void expect_agrees_from_cut(const trace::Trace& whole, const std::vector<std::uint64_t>& whole_curve,
                            const trace::Trace& cut_trace, std::size_t cut) {
  const std::size_t rebuilt = cut_trace.window.blocks_at_start;
  ASSERT_EQ(cut_trace.events.size() - rebuilt, whole.events.size() - cut);
  for (std::size_t i = 0; i < rebuilt; ++i) ASSERT_TRUE(cut_trace.events[i].before_history);
  EXPECT_EQ(cut_trace.window.bytes_at_start, cut == 0 ? 0 : whole_curve[cut - 1]);
  EXPECT_EQ(cut_trace.window.mid_run, rebuilt > 0);
  const std::vector<std::uint64_t> curve = live_after_each_event(cut_trace);
  for (std::size_t j = 0; j + rebuilt < curve.size(); ++j)
    ASSERT_EQ(curve[rebuilt + j], whole_curve[cut + j]) << "at event " << cut + j << " of " << whole.name;
}

TEST(WrappedHistory, PyTorchSnapshotsOfEveryTraceCutAtSeveralPointsAgreeWithTheWholeTrace) {
  for (const std::string& path : data_traces()) {
    const trace::Trace whole = trace::read_trace(path);
    ASSERT_FALSE(whole.window.mid_run) << path;
    const std::vector<std::uint64_t> whole_curve = live_after_each_event(whole);
    const std::size_t n = whole.events.size();
    for (std::size_t cut : {std::size_t{1}, n / 7, n / 2, n - n / 10, n - 1}) {
      SCOPED_TRACE(whole.name + " cut at " + std::to_string(cut));
      const trace::Trace t = trace::read_trace_bytes(pytorch_snapshot(whole, cut), whole.name + ".pickle");
      EXPECT_TRUE(t.window.has_segments);
      expect_agrees_from_cut(whole, whole_curve, t, cut);
      // The replay through gmem starts from the rebuilt state and ends where the whole one does.
      if (cut == n / 2 && n < 100'000) {
        const trace::ReplayResult r = trace::replay(t);
        ASSERT_FALSE(r.failed) << r.failure;
        EXPECT_EQ(r.events, n - cut);
        EXPECT_EQ(r.live_at_end, trace::replay(whole).live_at_end);
      }
    }
  }
}

// The CSV of a cut trace has no segments: the blocks freed in it are rebuilt, and the output says
// that those never freed in it are missing.
TEST(WrappedHistory, CsvCutRebuildsTheBlocksItFreesAndSaysWhatIsMissing) {
  const trace::Trace whole = trace::read_trace(std::string(GMEM_TEST_DATA) + "/leak_losses.trace.csv.gz");
  const std::size_t cut = whole.events.size() / 2;
  trace::Trace t;
  t.path = t.name = "cut";
  t.frames = whole.frames;
  t.events.assign(whole.events.begin() + static_cast<std::ptrdiff_t>(cut), whole.events.end());
  trace::rebuild_history_window(t);
  ASSERT_TRUE(t.window.mid_run);
  EXPECT_FALSE(t.window.has_segments);
  EXPECT_EQ(t.window.freed_in_history, t.window.blocks_at_start);
  EXPECT_NE(t.window.describe().find("the file has no segments"), std::string::npos) << t.window.describe();
  EXPECT_NO_THROW(trace::check_trace(t));
  // Live bytes from the cut on: the whole's, less what was live at the cut and never freed.
  const std::vector<std::uint64_t> whole_curve = live_after_each_event(whole);
  const std::vector<std::uint64_t> curve = live_after_each_event(t);
  const std::uint64_t never_freed = whole_curve[cut - 1] - t.window.bytes_at_start;
  for (std::size_t j = 0; j + t.window.blocks_at_start < curve.size(); ++j)
    ASSERT_EQ(curve[t.window.blocks_at_start + j] + never_freed, whole_curve[cut + j]) << j;
}

// The same trace run twice through gmem with tracking, with a history that holds it all and with
// one that wraps: the wrapped snapshot's history is the last events of the whole one, and from
// there on they agree in live bytes at every event.
struct TrackedRun {
  std::string pickle;
  std::uint64_t dropped = 0;
};

TrackedRun run_tracked(const trace::Trace& t, std::size_t history) {
  SimulatedDevice device(SimDeviceOptions{std::size_t{256} << 30});
  Engine engine(device);
  TrackerOptions options;
  options.history_capacity = history;
  Tracker tracker(engine, options);
  std::unordered_map<std::uint64_t, void*> blocks;
  std::size_t allocs = 0;
  for (const trace::Event& e : t.events) {
    if (e.action == trace::Action::alloc) {
      blocks[e.addr] = engine.malloc(e.size, static_cast<StreamId>(e.stream));
      if (++allocs % 500 == 0) tracker.step();
    } else if (e.action == trace::Action::free_completed) {
      engine.free(blocks.at(e.addr));
      blocks.erase(e.addr);
    }
  }
  TrackedRun run;
  const Snapshot s = take_snapshot(engine, &tracker);
  run.pickle = snapshot_pickle(s);
  run.dropped = s.dropped_events;
  for (const auto& [addr, ptr] : blocks) engine.free(ptr);
  return run;
}

TEST(WrappedHistory, GmemSnapshotsOfEveryTraceWithAWrappedRingAgreeWithTheWholeHistory) {
  for (const std::string& path : data_traces()) {
    const trace::Trace source = trace::read_trace(path);
    if (source.events.size() > 200'000) continue;  // llama_rounds: the same loop as llama_ckpt_varlen, 3x longer
    const TrackedRun full = run_tracked(source, 2 * source.events.size() + 1024);
    ASSERT_EQ(full.dropped, 0u) << path;
    const trace::Trace whole = trace::read_trace_bytes(full.pickle, source.name + ".pickle");
    ASSERT_FALSE(whole.window.mid_run) << path;
    const std::vector<std::uint64_t> whole_curve = live_after_each_event(whole);
    for (std::size_t history : {std::size_t{1000}, source.events.size() / 3}) {
      SCOPED_TRACE(source.name + " history " + std::to_string(history));
      const TrackedRun wrapped = run_tracked(source, history);
      if (wrapped.dropped == 0) {  // tiny_leak's whole run fits in 1000 events
        EXPECT_EQ(history, 1000u);
        continue;
      }
      const trace::Trace t = trace::read_trace_bytes(wrapped.pickle, source.name + ".pickle");
      EXPECT_TRUE(t.window.mid_run);
      EXPECT_EQ(t.window.dropped_events, static_cast<std::int64_t>(wrapped.dropped));
      EXPECT_NE(t.window.describe().find(std::to_string(wrapped.dropped) + " older ones dropped"), std::string::npos);
      // The pickle's events (a free is two) from the end: the wrapped history is the whole one's tail.
      const std::size_t kept = t.events.size() - t.window.blocks_at_start;
      ASSERT_LE(kept, whole.events.size());
      expect_agrees_from_cut(whole, whole_curve, t, whole.events.size() - kept);
      EXPECT_NO_THROW(find_leaks(t));
    }
  }
}

// A loop that leaks 1 MiB a step at one site (30 steps, the window holding the last ~24), after a prologue that kept 64 blocks of 4 MiB at
// another (weights) and a first phase that leaked at a third site and stopped: with the history
// wrapped past both, the window's leak is found, and the older blocks are reported as older than
// the window, not as its leaks.
TEST(WrappedHistory, LeakDetectionCountsBlocksOlderThanTheWindowAsOlder) {
  SimulatedDevice device(SimDeviceOptions{std::size_t{64} << 30});
  Engine engine(device);
  TrackerOptions options;
  options.history_capacity = 2000;
  Tracker tracker(engine, options);
  std::vector<void*> kept;
  {
    Scope scope("weights");
    for (int i = 0; i < 64; ++i) kept.push_back(engine.malloc(4 * MiB, 0));
  }
  auto step = [&](const char* leaking_site, bool leak) {
    for (int i = 0; i < 40; ++i) {
      Scope scope("activations");
      engine.free(engine.malloc(2 * MiB, 0));
    }
    if (leak) {
      Scope scope(leaking_site);
      kept.push_back(engine.malloc(MiB, 0));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(300));
    tracker.step();
    std::this_thread::sleep_for(std::chrono::microseconds(300));
  };
  for (int s = 0; s < 60; ++s) step("early_cache", true);   // leaked, then stopped: all before the window
  for (int s = 0; s < 40; ++s) step("early_cache", false);  // pushes the early phase out of the ring
  for (int s = 0; s < 30; ++s) step("losses", true);  // the ring holds about the last 24 steps
  const Snapshot snapshot = take_snapshot(engine, &tracker);
  ASSERT_GT(snapshot.dropped_events, 0u);
  const trace::Trace t = trace::read_trace_bytes(snapshot_pickle(snapshot), "loop.pickle");
  for (void* p : kept) engine.free(p);

  ASSERT_TRUE(t.window.mid_run);
  EXPECT_GE(t.window.blocks_at_start, 64u + 60u);  // weights, the early leak (and the losses before the window)
  EXPECT_GE(t.window.bytes_at_start, 64 * 4 * MiB + 60 * MiB);
  const LeakReport report = find_leaks(t);
  EXPECT_TRUE(report.window.mid_run);
  EXPECT_GE(report.periods, 15u);
  EXPECT_LE(report.periods, 26u);  // the steps inside the window, not the 130 of the run
  ASSERT_EQ(report.leaks.size(), 1u) << format_leaks(report);
  EXPECT_EQ(report.leaks[0].site, "scope losses");
  // Only the window's losses: fewer than the 30 leaked in all (the first ones are older).
  EXPECT_LT(report.leaks[0].surviving_bytes, static_cast<std::int64_t>(30 * MiB));
  const std::string text = format_leaks(report);
  EXPECT_NE(text.find("history began mid-run"), std::string::npos) << text;
  EXPECT_NE(text.find("older than the history, never counted as its leaks"), std::string::npos) << text;
  const std::string json = leaks_json(report);
  EXPECT_NE(json.find("\"history\":{\"began_mid_run\":true"), std::string::npos) << json;
}

// Files no earlier state explains are refused, naming the line.
trace::Trace with_events(std::vector<trace::Event> events) {
  trace::Trace t;
  t.path = t.name = "made.pickle";
  t.frames.emplace_back();
  for (std::size_t i = 0; i < events.size(); ++i) events[i].line = i + 1;
  t.events = std::move(events);
  return t;
}

trace::Event ev(trace::Action action, std::uint64_t addr, std::uint64_t size) {
  trace::Event e;
  e.action = action;
  e.addr = addr;
  e.size = size;
  return e;
}

void expect_refused(trace::Trace t, std::size_t line, const std::string& words) {
  try {
    trace::rebuild_history_window(t);
    ADD_FAILURE() << "accepted";
  } catch (const BadInputError& e) {
    EXPECT_EQ(e.line(), line) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(WrappedHistory, SizeThatContradictsTheSegmentsIsRefused) {
  using trace::Action;
  trace::Trace t = with_events({ev(Action::alloc, 4096, 512), ev(Action::alloc, 8192, 1024)});
  t.has_segments = true;
  t.dumped_blocks = {{4096, 512}, {8192, 2048}};
  expect_refused(t, 2, "block at 0x2000 of 1024 bytes, but the snapshot's segments hold 2048 bytes there");
}

TEST(WrappedHistory, SegmentsHoldingABlockTheHistoryFreedIsRefused) {
  using trace::Action;
  trace::Trace t = with_events({ev(Action::alloc, 4096, 512), ev(Action::free_requested, 4096, 512),
                                ev(Action::free_completed, 4096, 512)});
  t.has_segments = true;
  t.dumped_blocks = {{4096, 512}};
  expect_refused(t, 3, "which this line freed and no later event allocated");
}

TEST(WrappedHistory, DoubleFreeInsideTheWindowIsRefused) {
  using trace::Action;
  expect_refused(with_events({ev(Action::free_requested, 4096, 512), ev(Action::free_completed, 4096, 512),
                              ev(Action::alloc, 8192, 512), ev(Action::free_completed, 4096, 512)}),
                 4, "line 2 freed it and nothing allocated it since (a double free)");
}

// A block freed by the program (free_requested) before the history but completed inside it, and a
// block pending at the dump (active_pending_free): both read.
TEST(WrappedHistory, FreesThatCompleteInsideTheWindowAndPendingBlocksAtTheDumpRead) {
  using trace::Action;
  trace::Trace t = with_events({ev(Action::free_completed, 4096, 512), ev(Action::alloc, 8192, 1024),
                                ev(Action::free_requested, 8192, 1024)});
  t.has_segments = true;
  t.dumped_blocks = {{8192, 1024}, {1 << 20, 4096}};
  trace::rebuild_history_window(t);
  EXPECT_EQ(t.window.blocks_at_start, 2u);  // 0x1000 (freed in it) and 0x100000 (live to the end)
  EXPECT_EQ(t.window.freed_in_history, 1u);
  EXPECT_EQ(t.window.bytes_at_start, 512u + 4096u);
  EXPECT_NO_THROW(trace::check_trace(t));
}

// Threads allocate, free and mark steps while others dump snapshots of a history that wraps over
// and over: every snapshot reads back, rebuilt, with no contradiction between its history and its
// segments, and replays.
TEST(WrappedHistoryThreads, SnapshotsDumpedWhileThreadsAllocateReadBack) {
  SimulatedDevice device(SimDeviceOptions{std::size_t{64} << 30});
  Engine engine(device);
  TrackerOptions options;
  options.history_capacity = 512;
  Tracker tracker(engine, options);
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;
  for (int w = 0; w < 3; ++w) {
    workers.emplace_back([&, w] {
      std::mt19937 rng(static_cast<unsigned>(w));
      std::vector<void*> mine;
      while (!stop.load(std::memory_order_relaxed)) {
        if (mine.size() < 64 && (mine.empty() || rng() % 3 != 0)) {
          mine.push_back(engine.malloc(std::size_t{512} << (rng() % 12), static_cast<StreamId>(w)));
        } else {
          const std::size_t i = rng() % mine.size();
          engine.free(mine[i]);
          mine[i] = mine.back();
          mine.pop_back();
        }
        if (rng() % 256 == 0) tracker.step();
      }
      for (void* p : mine) engine.free(p);
    });
  }
  std::size_t wrapped = 0;
  std::string failure;  // the first snapshot that did not read back (the workers stop before asserting)
  for (int i = 0; i < 40 && failure.empty(); ++i) {
    const Snapshot s = take_snapshot(engine, &tracker);
    wrapped += s.dropped_events > 0;
    try {
      const trace::Trace t = trace::read_trace_bytes(snapshot_pickle(s), "threads.pickle");
      trace::check_trace(t);
      live_after_each_event(t);
    } catch (const std::exception& e) {
      failure = "snapshot " + std::to_string(i) + ": " + e.what();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  stop = true;
  for (std::thread& w : workers) w.join();
  EXPECT_EQ(failure, "");
  EXPECT_GT(wrapped, 0u);
}

}  // namespace
}  // namespace gmem
