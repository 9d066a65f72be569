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
  std::uint8_t lifetime = 0;
};

// Allocated memory by lifetime, the categories a trace can honestly give: it names no
// parameters or gradients, but step boundaries say when each block lived. Stacked bottom up.
enum Lifetime : std::uint8_t { before_steps, kept, saved, this_step, lifetimes };
const char* const kLifetimeNames[lifetimes] = {
    "before the first step (weights, buffers)",
    "kept across steps (optimizer state, caches, leaks)",
    "saved for backward (flagged in the snapshot)",
    "this step's (activations, temporaries)"};

// Each alloc event's lifetime (indexed by event): allocated before the first step boundary;
// live across a later boundary (freed in a later step, or never freed once a later step began);
// or freed in the step that allocated it (or still live in the trace's last step). A block
// never freed that the snapshot flags as saved for backward is that. Steps: an event at or after
// a boundary's time is in the step it begins, as gmem leaks counts them.
std::vector<std::uint8_t> lifetimes_of(const trace::Trace& t, const std::vector<std::int64_t>& step_times) {
  const std::vector<Event>& events = t.events;
  std::vector<std::uint8_t> out(events.size(), this_step);
  std::vector<std::size_t> step_of(events.size(), 0);
  std::unordered_map<std::uint64_t, std::size_t> live;  // addr -> alloc event
  std::size_t step = 0;
  for (std::size_t i = 0; i < events.size(); ++i) {
    const Event& e = events[i];
    while (step < step_times.size() && step_times[step] <= e.time_us) ++step;
    if (e.action == Action::alloc) {
      live[e.addr] = i;
      step_of[i] = step;
      out[i] = step == 0 ? before_steps : this_step;
    } else if (e.action == Action::free_completed) {
      auto it = live.find(e.addr);
      if (it == live.end()) continue;
      if (out[it->second] != before_steps && step > step_of[it->second]) out[it->second] = kept;
      live.erase(it);
    }
  }
  std::unordered_map<std::uint64_t, bool> flagged;
  for (std::uint64_t addr : t.saved_for_backward) flagged[addr] = true;
  for (const auto& [addr, i] : live) {
    if (flagged.count(addr)) out[i] = saved;
    else if (out[i] != before_steps && step > step_of[i]) out[i] = kept;
  }
  return out;
}

void write_array(json::Writer& w, const std::vector<double>& values) {
  w.begin_array();
  for (double v : values) w.value(v);
  w.end_array();
}

// One x axis of the charts: seconds from the first event, the event's index (a trace whose
// interesting part is short next to an idle start reads better by events), or steps (step k
// spans [k, k+1), its events spread evenly: two runs overlaid line up step by step).
struct Axis {
  enum Kind { time, event, step };
  const std::vector<Event>* events;
  Kind kind;
  std::int64_t t0;
  Columns columns;
  std::vector<std::size_t> bounds;  // kind step: the first event of each step after the first

  const char* name() const { return kind == time ? "time" : kind == event ? "event" : "step"; }
  double x(std::size_t i) const {
    if (kind == time) return static_cast<double>((*events)[i].time_us - t0) / 1e6;
    if (kind == event) return static_cast<double>(i);
    const std::size_t k = static_cast<std::size_t>(std::upper_bound(bounds.begin(), bounds.end(), i) - bounds.begin());
    const std::size_t lo = k == 0 ? 0 : bounds[k - 1], hi = k < bounds.size() ? bounds[k] : events->size();
    return static_cast<double>(k) + (hi > lo ? static_cast<double>(i - lo) / static_cast<double>(hi - lo) : 0.0);
  }
  // A time (a step boundary, where a leak began) on this axis.
  double at_time(std::int64_t us) const {
    if (kind == time) return static_cast<double>(us - t0) / 1e6;
    auto it = std::lower_bound(events->begin(), events->end(), us,
                               [](const Event& e, std::int64_t v) { return e.time_us < v; });
    const std::size_t i = static_cast<std::size_t>(it - events->begin());
    if (kind == event || events->empty()) return static_cast<double>(i);
    return i < events->size() ? x(i) : static_cast<double>(bounds.size() + 1);
  }
};

