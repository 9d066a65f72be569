// gmem's observability from plain C++: a tracker on an engine, scopes, training steps, a leak
// found across steps, the memory summary, and the report of an out-of-memory.
// Runs on a simulated 1 GiB device; exits nonzero when the planted leak is not found.
#include <cstdio>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/oom_report.hpp"
#include "gmem/scope.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/summary.hpp"
#include "gmem/tracker.hpp"

int main() {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  gmem::SimulatedDevice device(gmem::SimDeviceOptions{1024 * kMiB});
  gmem::Engine engine(device);
  gmem::Tracker tracker(engine);  // records every allocation from now on

  std::vector<void*> losses;  // kept across steps: the leak
  for (int step = 0; step < 8; ++step) {
    gmem::Scope train("train");
    {
      gmem::Scope forward("forward");
      // Call sites, set by hand here; the Python layer sets its stack, and
      // TrackerOptions::capture_backtrace takes a C++ backtrace per allocation instead.
      gmem::frames::set_current("observe_example.cpp:forward");
      void* activations = engine.malloc(64 * kMiB);
      gmem::frames::set_current("observe_example.cpp:loss");
      losses.push_back(engine.malloc(2 * kMiB));
      engine.free(activations);
    }
    tracker.step();  // a step ends: the leak detector takes its sample
  }
  gmem::frames::set_current("");

  const std::vector<gmem::LeakFinding> leaks = tracker.leak_suspects();
  for (const gmem::LeakFinding& leak : leaks)
    std::printf("leak: %s grows %lld bytes a step\n", leak.site.c_str(),
                static_cast<long long>(leak.bytes_per_step));

  std::vector<gmem::TopAllocation> top;
  for (const gmem::UsageGroup& g : tracker.usage_by_scope(5))
    top.push_back({g.key, static_cast<std::int64_t>(g.bytes), static_cast<std::int64_t>(g.count), 0});
  std::printf("%s\n", gmem::memory_summary(engine, top).c_str());

  engine.set_memory_limit(256 * kMiB);
  try {
    engine.malloc(300 * kMiB);
  } catch (const gmem::OutOfMemoryError& e) {
    std::printf("%s\n", gmem::to_text(gmem::build_oom_report(e.info(), &tracker)).c_str());
  }

  for (void* p : losses) engine.free(p);
  const bool found = leaks.size() == 1 && leaks[0].site == "observe_example.cpp:loss" &&
                     leaks[0].bytes_per_step == static_cast<std::int64_t>(2 * kMiB);
  return found ? 0 : 1;
}
