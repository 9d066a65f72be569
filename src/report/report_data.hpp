// What a report shows of one trace, computed in C++ so that the page only draws: the headline
// (peaks and the cause, as `gmem summary` gives them), the timeline downsampled to a few thousand
// points (envelope.hpp), live memory by site over time, the leak findings, the largest blocks
// live at the peak with their stacks, and the summary table. As one JSON object for the page.
#pragma once

#include <cstddef>
#include <string>

#include "gmem/trace.hpp"

namespace gmem::report {

struct ReportOptions {
  std::size_t columns = 2000;      // timeline columns (two points each)
  std::size_t top_sites = 8;       // sites stacked by name; the others as "other sites"
  std::size_t largest_blocks = 25; // blocks listed at the peak
  std::string axis = "time";       // the x axis the page opens with: "time" or "event"
  bool step_axis = false;          // also the charts by step (for two runs overlaid step by step)
};

// The headline's numbers, also what tests compare with `gmem summary --json`.
struct Headline {
  std::uint64_t peak_allocated = 0;           // gmem's replay: allocated_bytes.all.peak
  std::uint64_t peak_reserved = 0;            // gmem's replay: reserved_bytes.all.peak
  std::uint64_t recorded_peak_reserved = 0;   // the recorded allocator's, from segment events
  bool has_recorded = false;                  // the trace has segment events
  std::string cause;                          // summary_cause(): "cause: NAME: evidence"
  std::string cause_name;
  std::string advice;                         // the cause's first advice
};

struct ReportData {
  std::string trace_name;
  Headline headline;
  std::string json;  // everything the page draws: {"trace", "headline", "timeline", ...}
};

// Replays `trace` (as `gmem summary` does, at its end) and gathers the report. Throws what
// summarize_trace throws (BadInputError naming file and line for a malformed trace).
ReportData build_report(const trace::Trace& trace, const ReportOptions& options = {});

}  // namespace gmem::report