// What the axes share: the sites stacked, the peak, and gmem's replay.
struct Gathered {
  std::vector<std::uint32_t> slot_of;  // site -> stacked slot (`top` for the rest)
  std::size_t slots = 0;
  std::vector<std::size_t> replay_ends;           // events the replay reports at (both axes' column ends)
  std::vector<trace::StepFigures> replay_figures;  // ... what it reported there
  std::vector<std::uint8_t> lifetime;              // each alloc event's (lifetimes_of); empty without steps
};

// The last event of each column on `axis`.
std::vector<std::size_t> column_ends(const Axis& axis, std::size_t n) {
  std::vector<std::size_t> ends;
  std::size_t last = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t column = axis.columns.of(axis.x(i));
    if (i > 0 && column != last) ends.push_back(i - 1);
    last = column;
  }
  if (n) ends.push_back(n - 1);
  return ends;
}

// The charts' series on one axis, as a JSON object: the envelopes, the sites at each column's
// highest point, and where steps, OOMs, leaks and the peak fall.
void write_axis(json::Writer& w, const trace::Trace& t, const Axis& axis, const Gathered& g,
                const TraceSummary& summary, std::size_t peak_event, bool has_recorded) {
  const std::vector<Event>& events = t.events;
  const std::size_t n = events.size();
  const Columns& columns = axis.columns;
  SiteTable sites(t);  // ids as in build_report: the same events in the same order
  Envelope allocated_env(columns), recorded_env(columns), gmem_env(columns);
  std::vector<std::vector<double>> stack(g.slots, std::vector<double>(columns.count, 0.0));
  std::vector<double> slot_bytes(g.slots, 0.0);
  const bool by_lifetime = !g.lifetime.empty();
  std::vector<std::vector<double>> life_stack(by_lifetime ? lifetimes : 0, std::vector<double>(columns.count, 0.0));
  std::vector<double> life_bytes(lifetimes, 0.0);
  // Both stacks take the state at a column's highest point (or its start), so they move together.
  auto snapshot_stacks = [&](std::size_t c) {
    for (std::size_t k = 0; k < g.slots; ++k) stack[k][c] = slot_bytes[k];
    for (std::size_t k = 0; k < life_stack.size(); ++k) life_stack[k][c] = life_bytes[k];
  };
  std::vector<double> column_high(columns.count, -1.0);
  // Each column's highest point as the number of events applied there: the blocks then live
  // are those allocated before it and freed at or after it (the page's zoomed largest blocks).
  std::vector<double> peak_applied(columns.count, static_cast<double>(n));
  std::vector<bool> column_seen(columns.count, false);
  std::vector<double> ooms;
  std::unordered_map<std::uint64_t, LiveBlock> live;
  std::uint64_t allocated = 0, recorded = 0;
  std::size_t last_column = 0;
  std::size_t next_figure = 0;
  std::uint64_t peak_reserved = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const Event& e = events[i];
    const double x = axis.x(i);
    const std::size_t column = columns.of(x);
    if (!column_seen[column]) {
      // A column starts with the sites as they were: the last column's end state.
      column_seen[column] = true;
      for (std::size_t c = last_column + 1; c < column; ++c) snapshot_stacks(c), peak_applied[c] = static_cast<double>(i);
      snapshot_stacks(column);
      peak_applied[column] = static_cast<double>(i);
      column_high[column] = static_cast<double>(allocated);
    }
    last_column = column;
    switch (e.action) {
      case Action::alloc: {
        const std::uint32_t slot = g.slot_of[sites.of(e)];
        const std::uint8_t life = by_lifetime ? g.lifetime[i] : 0;
        live[e.addr] = LiveBlock{rounded(e.size), slot, i, life};
        allocated += rounded(e.size);
        slot_bytes[slot] += static_cast<double>(rounded(e.size));
        life_bytes[life] += static_cast<double>(rounded(e.size));
        allocated_env.set(x, static_cast<double>(allocated));
        if (static_cast<double>(allocated) > column_high[column]) {
          column_high[column] = static_cast<double>(allocated);
          snapshot_stacks(column);
          peak_applied[column] = static_cast<double>(i + 1);
        }
        break;
      }
      case Action::free_completed: {
        auto it = live.find(e.addr);
        if (it == live.end()) break;
        allocated -= it->second.bytes;
        slot_bytes[it->second.site] -= static_cast<double>(it->second.bytes);
        life_bytes[it->second.lifetime] -= static_cast<double>(it->second.bytes);
        live.erase(it);
        allocated_env.set(x, static_cast<double>(allocated));
        break;
      }
      case Action::segment_alloc:
        recorded += e.size;
        recorded_env.set(x, static_cast<double>(recorded));
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
    // gmem's reserved memory where the replay reported it, and its peak where it rose since.
    for (; next_figure < g.replay_figures.size() && g.replay_figures[next_figure].event == i; ++next_figure) {
      const trace::StepFigures& f = g.replay_figures[next_figure];
      if (f.peak_reserved > peak_reserved) gmem_env.set(x, static_cast<double>(f.peak_reserved));
      gmem_env.set(x, static_cast<double>(f.reserved));
      peak_reserved = std::max(peak_reserved, f.peak_reserved);
    }
  }
  for (std::size_t c = last_column + 1; c < columns.count; ++c) snapshot_stacks(c);

  w.begin_object();
  w.key("x");
  write_array(w, envelope_x(columns));
  w.key("allocated");
  write_array(w, allocated_env.points());
  w.key("reserved");
  write_array(w, gmem_env.points());
  w.key("recorded");
  if (has_recorded) write_array(w, recorded_env.points());
  else w.value(nullptr);
  w.key("steps").begin_array();
  for (std::int64_t us : summary.leaks.step_times_us) w.value(axis.at_time(us));
  w.end_array();
  w.key("ooms");
  write_array(w, ooms);
  w.key("leaks").begin_array();
  for (const LeakFinding& f : summary.leaks.leaks) w.value(axis.at_time(f.first_seen_us));
  w.end_array();
  w.field("peak", n ? axis.x(peak_event) : 0.0);
  w.key("sites_x").begin_array();
  for (std::size_t c = 0; c < columns.count; ++c)
    w.value(columns.start + columns.width * (static_cast<double>(c) + 0.5));
  w.end_array();
  w.key("sites").begin_array();
  for (const auto& values : stack) write_array(w, values);
  w.end_array();
  w.key("peak_applied");
  write_array(w, peak_applied);
  w.key("lifetimes");  // as "lifetime_names" lists them (the saved slot only where flagged)
  if (by_lifetime) {
    w.begin_array();
    for (std::size_t k = 0; k < lifetimes; ++k)
      if (k != saved || !t.saved_for_backward.empty()) write_array(w, life_stack[k]);
    w.end_array();
  } else {
    w.value(nullptr);
  }
  w.end_object();
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
  const std::int64_t t0 = n ? events.front().time_us : 0;
  const bool has_times = n && events.back().time_us > t0;
  std::vector<Axis> axes;
  auto add_axis = [&](Axis::Kind kind, std::vector<std::size_t> bounds) {
    Axis a{&events, kind, t0, Columns(0, 0, 1), std::move(bounds)};
    const double end = kind == Axis::step ? static_cast<double>(a.bounds.size() + 1) : n ? a.x(n - 1) : 0;
    a.columns = Columns(0, end, options.columns);
    axes.push_back(std::move(a));
  };
  if (has_times) add_axis(Axis::time, {});
  add_axis(Axis::event, {});
  if (options.step_axis && n && !summary.leaks.step_times_us.empty()) {
    std::vector<std::size_t> bounds;
    for (std::int64_t us : summary.leaks.step_times_us) {
      auto it = std::lower_bound(events.begin(), events.end(), us,
                                 [](const Event& e, std::int64_t v) { return e.time_us < v; });
      const std::size_t i = static_cast<std::size_t>(it - events.begin());
      if (i < n && (bounds.empty() || i > bounds.back())) bounds.push_back(i);
    }
    add_axis(Axis::step, std::move(bounds));
  }

  // Pass 1: live memory by site, the peak, and whether the trace recorded its allocator's segments.
  SiteTable sites(t);
  std::unordered_map<std::uint64_t, LiveBlock> live;
  std::vector<std::uint64_t> site_bytes, site_max;
  std::uint64_t allocated = 0, peak = 0, recorded = 0;
  std::size_t peak_event = 0;
  std::vector<std::pair<std::uint64_t, std::size_t>> at_peak;  // (requested size, event)
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
      recorded += e.size;
      h.recorded_peak_reserved = std::max(h.recorded_peak_reserved, recorded);
    } else if (e.action == Action::segment_free) {
      recorded -= std::min(recorded, e.size);
    }
  }
  // The zoomed range's largest blocks come from the trace's largest blocks (kLargestKept of them,
  // with where they were freed): the page filters those live at the range's peak.
  struct Kept {
    std::uint64_t size;
    std::size_t event, end;  // alloc event; free event (n when never freed)
  };
  std::vector<Kept> kept;
  {
    std::unordered_map<std::uint64_t, std::size_t> open;  // addr -> index in kept
    for (std::size_t i = 0; i < n; ++i) {
      const Event& e = events[i];
      if (e.action == Action::alloc) {
        open[e.addr] = kept.size();
        kept.push_back(Kept{e.size, i, n});
      } else if (e.action == Action::free_completed) {
        auto it = open.find(e.addr);
        if (it == open.end()) continue;
        kept[it->second].end = i;
        open.erase(it);
      }
    }
  }
  constexpr std::size_t kLargestKept = 1000;
  auto larger = [](const Kept& a, const Kept& b) { return a.size != b.size ? a.size > b.size : a.event < b.event; };
  std::uint64_t kept_cut = 0;  // blocks smaller than this were left out (0: none were)
  if (kept.size() > kLargestKept) {
    std::nth_element(kept.begin(), kept.begin() + kLargestKept - 1, kept.end(), larger);
    kept_cut = kept[kLargestKept - 1].size;
    kept.resize(kLargestKept);
  }
  std::sort(kept.begin(), kept.end(), larger);

  // The blocks live at the peak: the events again up to it (cheaper than copying at every new high).
  live.clear();
  for (std::size_t i = 0; n && i <= peak_event; ++i) {
    const Event& e = events[i];
    if (e.action == Action::alloc) live[e.addr] = LiveBlock{e.size, 0, i};
    else if (e.action == Action::free_completed) live.erase(e.addr);
  }
  for (const auto& [addr, block] : live) at_peak.emplace_back(block.bytes, block.event);

  // The stacked sites: the most bytes held at any time first; the others summed into one.
  Gathered g;
  std::vector<std::uint32_t> order(site_max.size());
  for (std::uint32_t s = 0; s < order.size(); ++s) order[s] = s;
  std::sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
    return site_max[a] != site_max[b] ? site_max[a] > site_max[b] : sites.names()[a] < sites.names()[b];
  });
  const std::size_t top = std::min(options.top_sites, order.size());
  g.slots = top + (order.size() > top ? 1 : 0);
  g.slot_of.assign(site_max.size(), static_cast<std::uint32_t>(top));
  for (std::size_t k = 0; k < top; ++k) g.slot_of[order[k]] = static_cast<std::uint32_t>(k);

  // Lifetimes need step boundaries: the trace's markers, or those gmem leaks found.
  if (!summary.leaks.step_times_us.empty()) g.lifetime = lifetimes_of(t, summary.leaks.step_times_us);

  // gmem's replay, reporting at every column's end on either axis (as `gmem summary` replays).
  for (const Axis& a : axes) {
    const std::vector<std::size_t> ends = column_ends(a, n);
    g.replay_ends.insert(g.replay_ends.end(), ends.begin(), ends.end());
  }
  std::sort(g.replay_ends.begin(), g.replay_ends.end());
  g.replay_ends.erase(std::unique(g.replay_ends.begin(), g.replay_ends.end()), g.replay_ends.end());
  {
    trace::ReplayOptions replay_options;
    replay_options.step_ends = g.replay_ends;
    replay_options.record_steps = true;
    g.replay_figures = trace::replay(t, replay_options).per_step;
  }

  json::Writer w;
  w.begin_object();
  w.field("trace", std::string_view(t.name)).field("path", std::string_view(t.path));
  w.field("events", std::uint64_t{n - summary.leaks.window.blocks_at_start});
  w.key("headline").begin_object();
  w.field("peak_allocated", h.peak_allocated).field("peak_reserved", h.peak_reserved);
  if (h.has_recorded) w.field("recorded_peak_reserved", h.recorded_peak_reserved);
  else w.key("recorded_peak_reserved").value(nullptr);
  w.field("timeline_peak_allocated", peak);
  w.field("cause", std::string_view(h.cause)).field("cause_name", std::string_view(h.cause_name));
  w.field("advice", std::string_view(h.advice));
  w.field("history", std::string_view(summary.leaks.window.describe()));
  w.end_object();

  const bool by_step = options.axis == "step" && axes.back().kind == Axis::step;
  w.field("default_axis", by_step ? "step" : has_times && options.axis != "event" ? "time" : "event");
  w.field("steps_found", std::uint64_t{summary.leaks.step_times_us.size()});
  w.key("axes").begin_object();
  for (const Axis& a : axes) {
    w.key(a.name());
    write_axis(w, t, a, g, summary, peak_event, h.has_recorded);
  }
  w.end_object();
  w.key("steps").begin_object().field("source", std::string_view(summary.leaks.period_source));
  w.field("count", std::uint64_t{summary.leaks.step_times_us.size()}).end_object();

  w.key("lifetime_names");
  if (g.lifetime.empty()) {
    w.value(nullptr);
  } else {
    w.begin_array();
    for (std::size_t k = 0; k < lifetimes; ++k)
      if (k != saved || !t.saved_for_backward.empty()) w.value(kLifetimeNames[k]);
    w.end_array();
  }

  w.key("site_names").begin_array();
  for (std::size_t k = 0; k < top; ++k) w.value(sites.names()[order[k]]);
  if (g.slots > top) w.value("other sites (" + std::to_string(order.size() - top) + ")");
  w.end_array();

  // The most each site held at any time, for comparing two runs site by site.
  w.key("site_peaks").begin_array();
  for (std::size_t k = 0; k < order.size() && k < 50; ++k)
    w.begin_object().field("site", sites.names()[order[k]]).field("bytes", site_max[order[k]]).end_object();
  w.end_array();

  w.key("leaks").begin_array();
  for (const LeakFinding& f : summary.leaks.leaks) {
    w.begin_object().field("site", std::string_view(f.site));
    w.field("bytes_per_step", f.bytes_per_step).field("surviving_bytes", f.surviving_bytes);
    w.field("graph_bytes", f.graph_bytes);
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
  w.field("allocated", peak).field("event", std::uint64_t{peak_event});
  w.key("blocks").begin_array();
  for (const auto& [size, event] : at_peak) {
    const Event& e = events[event];
    w.begin_object().field("size", size).field("addr", e.addr).field("event", std::uint64_t{event});
    w.field("time", has_times ? axes.front().x(event) : 0.0);
    w.field("before_history", e.before_history);
    w.field("site", analysis::site_of(t, e)).field("where", analysis::innermost_site_of(t, e));
    w.field("stack", analysis::stack_of(t, e));
    w.end_object();
  }
  w.end_array().end_object();

  // The candidates for a zoomed range, their stacks shared by the blocks of one site.
  std::map<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>, std::size_t> stack_ids;
  std::vector<std::string> stacks;
  w.key("blocks").begin_object().field("smaller_left_out", kept_cut);
  w.key("list").begin_array();
  for (const Kept& k : kept) {
    const Event& e = events[k.event];
    auto [it, added] = stack_ids.try_emplace({e.user_frame, e.lib_frame, e.scope}, stacks.size());
    if (added) stacks.push_back(analysis::stack_of(t, e));
    w.begin_array().value(k.size).value(std::uint64_t{k.event}).value(std::uint64_t{k.end}).value(e.addr);
    w.value(has_times ? axes.front().x(k.event) : 0.0).value(e.before_history);
    w.value(analysis::site_of(t, e)).value(std::uint64_t{it->second}).end_array();
  }
  w.end_array();
  w.key("stacks").begin_array();
  for (const std::string& stack : stacks) w.value(stack);
  w.end_array().end_object();

  w.field("summary", format_summary(summary.stats, summary.top, summary.options()));
  w.end_object();
  data.json = w.take();
  return data;
}

}  // namespace gmem::report
