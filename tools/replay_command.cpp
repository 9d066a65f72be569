// gmem replay: how much memory gmem needs for a real trace, next to what PyTorch's allocator took.
#include <cstdio>
#include <string>

#include "args.hpp"
#include "commands.hpp"
#include "common/json.hpp"
#include "gmem/error.hpp"
#include "table.hpp"
#include "trace/replay.hpp"

namespace gmem::cli {

const char kReplayUsage[] =
    "usage: gmem replay [--json] [--capacity BYTES] FILE...\n"
    "\n"
    "Replays each trace's alloc/free sequence through gmem on a simulated device and reports,\n"
    "as ratios to the trace's peak allocated memory: the memory PyTorch's allocator reserved\n"
    "(from the trace's segment events), gmem's peak reserved memory, and the smallest device\n"
    "gmem can run the trace on. Also the device calls gmem made and its host time per call.\n"
    "\n"
    "FILE: a PyTorch trace CSV (.csv or .csv.gz), a snapshot pickle from\n"
    "torch.cuda.memory._dump_snapshot(), or an RMM log.\n"
    "\n"
    "  --capacity BYTES  the simulated device's memory (default 80G; e.g. 16G, 512M)\n"

    "  --json            one JSON object per trace, one per line\n";

namespace {

std::string fixed(double value, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, value);
  return buf;
}

std::string bytes_with_ratio(std::uint64_t bytes, double ratio) {
  if (bytes == 0) return "-";  // e.g. an RMM log has no segment events
  return format_bytes(bytes) + " (" + fixed(ratio, 3) + ")";
}

std::string json_line(const trace::ReplayResult& r, const std::string& path, std::uint64_t min_cap) {
  json::Writer w;
  w.begin_object()
      .field("trace", r.trace)
      .field("path", path)
      .field("events", r.events)
      .field("mallocs", r.mallocs)
      .field("frees", r.frees)
      .field("live_at_end", r.live_at_end)
      .field("capacity", r.capacity)
      .field("peak_allocated", r.peak_allocated)
      .field("recorded_peak_reserved", r.recorded_peak_reserved)
      .field("recorded_ratio", r.recorded_ratio())
      .field("peak_reserved", r.peak_reserved)
      .field("reserved_ratio", r.reserved_ratio())
      .field("min_capacity", min_cap)
      .field("min_capacity_ratio", r.ratio(min_cap))
      .field("creates", r.creates)
      .field("maps", r.maps)
      .field("unmaps", r.unmaps)
      .field("late_device_calls", r.late_device_calls)
      .field("ns_per_op", r.ns_per_op)
      .field("failed", r.failed);
  if (r.failed) w.field("failure", r.failure);
  w.end_object();
  return w.str();
}

}  // namespace

int replay_command(const Args& args) {
  bool as_json = false;
  trace::ReplayOptions options;
  std::vector<std::string> files;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--json") {
      as_json = true;
    } else if (a == "--capacity") {
      options.capacity = parse_bytes(option_value(args, i));
      if (options.capacity == 0) throw UsageError("--capacity must be more than 0");
    } else if (a.starts_with("--capacity=")) {
      options.capacity = parse_bytes(std::string_view(a).substr(11));
    } else if (a.starts_with("-") && a != "-") {
      throw UsageError("replay: unknown option " + a + " (see gmem help replay)");
    } else {
      files.push_back(a);
    }
  }
  if (files.empty()) throw UsageError("replay: no trace given (usage: gmem replay [--json] [--capacity BYTES] FILE...)");

  Table table({"trace", "events", "peak allocated", "PyTorch reserved", "gmem reserved",
               "min capacity", "creates/maps/unmaps", "ns/op"},
              {false, true, true, true, true, true, true, true});
  int status = 0;
  for (const std::string& file : files) {
    const trace::Trace t = trace::read_trace(file);
    const trace::ReplayResult r = trace::replay(t, options);
    const std::uint64_t min_cap = trace::min_capacity(t);
    if (as_json) {
      std::printf("%s\n", json_line(r, file, min_cap).c_str());
      std::fflush(stdout);
    } else {
      table.add({r.trace, std::to_string(r.events), format_bytes(r.peak_allocated),
                 bytes_with_ratio(r.recorded_peak_reserved, r.recorded_ratio()),
                 r.failed ? "FAILED" : bytes_with_ratio(r.peak_reserved, r.reserved_ratio()),
                 bytes_with_ratio(min_cap, r.ratio(min_cap)),
                 std::to_string(r.creates) + "/" + std::to_string(r.maps) + "/" + std::to_string(r.unmaps),
                 fixed(r.ns_per_op, 0)});
    }
    if (r.failed) {
      std::fprintf(stderr, "gmem: %s: replay failed on a %s device: %s\n", r.trace.c_str(),
                   format_bytes(r.capacity).c_str(), r.failure.c_str());
      status = 1;
    }
  }
  if (!as_json) table.print(stdout);
  return status;
}

}  // namespace gmem::cli
