// gmem summary [--at end|peak] [--json] [--ranks] FILE... (or - for stdin): the memory summary of a trace replayed
// through gmem; with --ranks, one row per rank's trace, compared.
#include <algorithm>
#include <cstdio>

#include "common/json.hpp"
#include "args.hpp"
#include "commands.hpp"
#include "gmem/error.hpp"
#include "gmem/summary.hpp"
#include "gmem/trace.hpp"

namespace gmem::cli {

const char kSummaryUsage[] =
    "usage: gmem summary [--at end|peak] [--top N] [--json] [--ranks]"
    GMEM_CLI_READ_LIMITS_SYNOPSIS
    "\n"
    "Replays an allocation trace (PyTorch trace CSV, snapshot pickle, RMM log; - reads one from\n"
    "standard input, its format found from its content) through gmem's engine on a simulated\n"
    "device and prints the memory summary at the trace's end or just after its peak\n"
    "of allocated memory: PyTorch's memory_summary() table (allocated, active, requested, reserved,\n"
    "non-releasable; all / large / small pool; current, peak, total allocated, total freed), then\n"
    "where reserved-but-unallocated memory goes (free pages still mapped, chunks not mapped, partial\n"
    "pages, small-class slack), the largest free range, and the sites holding the most live memory.\n"
    "\n"
    "  --at end|peak  where to stop (default: end)\n"
    "  --top N        sites listed (default: 10)\n"
    "  --json         one JSON object per file: {\"trace\", \"at\", \"events\", \"device\", \"note\",\n"
    "                 \"stats\": {PyTorch-style names}, \"reserved_unallocated\", \"largest_free_range\", \"top\"}\n"
    "  --ranks        the files are one trace or snapshot per rank of a distributed job, rank 0\n"
    "                 first: one table, a row per rank (allocated, peaks, gmem's reserved, the top\n"
    "                 site), the imbalance, and the top sites of the rank that sets the peak\n"
    "                 (with --json: {\"ranks\": [...], \"peak_rank\", \"imbalance\"})\n"
    GMEM_CLI_READ_LIMITS_USAGE;

namespace {

// One table over the ranks' summaries (files given rank 0 first).
void print_ranks(const std::vector<TraceSummary>& ranks, bool json) {
  auto peak_reserved = [](const TraceSummary& s) { return s.stats.reserved_bytes[kAllPools].peak; };
  auto bytes = [](std::int64_t n) { return format_bytes(static_cast<std::uint64_t>(std::max<std::int64_t>(n, 0))); };
  std::size_t peak_rank = 0;
  std::int64_t total = 0, lowest = peak_reserved(ranks[0]);
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    if (peak_reserved(ranks[r]) > peak_reserved(ranks[peak_rank])) peak_rank = r;
    total += peak_reserved(ranks[r]);
    lowest = std::min(lowest, peak_reserved(ranks[r]));
  }
  const double mean = static_cast<double>(total) / static_cast<double>(ranks.size());
  const double imbalance = mean > 0 ? static_cast<double>(peak_reserved(ranks[peak_rank])) / mean : 1.0;
  if (json) {
    json::Writer w;
    w.begin_object().key("ranks").begin_array();
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      const MemoryStats& st = ranks[r].stats;
      w.begin_object()
          .field("rank", std::uint64_t{r})
          .field("trace", std::string_view(ranks[r].trace_name))
          .field("allocated", st.allocated_bytes[kAllPools].current)
          .field("peak_allocated", st.allocated_bytes[kAllPools].peak)
          .field("reserved", st.reserved_bytes[kAllPools].current)
          .field("peak_reserved", st.reserved_bytes[kAllPools].peak)
          .key("top")
          .begin_array();
      for (const TopAllocation& t : ranks[r].top)
        w.begin_object().field("site", std::string_view(t.site)).field("bytes", t.bytes).end_object();
      w.end_array().end_object();
    }
    w.end_array().field("peak_rank", std::uint64_t{peak_rank}).field("imbalance", imbalance).end_object();
    std::puts(w.str().c_str());
    return;
  }
  std::printf("%-5s %-24s %12s %12s %14s %14s  %s\n", "rank", "trace", "allocated", "peak alloc",
              "gmem reserved", "peak reserved", "top site");
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const MemoryStats& st = ranks[r].stats;
    const std::string top =
        ranks[r].top.empty() ? "-" : ranks[r].top[0].site + " (" + bytes(ranks[r].top[0].bytes) + ")";
    std::printf("%-5zu %-24.24s %12s %12s %14s %14s  %s\n", r, ranks[r].trace_name.c_str(),
                bytes(st.allocated_bytes[kAllPools].current).c_str(),
                bytes(st.allocated_bytes[kAllPools].peak).c_str(),
                bytes(st.reserved_bytes[kAllPools].current).c_str(),
                bytes(st.reserved_bytes[kAllPools].peak).c_str(), top.c_str());
  }
  std::printf("imbalance: rank %zu peaks at %s, %.2fx the mean over ranks, %s above the lowest\n",
              peak_rank, bytes(peak_reserved(ranks[peak_rank])).c_str(), imbalance,
              bytes(peak_reserved(ranks[peak_rank]) - lowest).c_str());
  if (!ranks[peak_rank].top.empty()) {
    std::printf("rank %zu holds most at:\n", peak_rank);
    for (const TopAllocation& t : ranks[peak_rank].top)
      std::printf("  %12s  %s\n", bytes(t.bytes).c_str(), t.site.c_str());
  }
}

}  // namespace

