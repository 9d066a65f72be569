// summarize_trace: the trace replayed through the engine up to its end or its peak, then the
// engine's stats and the live blocks grouped by the innermost frame that allocated them.
#include <unordered_map>

#include "analysis/sites.hpp"
#include "gmem/summary.hpp"
#include "trace/replay.hpp"

namespace gmem {
namespace {

// The first event after which allocated memory (live blocks rounded as the engine rounds them,
// freed at free_completed as the replay frees them) is at its highest.
std::size_t peak_event(const trace::Trace& t) {
  std::unordered_map<std::uint64_t, std::uint64_t> live;
  std::uint64_t allocated = 0, peak = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const trace::Event& e = t.events[i];
    if (e.action == trace::Action::alloc) {
      const std::uint64_t size = (e.size + kAlignment - 1) / kAlignment * kAlignment;
      live[e.addr] = size;
      allocated += size;
      if (allocated > peak) {
        peak = allocated;
        at = i;
      }
    } else if (e.action == trace::Action::free_completed) {
      auto it = live.find(e.addr);
      if (it == live.end()) continue;  // the replay reports it
      allocated -= it->second;
      live.erase(it);
    }
  }
  return at;
}

}  // namespace

SummaryOptions TraceSummary::options() const {
  SummaryOptions o;
  o.device = "simulated";
  o.note = trace_name + (at == SummaryPoint::peak ? " at peak allocated" : " at its end") + " (" +
           std::to_string(events - leaks.window.blocks_at_start) + " events replayed)";
  o.cause = summary_cause(stats, leaks.leaks, leaks.periods);
  o.history = leaks.window.describe();
  return o;
}

TraceSummary summarize_trace(const trace::Trace& t, SummaryPoint at, std::size_t top_n) {
  TraceSummary summary;
  summary.trace_name = t.name;
  summary.at = at;
  summary.events = at == SummaryPoint::peak && !t.events.empty() ? peak_event(t) + 1 : t.events.size();
  if (summary.events > 0) summary.time_us = t.events[summary.events - 1].time_us;

  trace::ReplayOptions options;
  options.stop_at_event = summary.events;
  options.on_stop = [&](const Engine& engine, const std::vector<std::pair<std::uint32_t, void*>>& live) {
    summary.stats = engine.detailed_stats();
    std::vector<std::pair<std::string, std::int64_t>> sites;
    sites.reserve(live.size());
    for (const auto& [event, ptr] : live)
      sites.emplace_back(analysis::innermost_site_of(t, t.events[event]),
                         static_cast<std::int64_t>(engine.block_info(ptr).size));
    summary.top = top_sites(sites, top_n);
  };
  const trace::ReplayResult result = trace::replay(t, options);
  if (result.failed) throw Error(Errc::out_of_memory, "replaying " + t.path + ": " + result.failure);
  summary.leaks = find_leaks(t);
  return summary;
}

}  // namespace gmem
