// build_report: one replay for the summary (summarize_trace, as `gmem summary`), one for gmem's
// reserved memory over time, and two passes over the events for everything else.
#include "report/report_data.hpp"

#include <algorithm>
#include <map>
#include <tuple>
#include <unordered_map>

#include "analysis/sites.hpp"
#include "common/json.hpp"
#include "gmem/causes.hpp"
#include "gmem/engine.hpp"
#include "gmem/summary.hpp"
#include "report/envelope.hpp"
#include "trace/replay.hpp"

namespace gmem::report {
namespace {

using trace::Action;
using trace::Event;

std::uint64_t rounded(std::uint64_t size) { return (size + kAlignment - 1) / kAlignment * kAlignment; }

// The cause and its first advice, decided from the same evidence as summary_cause().
Headline headline_of(const TraceSummary& s) {
  Headline h;
  h.peak_allocated = static_cast<std::uint64_t>(s.stats.allocated_bytes[kAllPools].peak);
  h.peak_reserved = static_cast<std::uint64_t>(s.stats.reserved_bytes[kAllPools].peak);
  h.cause = summary_cause(s.stats, s.leaks.leaks, s.leaks.periods);
  CauseEvidence e;
  e.allocated = static_cast<std::size_t>(s.stats.allocated_bytes[kAllPools].current);
  e.reserved = static_cast<std::size_t>(s.stats.reserved_bytes[kAllPools].current);
  e.stranded = static_cast<std::size_t>(s.stats.partial_page_bytes + s.stats.small_slack_bytes);
  e.steps = s.leaks.periods;
  e.leaks = s.leaks.leaks;
  const Diagnosis d = diagnose(e);
  h.cause_name = d.name;
  if (!d.advice.empty()) h.advice = d.advice.front();
  return h;
}

// Sites by the frames that name them, computed once per (user frame, library frame, scope).
class SiteTable {
 public:
  explicit SiteTable(const trace::Trace& t) : t_(t) {}
  std::uint32_t of(const Event& e) {
    auto [it, added] = by_frames_.try_emplace({e.user_frame, e.lib_frame, e.scope}, 0);
    if (added) {
      auto [named, fresh] = by_name_.try_emplace(analysis::innermost_site_of(t_, e),
                                                 static_cast<std::uint32_t>(names_.size()));
      if (fresh) names_.push_back(named->first);
      it->second = named->second;
    }
    return it->second;
  }
  const std::vector<std::string>& names() const { return names_; }

 private:
  const trace::Trace& t_;
  std::map<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>, std::uint32_t> by_frames_;
  std::unordered_map<std::string, std::uint32_t> by_name_;
  std::vector<std::string> names_;
};

struct LiveBlock {
  std::uint64_t bytes = 0;  // rounded, as the replay counts it
  std::uint32_t site = 0;
  std::size_t event = 0;
};

void write_array(json::Writer& w, const std::vector<double>& values) {
  w.begin_array();
  for (double v : values) w.value(v);
  w.end_array();
}

}  // namespace

ReportData build_report(const trace::Trace& t, const ReportOptions& options) {
  const TraceSummary summary = summarize_trace(t, SummaryPoint::end, 10);
  ReportData data;
  data.trace_name = t.name;
  data.headline = headline_of(summary);
  Headline& h = data.headline;

  const std::vector<Event>& events = t.events;
  const std::size_t n = events.size();
  // The x axis: seconds from the first event, or the event's index in a trace without times.
  const std::int64_t t0 = n ? events.front().time_us : 0;
  const bool by_time = n && events.back().time_us > t0;
  auto x_of = [&](std::size_t i) {
    return by_time ? static_cast<double>(events[i].time_us - t0) / 1e6 : static_cast<double>(i);
  };
  const Columns columns(0, n ? x_of(n - 1) : 0, options.columns);

  // Pass 1: live memory by site, the peak, and whether the trace recorded its allocator's segments.
  SiteTable sites(t);
  std::unordered_map<std::uint64_t, LiveBlock> live;
  std::vector<std::uint64_t> site_bytes, site_max;
  std::uint64_t allocated = 0, peak = 0;
  std::size_t peak_event = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const Event& e = events[i];
    if (e.action == Action::alloc) {
      const std::uint32_t site = sites.of(e);
      if (site >= site_bytes.size()) site_bytes.resize(site + 1), site_max.resize(site + 1);
      live[e.addr] = LiveBlock{rounded(e.size), site, i};
      allocated += rounded(e.size);
      site_bytes[site] += rounded(e.size);
      site_max[site] = std::max(site_max[site], site_bytes[site]);
      if (allocated > peak) peak = allocated, peak_event = i;
    } else if (e.action == Action::free_completed) {
      auto it = live.find(e.addr);
      if (it == live.end()) continue;  // summarize_trace has rejected such a trace already
      allocated -= it->second.bytes;
      site_bytes[it->second.site] -= it->second.bytes;
      live.erase(it);
    } else if (e.action == Action::segment_alloc) {
      h.has_recorded = true;
    }
  }

