// gmem leaks [--json] [--check] FILE... (or - for stdin): sites whose surviving memory grows step after step.
#include <cstdio>

#include "args.hpp"
#include "commands.hpp"
#include "gmem/leaks.hpp"
#include "gmem/trace.hpp"

namespace gmem::cli {

const char kLeaksUsage[] =
    "usage: gmem leaks [--json] [--check]"
    GMEM_CLI_READ_LIMITS_SYNOPSIS
    "\n"
    "Finds leaks in allocation traces (PyTorch trace CSV, snapshot pickle, RMM log; - reads one\n"
    "from standard input, its format found from its content): allocations that survive step\n"
    "boundaries, grouped by site (the Python line as file:line:function, else the library frame,\n"
    "else gmem's scope as \"scope NAME\", else <backward>), reported when the bytes a site keeps\n"
    "alive grow step after step. Steps are the file's markers where it has them (gmem's\n"
    "snapshots carry gmem.step(); a PyTorch snapshot's most frequent annotation); otherwise they are\n"
    "inferred from the deep minima of live memory, or from the most frequent allocation when memory\n"
    "never falls back, and the report says which. Optimizer state created once and caches that stop\n"
    "growing are not reported. The first lines give the cause (as the OOM report decides it) and\n"
    "the evidence; times count from the trace's first event. A malformed trace is rejected as\n"
    "`gmem replay` rejects it.\n"
    "\n"
    "  --json   one JSON object per file: {\"trace\", \"periods\", \"period_source\", \"steps_marked\",\n"
    "           \"start_us\", \"cause\", \"evidence\", \"leaks\": [{\"site\", \"bytes_per_step\",\n"
    "           \"surviving_bytes\", \"first_seen_us\", \"first_step\", \"periods\", \"growing_periods\",\n"
    "           \"sample\": {\"addr\", \"size\", \"time_us\", \"stack\"}}]}; times from start_us\n"
    "\n"
    "  --check  exit with status 2 when a leak is found (for CI); otherwise 0, and 1 on errors\n"
    "           (a trace with no allocation events, such as a snapshot taken without\n"
    "           _record_memory_history, is one: it says so and how to record a history)\n"
    GMEM_CLI_READ_LIMITS_USAGE;

int leaks_command(const Args& args) {
  bool json = false, check = false;
  trace::ReadLimits limits;
  std::vector<std::string> files;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (parse_read_limit(args, i, limits)) continue;
    if (arg == "--json") json = true;
    else if (arg == "--check") check = true;
    else if (arg.starts_with("-") && arg != "-") throw UsageError("unknown option " + arg + " (see gmem help leaks)");
    else add_trace_argument(files, arg);
  }
  if (files.empty()) throw UsageError("no trace given: FILE..., or - for standard input (see gmem help leaks)");
  bool found = false, empty = false;
  std::size_t printed = 0;
  for (std::size_t i = 0; i < files.size(); ++i) {
    const trace::Trace t = read_trace_argument(files[i], limits);
    if (report_empty_trace(t, files[i], limits, "look for leaks in")) {
      empty = true;
      continue;
    }
    const LeakReport report = find_leaks(t);
    found = found || !report.leaks.empty();
    if (!json && printed++ > 0) std::fputs("\n", stdout);
    std::fputs((json ? leaks_json(report) : format_leaks(report)).c_str(), stdout);
  }
  if (check && found) return 2;
  return empty ? 1 : 0;  // a trace with nothing in it is not a clean one
}

}  // namespace gmem::cli
