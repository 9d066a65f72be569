// LeakReport for people and as JSON.
#include <cstdio>
#include <sstream>

#include "common/json.hpp"
#include "gmem/causes.hpp"
#include "gmem/error.hpp"
#include "gmem/leaks.hpp"

namespace gmem {
namespace {

std::string bytes(std::int64_t n) {
  return n < 0 ? "-" + format_bytes(static_cast<std::uint64_t>(-n)) : format_bytes(static_cast<std::uint64_t>(n));
}

// "1.234 s" / "12.345 ms": a time since the trace's start.
std::string since_start(std::int64_t us) {
  char buf[48];
  if (us >= 1'000'000 || us <= -1'000'000) std::snprintf(buf, sizeof buf, "%.3f s", static_cast<double>(us) / 1e6);
  else std::snprintf(buf, sizeof buf, "%.3f ms", static_cast<double>(us) / 1e3);
  return buf;
}

std::string steps_line(const LeakReport& report) {
  std::string line = std::to_string(report.periods) + " step boundaries";
  if (report.steps_marked) return line + ", from " + report.period_source;
  if (report.periods == 0) return line + ": the file has no step markers and none could be inferred";
  return line + ", inferred from " + report.period_source + " (the file has no step markers)";
}

Diagnosis diagnosis_of(const LeakReport& report) {
  CauseEvidence evidence;
  evidence.steps = report.periods;
  evidence.leaks = report.leaks;
  return diagnose(evidence);
}

}  // namespace

std::string format_leaks(const LeakReport& report) {
  std::ostringstream out;
  out << "Leaks in " << report.trace_name << ": " << steps_line(report) << "\n";
  if (report.window.mid_run) out << report.window.describe() << "\n";
  const Diagnosis d = diagnosis_of(report);
  out << "cause: " << d.name << ": " << d.evidence << "\n";
  if (report.leaks.empty()) {
    // Say what was looked at: an empty answer must not read as a clean bill of health when there
    // was nothing to compare.
    const std::string in = report.looked_at.empty() ? "" : " in " + report.looked_at;
    if (report.periods == 0)
      out << "No leaks can be found" << in << ": a leak is a site that keeps more memory at each "
          << "step boundary, and "
          << (report.steps_marked ? "no step has ended yet (call gmem.step() after each training "
                                    "step, or gmem.torch.watch(optimizer))"
                                  : "the trace has none (mark steps with gmem.step())")
          << ".\n";
    else
      out << "No leaks found" << in << " over " << report.periods
          << " steps: no site keeps more memory alive step after step.\n";
    return out.str();
  }
  out << report.leaks.size() << (report.leaks.size() == 1 ? " site keeps" : " sites keep")
      << " more memory alive every step:\n";
  for (const LeakFinding& leak : report.leaks) {
    out << "\n" << leak.site << "\n"
        << "  grows " << bytes(leak.bytes_per_step) << " a step since step " << leak.first_step
        << " (grew in " << leak.growing_periods << " of " << leak.periods << " steps); "
        << bytes(leak.surviving_bytes) << " survive\n";
    if (leak.graph_bytes > 0)
      out << "  " << bytes(leak.graph_bytes) << " of it saved for a backward pass that never used it"
          << (leak.backward_runs ? " (a value kept with its graph)" : " (no backward pass has run)")
          << "\n";
    if (leak.sample.size > 0) {
      out << "  first leaked block still live: " << bytes(static_cast<std::int64_t>(leak.sample.size))
          << " at 0x" << std::hex << leak.sample.addr << std::dec << ", allocated "
          << since_start(leak.sample.time_us - report.start_us) << " into the trace\n";
      std::istringstream frames(leak.sample.stack);
      for (std::string frame; std::getline(frames, frame);) out << "    " << frame << "\n";
    }
  }
  out << "What to do:\n";
  for (const std::string& line : d.advice) out << "  - " << line << "\n";
  return out.str();
}

std::string leaks_json(const LeakReport& report) {
  json::Writer w;
  w.begin_object()
      .field("trace", std::string_view(report.trace_name))
      .field("periods", std::uint64_t{report.periods})
      .field("period_source", std::string_view(report.period_source))
      .field("steps_marked", report.steps_marked)
      .field("start_us", report.start_us);
  const Diagnosis d = diagnosis_of(report);
  w.field("cause", std::string_view(d.name)).field("evidence", std::string_view(d.evidence));
  const trace::HistoryWindow& h = report.window;
  w.key("history")
      .begin_object()
      .field("began_mid_run", h.mid_run)
      .field("events", std::uint64_t{h.events})
      .field("start_us", h.start_us - report.start_us)
      .field("blocks_at_start", std::uint64_t{h.blocks_at_start})
      .field("bytes_at_start", h.bytes_at_start)
      .field("freed_in_history", std::uint64_t{h.freed_in_history})
      .field("has_segments", h.has_segments)
      .field("dropped_events", h.dropped_events)
      .end_object();
  w.key("leaks").begin_array();
  for (const LeakFinding& leak : report.leaks) {
    w.begin_object()
        .field("site", std::string_view(leak.site))
        .field("bytes_per_step", leak.bytes_per_step)
        .field("surviving_bytes", leak.surviving_bytes)
        .field("first_seen_us", leak.first_seen_us - report.start_us)
        .field("first_step", std::uint64_t{leak.first_step})
        .field("periods", std::uint64_t{leak.periods})
        .field("growing_periods", std::uint64_t{leak.growing_periods})
        .field("graph_bytes", leak.graph_bytes)
        .field("backward_runs", leak.backward_runs);
    w.key("sample")
        .begin_object()
        .field("addr", leak.sample.addr)
        .field("size", leak.sample.size)
        .field("time_us", leak.sample.time_us - report.start_us)
        .field("stack", std::string_view(leak.sample.stack))
        .end_object();
    w.end_object();
  }
  w.end_array().end_object();
  return w.str() + "\n";
}

}  // namespace gmem