  // The stacked sites: the most bytes held at any time first; the others summed into one.
  std::vector<std::uint32_t> order(site_max.size());
  for (std::uint32_t s = 0; s < order.size(); ++s) order[s] = s;
  std::sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
    return site_max[a] != site_max[b] ? site_max[a] > site_max[b] : sites.names()[a] < sites.names()[b];
  });
  const std::size_t top = std::min(options.top_sites, order.size());
  const std::size_t slots = top + (order.size() > top ? 1 : 0);
  std::vector<std::uint32_t> slot_of(site_max.size(), static_cast<std::uint32_t>(top));
  for (std::size_t k = 0; k < top; ++k) slot_of[order[k]] = static_cast<std::uint32_t>(k);

  // Pass 2: the envelopes, the sites at each column's highest point, the blocks live at the peak.
  Envelope allocated_env(columns), recorded_env(columns);
  std::vector<std::vector<double>> stack(slots, std::vector<double>(columns.count, 0.0));
  std::vector<double> slot_bytes(slots, 0.0);
  std::vector<double> column_high(columns.count, -1.0);
  std::vector<bool> column_seen(columns.count, false);
  std::vector<std::pair<std::uint64_t, std::size_t>> at_peak;  // (requested size, event)
  std::vector<double> ooms;
  std::vector<std::size_t> column_last_event;  // the last event of each column with events
  live.clear();
  allocated = 0;
  std::uint64_t recorded = 0;
  std::size_t last_column = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const Event& e = events[i];
    const double x = x_of(i);
    const std::size_t column = columns.of(x);
    if (i > 0 && column != last_column) column_last_event.push_back(i - 1);
    if (!column_seen[column]) {
      // A column starts with the sites as they were: the last column's end state.
      column_seen[column] = true;
      for (std::size_t c = last_column + 1; c < column; ++c) {
        for (std::size_t k = 0; k < slots; ++k) stack[k][c] = slot_bytes[k];
      }
      for (std::size_t k = 0; k < slots; ++k) stack[k][column] = slot_bytes[k];
      column_high[column] = static_cast<double>(allocated);
    }
    last_column = column;
    switch (e.action) {
      case Action::alloc: {
        const std::uint32_t slot = slot_of[sites.of(e)];
        live[e.addr] = LiveBlock{rounded(e.size), slot, i};
        allocated += rounded(e.size);
        slot_bytes[slot] += static_cast<double>(rounded(e.size));
        allocated_env.set(x, static_cast<double>(allocated));
        if (static_cast<double>(allocated) > column_high[column]) {
          column_high[column] = static_cast<double>(allocated);
          for (std::size_t k = 0; k < slots; ++k) stack[k][column] = slot_bytes[k];
        }
        if (i == peak_event) {
          for (const auto& [addr, block] : live) at_peak.emplace_back(events[block.event].size, block.event);
        }
        break;
      }
      case Action::free_completed: {
        auto it = live.find(e.addr);
        if (it == live.end()) break;
        allocated -= it->second.bytes;
        slot_bytes[it->second.site] -= static_cast<double>(it->second.bytes);
        live.erase(it);
        allocated_env.set(x, static_cast<double>(allocated));
        break;
      }
      case Action::segment_alloc:
        recorded += e.size;
        recorded_env.set(x, static_cast<double>(recorded));
        h.recorded_peak_reserved = std::max(h.recorded_peak_reserved, recorded);
        break;
      case Action::segment_free:
        recorded -= std::min(recorded, e.size);  // as the replay counts a trace cut short
        recorded_env.set(x, static_cast<double>(recorded));
        break;
      case Action::oom:
        ooms.push_back(x);
        break;
      case Action::free_requested:
        break;
    }
  }
  if (n) column_last_event.push_back(n - 1);
  for (std::size_t c = last_column + 1; c < columns.count; ++c)
    for (std::size_t k = 0; k < slots; ++k) stack[k][c] = slot_bytes[k];

  // gmem's reserved memory at the end of each column, and its peak where it rose in a column.
  Envelope gmem_env(columns);
  {
    trace::ReplayOptions replay_options;
    replay_options.step_ends = column_last_event;
    replay_options.record_steps = true;
    const trace::ReplayResult replayed = trace::replay(t, replay_options);
    std::uint64_t peak_so_far = 0;
    for (const trace::StepFigures& f : replayed.per_step) {
      const double x = x_of(f.event);
      if (f.peak_reserved > peak_so_far) gmem_env.set(x, static_cast<double>(f.peak_reserved));
      gmem_env.set(x, static_cast<double>(f.reserved));
      peak_so_far = std::max(peak_so_far, f.peak_reserved);
    }
  }

  json::Writer w;
  w.begin_object();
  w.field("trace", std::string_view(t.name)).field("path", std::string_view(t.path));
  w.field("events", std::uint64_t{n - summary.leaks.window.blocks_at_start});
  w.field("x_unit", by_time ? "s" : "event");
  w.key("headline").begin_object();
  w.field("peak_allocated", h.peak_allocated).field("peak_reserved", h.peak_reserved);
  if (h.has_recorded) w.field("recorded_peak_reserved", h.recorded_peak_reserved);
  else w.key("recorded_peak_reserved").value(nullptr);
  w.field("timeline_peak_allocated", peak);
  w.field("cause", std::string_view(h.cause)).field("cause_name", std::string_view(h.cause_name));
  w.field("advice", std::string_view(h.advice));
  w.field("history", std::string_view(summary.leaks.window.describe()));
  w.end_object();

  w.key("timeline").begin_object();
  w.key("x");
  write_array(w, envelope_x(columns));
  w.key("allocated");
  write_array(w, allocated_env.points());
  w.key("reserved");
  write_array(w, gmem_env.points());
  w.key("recorded");
  if (h.has_recorded) write_array(w, recorded_env.points());
  else w.value(nullptr);
  w.end_object();

  w.key("steps").begin_object();
  w.field("source", std::string_view(summary.leaks.period_source));
  w.key("x").begin_array();
  for (std::int64_t us : summary.leaks.step_times_us) {
    if (by_time) w.value(static_cast<double>(us - t0) / 1e6);
    else {  // the first event at or after the boundary's time
      auto it = std::lower_bound(events.begin(), events.end(), us,
                                 [](const Event& e, std::int64_t v) { return e.time_us < v; });
      w.value(static_cast<double>(it - events.begin()));
    }
  }
  w.end_array().end_object();
  w.key("ooms");
  write_array(w, ooms);

  w.key("sites").begin_object();
  w.key("names").begin_array();
  for (std::size_t k = 0; k < top; ++k) w.value(sites.names()[order[k]]);
  if (slots > top) w.value("other sites (" + std::to_string(order.size() - top) + ")");
  w.end_array();
  w.key("x").begin_array();
  for (std::size_t c = 0; c < columns.count; ++c)
    w.value(columns.start + columns.width * (static_cast<double>(c) + 0.5));
  w.end_array();
  w.key("bytes").begin_array();
  for (const auto& values : stack) write_array(w, values);
  w.end_array().end_object();

  w.key("leaks").begin_array();
  for (const LeakFinding& f : summary.leaks.leaks) {
    w.begin_object().field("site", std::string_view(f.site));
    w.field("bytes_per_step", f.bytes_per_step).field("surviving_bytes", f.surviving_bytes);
    w.field("graph_bytes", f.graph_bytes);
    w.field("first_seen", by_time ? static_cast<double>(f.first_seen_us - t0) / 1e6 : 0.0);
    w.field("first_step", std::uint64_t{f.first_step}).field("periods", std::uint64_t{f.periods});
    w.field("growing_periods", std::uint64_t{f.growing_periods});
    w.field("stack", std::string_view(f.sample.stack));
    w.end_object();
  }
  w.end_array();

  std::sort(at_peak.begin(), at_peak.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  if (at_peak.size() > options.largest_blocks) at_peak.resize(options.largest_blocks);
  w.key("largest").begin_object();
  w.field("x", n ? x_of(peak_event) : 0.0).field("allocated", peak);
  w.key("blocks").begin_array();
  for (const auto& [size, event] : at_peak) {
    const Event& e = events[event];
    w.begin_object().field("size", size).field("addr", e.addr).field("x", x_of(event));
    w.field("before_history", e.before_history);
    w.field("site", analysis::site_of(t, e)).field("where", analysis::innermost_site_of(t, e));
    w.field("stack", analysis::stack_of(t, e));
    w.end_object();
  }
  w.end_array().end_object();

  w.field("summary", format_summary(summary.stats, summary.top, summary.options()));
  w.end_object();
  data.json = w.take();
  return data;
}

}  // namespace gmem::report
