// gmem summary [--at end|peak] [--json] FILE...: the memory summary of a trace replayed through gmem.
#include <cstdio>

#include "common/json.hpp"
#include "args.hpp"
#include "commands.hpp"
#include "gmem/summary.hpp"
#include "gmem/trace.hpp"

namespace gmem::cli {

const char kSummaryUsage[] =
    "usage: gmem summary [--at end|peak] [--top N] [--json] [--max-... N] FILE...\n"
    "\n"
    "Replays an allocation trace (PyTorch trace CSV, snapshot pickle, RMM log) through gmem's engine\n"
    "on a simulated device and prints the memory summary at the trace's end or just after its peak\n"
    "of allocated memory: PyTorch's memory_summary() table (allocated, active, requested, reserved,\n"
    "non-releasable; all / large / small pool; current, peak, total allocated, total freed), then\n"
    "where reserved-but-unallocated memory goes (free pages still mapped, chunks not mapped, partial\n"
    "pages, small-class slack), the largest free range, and the sites holding the most live memory.\n"
    "\n"
    "  --at end|peak  where to stop (default: end)\n"
    "  --top N        sites listed (default: 10)\n"
    "  --json         one JSON object per file: {\"trace\", \"at\", \"events\", \"device\", \"note\",\n"
    "                 \"stats\": {PyTorch-style names}, \"reserved_unallocated\", \"largest_free_range\", \"top\"}\n"
    GMEM_CLI_READ_LIMITS_USAGE;

int summary_command(const Args& args) {
  bool json = false;
  SummaryPoint at = SummaryPoint::end;
  std::size_t top = 10;
  trace::ReadLimits limits;
  std::vector<std::string> files;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (parse_read_limit(args, i, limits)) continue;
    if (arg == "--json") {
      json = true;
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
    } else if (arg.starts_with("-")) {
      throw UsageError("unknown option " + arg + " (see gmem help summary)");
    } else {
      files.push_back(arg);
    }
  }
  if (files.empty()) throw UsageError("no trace given (usage: gmem summary [--at end|peak] [--json] FILE...)");
  for (std::size_t i = 0; i < files.size(); ++i) {
    const TraceSummary s = summarize_trace(trace::read_trace(files[i], limits), at, top);
    if (json) {
      // summary_json's object, with the trace and the point first.
      std::string body = summary_json(s.stats, s.top, s.options());
      json::Writer head;
      head.begin_object()
          .field("trace", std::string_view(s.trace_name))
          .field("at", at == SummaryPoint::peak ? "peak" : "end")
          .field("events", std::uint64_t{s.events});
      std::fputs((head.str() + "," + body.substr(1)).c_str(), stdout);
    } else {
      if (i > 0) std::fputs("\n", stdout);
      std::fputs(format_summary(s.stats, s.top, s.options()).c_str(), stdout);
    }
  }
  return 0;
}

}  // namespace gmem::cli
