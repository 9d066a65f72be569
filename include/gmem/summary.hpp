// memory_summary(): the table PyTorch users know (torch.cuda.memory_summary()), then what PyTorch
// does not show: where reserved-but-unallocated memory goes, the largest free range, and the live
// allocations grouped by scope or site.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gmem/leaks.hpp"
#include "gmem/stats.hpp"

namespace gmem {

// Live allocations of one site (a scope, or a "file:line:function" frame).
struct TopAllocation {
  std::string site;
  std::int64_t bytes = 0;    // live bytes allocated there
  std::int64_t count = 0;    // live allocations
  std::int64_t largest = 0;  // the largest of them
};

// Groups live allocations, given as (site, bytes), by site: the `n` sites holding the most bytes,
// most first (ties: by name).
std::vector<TopAllocation> top_sites(const std::vector<std::pair<std::string, std::int64_t>>& live,
                                     std::size_t n = 10);

struct SummaryOptions {
  std::string device = "0";  // named in the title
  std::string note;          // a line under the title ("leak_losses at peak allocated, event 1234")
  bool abbreviated = false;  // PyTorch's: without the large / small pool rows
  std::string cause;         // "cause: NAME: evidence", the last section ("" for none): summary_cause()
  // Where the trace's history began, when mid-run (trace::HistoryWindow::describe()); "" otherwise.
  std::string history;
};

// A summary's cause line, decided as OOM reports decide theirs (gmem/causes.hpp), with no failed
// request: a leak among `leaks` (found over `steps` steps), else fragmentation where free memory
// stranded in pages and slabs shared with live blocks is a tenth of reserved or more, else none.
std::string summary_cause(const MemoryStats& stats, const std::vector<LeakFinding>& leaks, std::uint64_t steps);

// The summary as a 75-column text table, PyTorch's layout and units, then gmem's section.
std::string format_summary(const MemoryStats& stats, const std::vector<TopAllocation>& top = {},
                           const SummaryOptions& options = {});

// The same as one JSON object: {"device", "note", "stats": {PyTorch-style name: value, ...},
// "reserved_unallocated": {...}, "largest_free_range", "top": [{"site", "bytes", "count", "largest"}]}.
std::string summary_json(const MemoryStats& stats, const std::vector<TopAllocation>& top = {},
                         const SummaryOptions& options = {});

class Engine;

// torch.cuda.memory_summary() for a gmem engine: its stats now, its device named in the title, and
// `top` (a Tracker's usage_by_site, say) as the sites section.
std::string memory_summary(const Engine& engine, const std::vector<TopAllocation>& top = {},
                           bool abbreviated = false);

namespace trace {
struct Trace;
}

enum class SummaryPoint { end, peak };

// A trace (or snapshot) replayed through gmem's engine on a simulated device, stopped at its end or
// just after the event at which allocated memory peaked.
struct TraceSummary {
  std::string trace_name;
  SummaryPoint at = SummaryPoint::end;
  std::size_t events = 0;  // trace events replayed
  std::int64_t time_us = 0;  // time of the last event replayed
  MemoryStats stats;
  // Live blocks by their innermost frame: the library frame (the layer) when the trace has one,
  // else the user's line, else "<backward>".
  std::vector<TopAllocation> top;
  LeakReport leaks;  // the leak test over the whole trace (find_leaks)
  SummaryOptions options() const;  // a note naming the trace and the point, and the cause
};

TraceSummary summarize_trace(const trace::Trace& trace, SummaryPoint at = SummaryPoint::end,
                             std::size_t top_n = 10);

}  // namespace gmem
