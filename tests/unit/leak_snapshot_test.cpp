// `gmem leaks` on gmem's own snapshots: the steps are the gmem.step() markers the snapshot carries
// (not inferred), scopes read as scopes, times count from the trace's start; and a malformed trace
// is rejected as replay rejects it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "gmem/engine.hpp"
#include "gmem/error.hpp"
#include "gmem/leaks.hpp"
#include "gmem/scope.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/snapshot.hpp"
#include "gmem/trace.hpp"
#include "gmem/tracker.hpp"
#include "temp_files.hpp"
#include "trace/replay.hpp"

namespace gmem {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

using gmem::testing::TempPath;

// Markers are placed among the allocations by time (microseconds): keep steps apart.
void pause() { std::this_thread::sleep_for(std::chrono::microseconds(300)); }

// A loop of `steps` steps in scope "model.1", each keeping `kept` bytes and freeing a temporary,
// then half a step more (after the last marker), written as gmem's snapshot pickle.
// With `graphs`, each kept block is marked as saved for a backward pass (graph tracking), and
// with `backward` the program is seen running one.
TempPath leaking_snapshot(std::size_t steps, std::size_t kept, bool graphs = false,
                          bool backward = false) {
  SimulatedDevice device(SimDeviceOptions{std::size_t{8} << 30});
  Engine engine(device);
  Tracker tracker(engine);
  if (backward) tracker.note_backward();
  std::vector<void*> live;
  for (std::size_t i = 0; i <= steps; ++i) {
    {
      Scope scope("model.1");
      void* temp = engine.malloc(8 * MiB, 0);
      live.push_back(engine.malloc(kept, 0));
      if (graphs) EXPECT_TRUE(tracker.mark_saved(reinterpret_cast<std::uintptr_t>(live.back()), true));
      engine.free(temp);
    }
    pause();
    if (i < steps) tracker.step();
    pause();
  }
  TempPath path("snapshot.pickle");  // removed once the caller has read it
  write_snapshot_pickle(take_snapshot(engine, &tracker), path);
  for (void* p : live) engine.free(p);
  return path;
}

// `gmem replay` marks a gmem snapshot's steps where its program marked them: after the last
// event before each marker, not at the minima of live memory.
TEST(ReplayOfGmemSnapshots, MarksStepsAtTheStepMarkers) {
  const std::size_t steps = 15;
  const trace::Trace t = trace::read_trace(leaking_snapshot(steps, 3 * MiB));
  const std::vector<std::size_t> ends = trace::step_ends_at_markers(t);
  ASSERT_EQ(ends.size(), steps);
  for (std::size_t k = 0; k < steps; ++k) {
    ASSERT_LT(ends[k] + 1, t.events.size());
    EXPECT_LT(t.events[ends[k]].time_us, t.steps_us[k]) << "step " << k;
    EXPECT_GE(t.events[ends[k] + 1].time_us, t.steps_us[k]) << "step " << k;
  }
  trace::ReplayOptions options;
  options.step_ends = ends;
  options.mark_steps = true;
  const trace::ReplayResult r = trace::replay(t, options);
  EXPECT_EQ(r.steps, steps);
  EXPECT_EQ(r.steps_marked, steps);

  trace::Trace annotated = t;  // PyTorch's annotations are not taken for steps
  annotated.steps_source = "annotation 'forward'";
  EXPECT_TRUE(trace::step_ends_at_markers(annotated).empty());
}

TEST(LeaksInGmemSnapshots, UseTheStepMarkers) {
  const std::size_t steps = 15;
  const trace::Trace t = trace::read_trace(leaking_snapshot(steps, 3 * MiB));
  EXPECT_EQ(t.steps_us.size(), steps);
  EXPECT_EQ(t.steps_source, "gmem.step() markers");
  const LeakReport r = find_leaks(t);
  EXPECT_TRUE(r.steps_marked);
  EXPECT_EQ(r.periods, steps);
  ASSERT_EQ(r.leaks.size(), 1u);
  EXPECT_EQ(r.leaks[0].site, "scope model.1");
  EXPECT_EQ(r.leaks[0].bytes_per_step, static_cast<std::int64_t>(3 * MiB));

  const std::string text = format_leaks(r);
  EXPECT_NE(text.find("15 step boundaries, from gmem.step() markers"), std::string::npos) << text;
  EXPECT_NE(text.find("cause: leak: scope model.1 keeps +3.00 MiB a step"), std::string::npos) << text;
  EXPECT_EQ(text.find("<gmem scope>"), std::string::npos) << text;
  EXPECT_NE(text.find(" ms into the trace"), std::string::npos) << text;  // not epoch microseconds
  EXPECT_GE(r.leaks[0].first_seen_us, r.start_us);
  EXPECT_LT(r.leaks[0].first_seen_us - r.start_us, 10'000'000);
}

TEST(LeaksInGmemSnapshots, CarryGraphTracking) {
  // Inference keeping its outputs: the snapshot says which blocks were saved for backward, and
  // `gmem leaks` calls it a graph kept alive, with the fix for inference.
  const trace::Trace t = trace::read_trace(leaking_snapshot(12, 3 * MiB, true));
  EXPECT_FALSE(t.backward_runs);
  EXPECT_EQ(t.saved_for_backward.size(), 13u);
  const LeakReport r = find_leaks(t);
  ASSERT_EQ(r.leaks.size(), 1u);
  EXPECT_GT(r.leaks[0].graph_bytes, 0);
  const std::string text = format_leaks(r);
  EXPECT_NE(text.find("cause: graph kept alive"), std::string::npos) << text;
  EXPECT_NE(text.find("Run inference under torch.no_grad()"), std::string::npos) << text;
  EXPECT_NE(leaks_json(r).find("\"graph_bytes\":"), std::string::npos);
  // A program that runs backward: the fix is .item()/.detach().
  const LeakReport kept = find_leaks(trace::read_trace(leaking_snapshot(12, 3 * MiB, true, true)));
  EXPECT_NE(format_leaks(kept).find("Keep loss.item() or tensor.detach()"), std::string::npos);
  // Without graph tracking's marks, the same loop is a plain leak.
  const trace::Trace plain = trace::read_trace(leaking_snapshot(12, 3 * MiB));
  EXPECT_TRUE(plain.saved_for_backward.empty());
  EXPECT_NE(format_leaks(find_leaks(plain)).find("cause: leak:"), std::string::npos);
}

TEST(LeaksInGmemSnapshots, WithoutALeakTheMarkersStillCount) {
  const trace::Trace t = trace::read_trace(leaking_snapshot(6, 0 + 512));
  LeakReport r = find_leaks(t);
  EXPECT_EQ(r.periods, 6u);
  EXPECT_TRUE(r.steps_marked);
}

TEST(LeaksInTraces, InferredStepsSaySo) {
  const LeakReport r = find_leaks(trace::read_trace(std::string(GMEM_TEST_DATA) + "/tiny_leak.snapshot.pickle"));
  EXPECT_FALSE(r.steps_marked);
  const std::string text = format_leaks(r);
  EXPECT_NE(text.find("inferred from recurring allocation (the file has no step markers)"), std::string::npos) << text;
  EXPECT_NE(text.find("cause: leak: capture2.py:73:run"), std::string::npos) << text;
}

TEST(LeaksInTraces, MalformedTraceIsRejectedAsReplayRejectsIt) {
  const TempPath path("bad.csv");
  std::ofstream(path) << "action,addr,size,stream,time_us,user_frame,lib_frame\n"
                      << "alloc,4096,512,0,1,a.py:1:f,\n"
                      << "free_completed,4096,512,0,2,a.py:1:f,\n"
                      << "free_completed,4096,512,0,3,a.py:1:f,\n";
  try {
    find_leaks(trace::read_trace(path));
    FAIL() << "accepted a double free";
  } catch (const BadInputError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.csv:4"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("which is not live"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace gmem