int summary_command(const Args& args) {
  bool json = false;
  bool ranks = false;
  SummaryPoint at = SummaryPoint::end;
  std::size_t top = 10;
  trace::ReadLimits limits;
  std::vector<std::string> files;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (parse_read_limit(args, i, limits)) continue;
    if (arg == "--json") {
      json = true;
    } else if (arg == "--ranks") {
      ranks = true;
    } else if (arg == "--at") {
      const std::string& where = option_value(args, i);
      if (where == "end") at = SummaryPoint::end;
      else if (where == "peak") at = SummaryPoint::peak;
      else throw UsageError("--at takes end or peak, not '" + where + "'");
    } else if (arg == "--top") {
      const std::string& n = option_value(args, i);
      if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos || n.size() > 6)
        throw UsageError("--top takes a count, not '" + n + "'");
      top = std::stoul(n);
    } else if (arg.starts_with("-") && arg != "-") {
      throw UsageError("unknown option " + arg + " (see gmem help summary)");
    } else {
      add_trace_argument(files, arg);
    }
  }
  if (files.empty()) throw UsageError("no trace given: FILE..., or - for standard input (see gmem help summary)");
  if (ranks) {
    std::vector<TraceSummary> summaries;
    bool empty = false;
    for (const std::string& file : files) {
      const trace::Trace t = read_trace_argument(file, limits);
      empty = report_empty_trace(t, file, limits, "summarize") || empty;
      summaries.push_back(summarize_trace(t, at, top));
    }
    if (empty) return 1;  // a rank with no events would read as a rank that used no memory
    print_ranks(summaries, json);
    return 0;
  }
  int status = 0;
  std::size_t printed = 0;
  for (std::size_t i = 0; i < files.size(); ++i) {
    const trace::Trace t = read_trace_argument(files[i], limits);
    if (report_empty_trace(t, files[i], limits, "summarize")) {
      status = 1;
      continue;
    }
    const TraceSummary s = summarize_trace(t, at, top);
    if (json) {
      // summary_json's object, with the trace and the point first.
      std::string body = summary_json(s.stats, s.top, s.options());
      json::Writer head;
      head.begin_object()
          .field("trace", std::string_view(s.trace_name))
          .field("at", at == SummaryPoint::peak ? "peak" : "end")
          .field("events", std::uint64_t{s.events - s.leaks.window.blocks_at_start});
      std::fputs((head.str() + "," + body.substr(1)).c_str(), stdout);
    } else {
      if (printed++ > 0) std::fputs("\n", stdout);
      std::fputs(format_summary(s.stats, s.top, s.options()).c_str(), stdout);
    }
  }
  return status;
}

}  // namespace gmem::cli
