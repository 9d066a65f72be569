// find_leaks over a trace: the allocations as the program saw them, steps from the trace's markers
// (or inferred where it has none), fed to a LeakDetector up to the last step boundary.
#include <algorithm>
#include <map>
#include <tuple>
#include <unordered_map>

#include "analysis/sites.hpp"
#include "analysis/step_finder.hpp"
#include "gmem/leaks.hpp"
#include "gmem/trace.hpp"
#include "trace/replay.hpp"

namespace gmem {
namespace {

// An allocation or a free as the program made it. A block counts as freed when the program
// released it (free_requested), not when the allocator could reuse it (free_completed, later
// when other streams still used it): a leak is memory the program still holds.
struct Op {
  const trace::Event* event;
  bool alloc;
};

std::vector<Op> program_ops(const trace::Trace& trace, std::vector<std::int64_t>& live_curve) {
  std::vector<Op> ops;
  std::unordered_map<std::uint64_t, std::uint64_t> live;  // addr -> size
  std::int64_t live_bytes = 0;
  auto release = [&](const trace::Event& event) {
    auto it = live.find(event.addr);
    if (it == live.end()) return;  // completes an earlier free_requested, or allocated before the trace
    live_bytes -= static_cast<std::int64_t>(it->second);
    live.erase(it);
    ops.push_back({&event, false});
    live_curve.push_back(live_bytes);
  };
  for (const trace::Event& event : trace.events) {
    if (event.before_history) {  // live when the history began: older than it, never its leak
      live[event.addr] = event.size;
      live_bytes += static_cast<std::int64_t>(event.size);
      continue;
    }
    switch (event.action) {
      case trace::Action::alloc:
        release(event);  // an address reused without a free: the free was missed
        live[event.addr] = event.size;
        live_bytes += static_cast<std::int64_t>(event.size);
        ops.push_back({&event, true});
        live_curve.push_back(live_bytes);
        break;
      case trace::Action::free_requested:
      case trace::Action::free_completed:
        release(event);
        break;
      default:
        break;
    }
  }
  return ops;
}

// Step boundaries from the trace's markers: each just before the first op at or after its time
// (ops.size() for a marker after the last op). A history that began mid-run counts only the
// markers inside it: the steps before it left no events to compare.
std::vector<std::size_t> marked_boundaries(const trace::Trace& trace, const std::vector<Op>& ops,
                                           std::vector<std::int64_t>& times) {
  std::vector<std::size_t> boundaries;
  std::size_t i = 0;
  for (std::int64_t t : trace.steps_us) {
    if (trace.window.mid_run && t < trace.window.start_us) continue;
    times.push_back(t);
    while (i < ops.size() && ops[i].event->time_us < t) ++i;
    boundaries.push_back(i);
  }
  return boundaries;
}

// Step boundaries as op indices, inferred: a boundary b comes just before ops[b].
std::vector<std::size_t> inferred_boundaries(const std::vector<Op>& ops,
                                             const std::vector<std::int64_t>& live_curve,
                                             std::string& source) {
  std::vector<std::size_t> boundaries;
  for (std::size_t end : analysis::step_ends_from_live_minima(live_curve))
    if (end + 1 < ops.size()) boundaries.push_back(end + 1);
  if (boundaries.size() >= 3) {
    source = "live-memory minima";
    return boundaries;
  }
  // Memory never falls back: the most frequent allocation (frames and size) marks the steps.
  std::map<std::tuple<std::uint32_t, std::uint32_t, std::uint64_t>, std::uint64_t> ids;
  std::vector<std::uint64_t> keys;
  std::vector<std::size_t> alloc_ops;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (!ops[i].alloc) continue;
    const trace::Event& e = *ops[i].event;
    keys.push_back(ids.emplace(std::make_tuple(e.user_frame, e.lib_frame, e.size), ids.size()).first->second);
    alloc_ops.push_back(i);
  }
  boundaries.clear();
  for (std::size_t start : analysis::step_starts_from_recurrence(keys))
    if (alloc_ops[start] > 0) boundaries.push_back(alloc_ops[start]);
  source = boundaries.empty() ? "none" : "recurring allocation";
  return boundaries;
}

}  // namespace

LeakReport find_leaks(const trace::Trace& trace, LeakOptions options) {
  trace::check_trace(trace);  // rejects what replay and summary reject, with the same message
  LeakReport report;
  report.trace_name = trace.name;
  report.window = trace.window;
  const auto allocs = std::count_if(trace.events.begin(), trace.events.end(),
                                    [](const trace::Event& e) { return e.action == trace::Action::alloc; });
  report.looked_at = std::to_string(allocs) + (allocs == 1 ? " allocation" : " allocations");
  if (!trace.events.empty()) report.start_us = trace.events.front().time_us;
  std::vector<std::int64_t> live_curve;
  const std::vector<Op> ops = program_ops(trace, live_curve);
  std::vector<std::size_t> boundaries;
  std::vector<std::int64_t> marker_times;  // of the boundaries, when marked
  if (!trace.steps_us.empty()) {
    boundaries = marked_boundaries(trace, ops, marker_times);
    report.period_source = trace.steps_source;
    report.steps_marked = true;
  } else {
    boundaries = inferred_boundaries(ops, live_curve, report.period_source);
  }
  report.periods = boundaries.size();
  if (boundaries.empty()) return report;

  // Sites and stacks repeat: compute each (user frame, library frame, scope)'s once.
  std::map<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>, std::pair<std::string, std::string>> names;
  LeakDetector detector(options);
  std::size_t next = 0;
  auto step_time = [&](std::size_t b) {
    if (report.steps_marked) return marker_times[b];
    return ops[boundaries[b]].event->time_us;
  };
  for (std::size_t b = 0; b < boundaries.size(); ++b) report.step_times_us.push_back(step_time(b));
  for (std::size_t i = 0; i < boundaries.back(); ++i) {  // the teardown after the loop is left out
    const trace::Event& e = *ops[i].event;
    while (next < boundaries.size() && boundaries[next] == i) {
      detector.on_step(step_time(next));
      ++next;
    }
    if (!ops[i].alloc) {
      detector.on_free(e.addr);
      continue;
    }
    auto [it, added] = names.try_emplace({e.user_frame, e.lib_frame, e.scope});
    if (added) it->second = {analysis::site_of(trace, e), analysis::stack_of(trace, e)};
    detector.on_alloc(e.addr, e.size, it->second.first, e.time_us, it->second.second);
  }
  for (; next < boundaries.size(); ++next) detector.on_step(step_time(next));  // markers at the end
  // Graph tracking's state at the snapshot (gmem's snapshots): blocks saved for a backward pass.
  if (trace.backward_runs) detector.on_backward();
  for (std::uint64_t addr : trace.saved_for_backward) detector.on_saved(addr, true);
  report.leaks = detector.findings();
  return report;
}

}  // namespace gmem
