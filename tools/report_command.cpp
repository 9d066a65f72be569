// gmem report FILE... -o report.html [--png timeline.png]: one self-contained HTML page of where
// memory went (src/report/), that opens offline.
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "args.hpp"
#include "commands.hpp"
#include "gmem/error.hpp"
#include "gmem/trace.hpp"
#include "report/html_page.hpp"
#include "report/png.hpp"
#include "report/report_data.hpp"

namespace gmem::cli {

const char kReportUsage[] =
    "usage: gmem report -o REPORT.html [--png TIMELINE.png] [--axis time|events|steps] [--columns N]\n"
    "       [--top N] [--ranks] [--fit FIT.json]"
    GMEM_CLI_READ_LIMITS_SYNOPSIS
    "\n"
    "Writes one self-contained HTML page of where a trace's memory went (PyTorch trace CSV,\n"
    "snapshot pickle, RMM log, gmem's snapshots; - reads one from standard input): the peaks and\n"
    "the cause as `gmem summary` gives them, allocated and reserved memory over time (gmem's\n"
    "replay and the recorded allocator's) with step boundaries, out-of-memory events and leaks\n"
    "marked, allocated memory stacked by site, the leak findings, the largest blocks live at the\n"
    "peak with their stacks, and the summary table. Dragging across the timeline zooms, and the\n"
    "tables follow the range. The chart library (uPlot), its license and the data are inlined:\n"
    "the page fetches nothing and opens offline. Events are downsampled in gmem (each series'\n"
    "low and high in every pixel column), so a trace of millions of events makes a page of a\n"
    "few MB. Two traces (FILE A, FILE B): B's memory overlaid on A's step by step (x: steps), and\n"
    "the most each site held in either. docs/report.md says what each part shows.\n"
    "\n"
    "  -o, --output FILE  the HTML file to write (required)\n"
    "  --png FILE         also write the timeline as a PNG, through headless Chromium (chromium\n"
    "                     or google-chrome on PATH, or $GMEM_CHROMIUM), for CI logs and issues\n"
    "  --axis time|events|steps  the x axis the page opens with (default time, steps for two\n"
    "                     traces; the page switches): events spreads steps that an idle start\n"
    "                     squeezes into a sliver of time; steps puts step k at [k, k+1)\n"
    "  --columns N        timeline columns, two points each (default 2000)\n"
    "  --top N            sites stacked by name before the rest are summed (default 8)\n"
    "  --ranks            the files are one trace or snapshot per rank of a distributed job, rank 0\n"
    "                     first: rank 0's page with every rank's allocated memory overlaid step by\n"
    "                     step, and a table of the ranks' peaks with the imbalance (as gmem summary\n"
    "                     --ranks gives it)\n"
    "  --fit FIT.json     also the batch-size fit's table: gmem.fit_batch_size(...).as_dict() as\n"
    "                     JSON (gmem.report() passes the last fit of the process)\n"
    GMEM_CLI_READ_LIMITS_USAGE;

int report_command(const Args& args) {
  std::string output, png, fit_file;
  bool ranks = false;
  report::ReportOptions options;
  trace::ReadLimits limits;
  std::vector<std::string> files;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (parse_read_limit(args, i, limits)) continue;
    if (arg == "-o" || arg == "--output") output = option_value(args, i);
    else if (arg == "--png") png = option_value(args, i);
    else if (arg == "--ranks") ranks = true;
    else if (arg == "--fit") fit_file = option_value(args, i);
    else if (arg == "--axis") {
      const std::string& axis = option_value(args, i);
      if (axis != "time" && axis != "events" && axis != "steps")
        throw UsageError("--axis takes time, events or steps, not '" + axis + "'");
      options.axis = axis == "time" ? "time" : axis == "events" ? "event" : "step";
    } else if (arg == "--columns") options.columns = parse_count(arg, option_value(args, i));
    else if (arg == "--top") options.top_sites = parse_count(arg, option_value(args, i));
    else if (arg.starts_with("-") && arg != "-") throw UsageError("unknown option " + arg + " (see gmem help report)");
    else add_trace_argument(files, arg);
  }
  if (files.empty()) throw UsageError("no trace given: FILE..., or - for standard input (see gmem help report)");
  if (output.empty()) throw UsageError("no output given: -o REPORT.html (see gmem help report)");
  if (files.size() > 2 && !ranks)
    throw UsageError("one trace, or two to compare (or --ranks: one a rank), a report: " +
                     std::to_string(files.size()) + " given");
  options.step_axis = files.size() >= 2 || options.axis == "step";
  if (options.columns > 100000) throw UsageError("--columns takes at most 100000");
  if (!report::have_chart_library()) {
    std::fprintf(stderr, "gmem: report: %s\n", report::missing_chart_library_message().c_str());
    return 1;
  }
  // The fit first: a bad file stops before the traces are read.
  std::string fit_html;
  if (!fit_file.empty()) {
    std::ifstream in(fit_file, std::ios::binary);
    if (!in) throw std::runtime_error(fit_file + ": cannot open the fit: " + std::strerror(errno));
    std::string text;
    char buffer[65536];
    while (in.read(buffer, sizeof buffer) || in.gcount() > 0) {
      text.append(buffer, static_cast<std::size_t>(in.gcount()));
      // A fit's JSON is a few KB; anything this large is not one.
      if (text.size() > (std::size_t{16} << 20)) throw BadInputError(fit_file, 0, "over 16 MiB: not a batch-size fit's JSON");
    }
    fit_html = report::fit_section(text, fit_file);
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<report::ReportData> reports;
  std::size_t events = 0;
  for (const std::string& file : files) {
    const trace::Trace t = read_trace_argument(file, limits);
    if (report_empty_trace(t, file, limits, "report")) return 1;
    events += t.events.size();
    reports.push_back(report::build_report(t, options));
  }
  const std::vector<report::ReportData> others(std::make_move_iterator(reports.begin() + 1),
                                               std::make_move_iterator(reports.end()));
  const std::string page = report::html_page(reports[0], others, ranks, fit_html);
  {
    std::ofstream out(output, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error(output + ": cannot open for writing: " + std::strerror(errno));
    out.write(page.data(), static_cast<std::streamsize>(page.size()));
    out.close();
    if (!out) throw std::runtime_error(output + ": write failed: " + std::strerror(errno));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "gmem: wrote %s (%s, %zu events, %.2f s)\n", output.c_str(),
               format_bytes(page.size()).c_str(), events, seconds);
  if (!png.empty()) return report::write_timeline_png(output, png) ? 0 : 1;
  return 0;
}

}  // namespace gmem::cli
