// gmem replay: how much memory gmem needs for a real trace, next to what PyTorch's allocator took.
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "analysis/step_finder.hpp"
#include "args.hpp"
#include "commands.hpp"
#include "common/json.hpp"
#include "gmem/error.hpp"
#include "table.hpp"
#include "trace/replay.hpp"

namespace gmem::cli {

// The default lag of the simulated GPU behind the host. PyTorch queues kernels asynchronously,
// and on a busy GPU its host runs several ms ahead (up to the launch queue's depth, or the next
// sync such as loss.item()); 2 ms is the low end of that, so the replay errs on the side of a GPU
// that catches up early. --lag 0 gives the earlier model, where stream work completes at once.
constexpr double kDefaultLagUs = 2000;

const char kReplayUsage[] =
    "usage: gmem replay [--json] [--wide] [--explain] [--no-plan] [--steps] [--step-at FRAME]\n"
    "       [--capacity BYTES] [--lag US] [--page-size BYTES] [--passes N] [--empty-cache]\n"
    "       [--strict-empty-cache] [--map-ahead] [--malloc-log FILE]"
    GMEM_CLI_READ_LIMITS_SYNOPSIS
    "\n"
    "Replays each trace's alloc/free sequence through gmem on a simulated device and reports,\n"
    "as ratios to the trace's peak allocated memory: the memory PyTorch's allocator reserved\n"
    "(from the trace's segment events), gmem's peak reserved memory, and the smallest device\n"
    "gmem can run the trace on. Also the device calls gmem made, its host time per call, and\n"
    "the modelled time a training step spends on the device layer.\n"
    "\n"
    "Each training step is marked, as gmem.torch marks one after every optimizer step: steps\n"
    "whose shapes take turns are laid out from their last occurrence (planned step layouts,\n"
    "docs/engine.md). Steps end after --step-at's frame where it is given, else at the trace's\n"
    "own gmem.step() markers (a snapshot written under gmem), else where live memory falls back\n"
    "to its baseline. --no-plan replays without marks, as a program that never calls\n"
    "gmem_mark_step.\n"
    "\n"
    "The simulated GPU runs behind the host, as a real one does: the host clock follows the\n"
    "trace's timestamps, and an event recorded on a stream completes --lag microseconds later.\n"
    "Memory freed on a stream is unmapped (cuMemUnmap is not stream-ordered) only once that\n"
    "stream has caught up, and moves to another stream once it has or once the other stream\n"
    "is made to wait for it on the GPU (cuStreamWaitEvent: a stream handover, no host wait);\n"
    "when gmem must wait, the host waits and the rest of the trace happens that much later.\n"
    "\n"
    "device ms/step: modelled host time in device calls (priced as measured on an H100, per\n"
    "2 MiB: cuMemCreate 15 us, cuMemMap 2, cuMemSetAccess 38, cuMemUnmap 22, cuMemRelease 16;\n"
    "event calls 0.5-1 us) plus time waiting for streams, over the second half of the trace,\n"
    "divided by the training steps ending in it.\n"
    "Where no steps are found it is the whole second half's time in ms, marked \"(half)\".\n"
    "\n"
    "FILE: a PyTorch trace CSV (.csv or .csv.gz), a snapshot pickle from\n"
    "torch.cuda.memory._dump_snapshot(), or an RMM log; - reads one from standard input (the\n"
    "format found from the content, as for a file).\n"
    "\n"
    "  --capacity BYTES  the simulated device's memory (default 80G; e.g. 16G, 512M)\n"
    "  --lag US          how far the GPU runs behind the host, in microseconds (default 2000:\n"
    "                    PyTorch's host typically runs several ms ahead of a busy GPU; 0: stream\n"
    "                    work completes at once, the model of earlier gmem versions)\n"
    "  --no-plan         do not mark the steps found: replay as a program that never calls\n"
    "                    gmem_mark_step (by default each step found is marked, as gmem.torch\n"
    "                    marks one after every optimizer step: planned step layouts)\n"
    "  --steps           also print each step found: the earlier step it repeats (the same\n"
    "                    sizes on the same streams, in order), its device calls and modelled\n"
    "                    device ms, gmem's reserved memory at its end and over the peak allocated\n"
    "                    so far, and the calls in new steps, in steps seen once before (a plan's\n"
    "                    first use) and in steps seen twice or more (should be none): does the\n"
    "                    layout settle once each shape has been seen, and where does memory climb?\n"
    "  --step-at FRAME   a step ends after each run of events whose user frame names FRAME\n"
    "                    (say the line of optimizer.step(), train.py:42, where gmem.torch marks\n"
    "                    steps; whole names and numbers: not train.py:420 nor mytrain.py:42),\n"
    "                    not at the trace's markers or the minima of live memory\n"
    "  --passes N        replay each trace N times in one engine (1 to 1000; default 1), freeing\n"
    "                    what a pass leaves live before the next, and print each pass's device\n"
    "                    calls and reserved memory: does a program whose phases come back (a\n"
    "                    model built again) settle? Late calls are then the last pass's; the\n"
    "                    smallest capacity is still that of one pass\n"
    "  --empty-cache     call empty_cache() at each step found, as a program that calls\n"
    "                    torch.cuda.empty_cache() after every step: what does it cost? (gmem\n"
    "                    keeps what recent steps used once the calls cost the program time)\n"
    "  --strict-empty-cache  the same, each call giving back everything (GMEM_EMPTY_CACHE=strict)\n"
    "  --page-size BYTES gmem's page (and chunk) size, a power of two from 2M to 1G (default 2M):\n"
    "                    larger pages cost fewer device calls and stitch more coarsely\n"
    "  --malloc-log FILE write a CSV line per malloc replayed to FILE: the trace, pass, step\n"
    "                    (1-based, as --steps counts them), the trace file's line, the user\n"
    "                    frame that allocated it, stream, size, the address gmem gave it, and\n"
    "                    the device calls (creates, maps, unmaps) and modelled microseconds (in\n"
    "                    calls, waiting for streams) it made: which lines, streams and steps\n"
    "                    remap? (the smallest-capacity search is not logged; ns/op then counts\n"
    "                    the log's time too)\n"
    "  --map-ahead       map planned pages on the engine's thread, as on a GPU (off by default\n"
    "                    here, so that a replay repeats exactly; with it, the split between the\n"
    "                    thread's maps and the steps' own depends on thread timing)\n"
    "  --json            one JSON object per trace, one per line\n"
    "  --wide            every column: bytes next to each ratio, events, device calls, host\n"
    "                    ns/op (by default the table fits 100 columns: ratios only)\n"
    "  --explain         after the table, how each column is measured (the legend in full)\n"
    GMEM_CLI_READ_LIMITS_USAGE;

namespace {

// Under the table, always: what each column means, so the table can be read on its own.
const char kLegend[] =
    "peak allocated  the most memory the trace's tensors held at once\n"
    "PyTorch         PyTorch's peak reserved memory, from the trace's segments (- where it has none)\n"
    "gmem            gmem's peak reserved memory in this replay\n"
    "min capacity    the smallest device gmem runs the trace on\n"
    "                (these three: ratios to peak allocated; 1.000 is no memory wasted)\n"
    "device ms/step  modelled time a training step spends in device calls and stream waits, over\n"
    "                the trace's second half; (half): no steps found, the whole half's time\n";
const char kLegendMore[] = "--wide: bytes, events, device calls and ns/op too; --explain: how each is measured\n";

// --explain: the legend in full.
const char kExplain[] =
    "\n"
    "How each column is measured:\n"
    "events          the trace's alloc, free and segment events replayed\n"
    "peak allocated  the largest sum of live blocks as the trace allocates and frees them\n"
    "PyTorch         the trace's own segment events (cudaMalloc/cudaFree, or expandable segments'\n"
    "                maps) give what PyTorch's allocator held; its peak over peak allocated.\n"
    "                A snapshot taken without history, or an RMM log, has none: -\n"
    "gmem            the trace's allocs and frees replayed through gmem's engine on a simulated\n"
    "                device (--capacity, default 80G), in the trace's order and on its streams;\n"
    "                the most memory gmem had mapped at once, over peak allocated\n"
    "min capacity    the smallest simulated device the replay still fits (found by bisection):\n"
    "                with less, gmem would run out of memory where PyTorch's allocator did not\n"
    "creates/maps/unmaps  gmem's device calls (cuMemCreate, cuMemMap, cuMemUnmap) in the replay\n"
    "ns/op           gmem's host time per malloc or free, measured in this replay\n"
    "device ms/step  each call priced as measured on an H100 (per 2 MiB: cuMemCreate 15 us,\n"
    "                cuMemMap 2, cuMemSetAccess 38, cuMemUnmap 22, cuMemRelease 16; event calls\n"
    "                0.5-1 us) plus host time waiting for streams (the GPU runs --lag us behind),\n"
    "                over the trace's second half (the first half warms up), divided by the\n"
    "                training steps that end there. Steps: --step-at's frame, else the trace's\n"
    "                gmem.step() markers, else the minima of live memory; each is marked, as\n"
    "                gmem.torch marks steps (--no-plan: not)\n"
    "Scripts: --json gives every figure, one object per trace (gmem help replay).\n";

std::string fixed(double value, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, value);
  return buf;
}

std::string bytes_with_ratio(std::uint64_t bytes, double ratio) {
  if (bytes == 0) return "-";  // e.g. an RMM log has no segment events
  return format_bytes(bytes) + " (" + fixed(ratio, 3) + ")";
}

// `--lag US`: a finite number of microseconds, 0 or more.
double parse_lag(const std::string& text) {
  double us = 0;
  const char* end = text.data() + text.size();
  auto [stop, ec] = std::from_chars(text.data(), end, us);
  if (ec != std::errc{} || stop != end || !std::isfinite(us) || us < 0)
    throw UsageError("--lag takes microseconds, a number >= 0 (e.g. 2000, or 0 for no lag), not '" + text + "'");
  return us;
}

// Where training steps end, as trace event indices: the deep minima of live memory (as the
// replay sees it: a block is live from its alloc to its free_completed).
std::vector<std::size_t> step_ends(const trace::Trace& t) {
  std::vector<std::int64_t> live_curve;
  std::vector<std::size_t> event_of_point;
  std::unordered_map<std::uint64_t, std::uint64_t> live;  // addr -> size
  std::int64_t live_bytes = 0;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const trace::Event& e = t.events[i];
    if (e.action == trace::Action::alloc) {
      live[e.addr] = e.size;
      live_bytes += static_cast<std::int64_t>(e.size);
    } else if (e.action == trace::Action::free_completed) {
      auto it = live.find(e.addr);
      if (it == live.end()) continue;
      live_bytes -= static_cast<std::int64_t>(it->second);
      live.erase(it);
    } else {
      continue;
    }
    live_curve.push_back(live_bytes);
    event_of_point.push_back(i);
  }
  std::vector<std::size_t> ends;
  for (std::size_t point : analysis::step_ends_from_live_minima(live_curve))
    ends.push_back(event_of_point[point]);
  return ends;
}

// Modelled device time (calls and waits) of the second half per step ending there, in ms; where
// no step ends there (r.late_steps == 0), the second half's whole time.
double late_device_ms(const trace::ReplayResult& r) {
  const double ms = (r.late_device_call_us + r.late_host_wait_us) / 1000.0;
  return r.late_steps ? ms / static_cast<double>(r.late_steps) : ms;
}

// Device calls and steps by whether a step's requests were seen before: [0] new, [1] seen once
// (the step that first follows its plan), [2] seen twice or more (should make none).
struct CallsBySeen {
  std::uint64_t calls[3] = {}, steps[3] = {};
};
CallsBySeen calls_by_seen(const std::vector<trace::StepFigures>& steps) {
  CallsBySeen by;
  for (const trace::StepFigures& s : steps) {
    const std::size_t kind = std::min<std::size_t>(s.times_seen, 2);
    by.calls[kind] += s.device_calls;
    ++by.steps[kind];
  }
  return by;
}

// `--steps`' and `--passes`' figures, as an array under `key` (nothing when there are none).
void write_figures(json::Writer& w, const char* key, const std::vector<trace::StepFigures>& all) {
  if (all.empty()) return;
  w.key(key).begin_array();
  for (const trace::StepFigures& s : all)
    w.begin_object()
        .field("event", s.event)
        .field("device_calls", s.device_calls)
        .field("device_us", s.device_us)
        .field("reserved", s.reserved)
        .field("peak_reserved", s.peak_reserved)
        .field("peak_allocated", s.peak_allocated)
        .field("repeats_step", s.repeats_step)
        .field("times_seen", s.times_seen)
        .end_object();
  w.end_array();
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
      .field("same_place_recorded", r.same_place_recorded)
      .field("same_place_kept", r.same_place_kept)
      .field("ns_per_op", r.ns_per_op)
      .field("lag_us", r.lag_us)
      .field("device_call_us", r.device_call_us)
      .field("host_wait_us", r.host_wait_us)
      .field("late_device_call_us", r.late_device_call_us)
      .field("late_host_wait_us", r.late_host_wait_us)
      .field("host_clock_us", r.host_clock_us)
      .field("stream_handovers", r.stream_handovers)
      .field("steps", r.steps)
      .field("late_steps", r.late_steps)
      .field("steps_marked", r.steps_marked);
  if (r.late_steps) w.field("device_ms_per_step", late_device_ms(r));
  else w.field("device_ms_per_step", nullptr);
  write_figures(w, "per_step", r.per_step);  // --steps
  if (!r.per_step.empty()) {
    const CallsBySeen by = calls_by_seen(r.per_step);
    w.key("device_calls_by_times_seen").begin_array();  // new, once, twice or more
    for (const std::uint64_t calls : by.calls) w.value(calls);
    w.end_array();
  }
  write_figures(w, "per_pass", r.per_pass);  // --passes
  w.field("failed", r.failed);
  if (r.failed) w.field("failure", r.failure);
  w.end_object();
  return w.str();
}

// `--passes`: a line per pass.
void print_passes(const std::string& trace, const trace::ReplayResult& r) {
  std::printf("\n%s: %zu passes\n", trace.c_str(), r.per_pass.size());
  Table table({"pass", "device calls", "device ms", "reserved", "peak reserved / peak allocated"},
              {true, true, true, true, true});
  for (std::size_t i = 0; i < r.per_pass.size(); ++i) {
    const trace::StepFigures& p = r.per_pass[i];
    table.add({std::to_string(i + 1), std::to_string(p.device_calls), fixed(p.device_us / 1000.0, 2),
               format_bytes(p.reserved), bytes_with_ratio(p.peak_reserved, r.ratio(p.peak_reserved))});
  }
  table.print(stdout);
}

// `--steps`: a line per step found.
void print_steps(const std::string& trace, const std::vector<trace::StepFigures>& steps) {
  std::printf("\n%s: %zu steps\n", trace.c_str(), steps.size());
  Table table({"step", "event", "repeats step", "device calls", "device ms", "reserved",
               "peak reserved / peak allocated"},
              {true, true, true, true, true, true, true});
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const trace::StepFigures& s = steps[i];
    table.add({std::to_string(i + 1), std::to_string(s.event),
               s.repeats_step ? std::to_string(s.repeats_step) : "-", std::to_string(s.device_calls),
               fixed(s.device_us / 1000.0, 2), format_bytes(s.reserved),
               s.peak_allocated ? fixed(static_cast<double>(s.peak_reserved) /
                                            static_cast<double>(s.peak_allocated), 3)
                                : "-"});
  }
  table.print(stdout);
  const CallsBySeen by = calls_by_seen(steps);
  auto n = [](std::uint64_t v) { return static_cast<unsigned long long>(v); };
  std::printf("device calls: %llu in %llu new steps, %llu in %llu seen once before, %llu in %llu seen twice or more\n",
              n(by.calls[0]), n(by.steps[0]), n(by.calls[1]), n(by.steps[1]), n(by.calls[2]), n(by.steps[2]));
}

// `--malloc-log FILE`: a CSV line per malloc replayed (trace::MallocCost), under a header.
class MallocLog {
 public:
  explicit MallocLog(std::string path) : path_(std::move(path)), file_(std::fopen(path_.c_str(), "w")) {
    if (file_ == nullptr) fail();
    std::fputs("trace,pass,step,line,frame,stream,size,address,creates,maps,unmaps,call_us,wait_us\n", file_);
  }
  ~MallocLog() {
    if (file_) std::fclose(file_);
  }
  MallocLog(const MallocLog&) = delete;
  MallocLog& operator=(const MallocLog&) = delete;

  std::function<void(const trace::MallocCost&)> writer(const std::string& trace) {
    name_ = csv_field(trace);
    return [this](const trace::MallocCost& m) {
      const std::string frame = csv_field(std::string(m.frame));
      std::fprintf(file_, "%s,%zu,%zu,%zu,%s,%llu,%zu,0x%llx,%llu,%llu,%llu,%.1f,%.1f\n", name_.c_str(),
                   m.pass + 1, m.step, m.line, frame.c_str(), static_cast<unsigned long long>(m.stream), m.size,
                   static_cast<unsigned long long>(m.address), static_cast<unsigned long long>(m.creates),
                   static_cast<unsigned long long>(m.maps), static_cast<unsigned long long>(m.unmaps),
                   m.call_us, m.wait_us);
    };
  }
  // Flushed and closed: a full disk or a write error is reported, not left as a short file.
  void close() {
    const bool failed = std::ferror(file_) != 0;
    const bool closed = std::fclose(file_) == 0;
    file_ = nullptr;
    if (failed || !closed) fail();
  }

 private:
  [[noreturn]] void fail() const {
    throw std::runtime_error(path_ + ": cannot write the malloc log (--malloc-log): " + std::strerror(errno));
  }
  // A trace's name or a frame as one CSV field: quoted where it holds a comma, a quote or a line break.
  static std::string csv_field(const std::string& text) {
    if (text.find_first_of(",\"\r\n") == std::string::npos) return text;
    std::string quoted = "\"";
    for (const char c : text) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
    return quoted + "\"";
  }

  std::string path_;
  std::FILE* file_;
  std::string name_;  // the trace being replayed, as a CSV field
};

}  // namespace

int replay_command(const Args& args) {
  bool as_json = false;
  bool wide = false, explain = false;  // --wide, --explain
  trace::ReplayOptions options;
  options.lag_us = kDefaultLagUs;
  options.mark_steps = true;  // as gmem.torch does by default
  trace::ReadLimits limits;
  std::vector<std::string> files;
  std::string step_frame;  // --step-at
  std::string malloc_log_path;  // --malloc-log
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (parse_read_limit(args, i, limits)) continue;
    if (a == "--json") {
      as_json = true;
    } else if (a == "--wide") {
      wide = true;
    } else if (a == "--explain") {
      explain = true;
    } else if (a == "--capacity") {
      options.capacity = parse_bytes(option_value(args, i));
      if (options.capacity == 0) throw UsageError("--capacity must be more than 0");
    } else if (a.starts_with("--capacity=")) {
      options.capacity = parse_bytes(std::string_view(a).substr(11));
    } else if (a == "--plan") {  // the default; kept for scripts written when it was not
      options.mark_steps = true;
    } else if (a == "--no-plan") {
      options.mark_steps = false;
    } else if (a == "--step-at") {
      step_frame = option_value(args, i);
      if (step_frame.empty()) throw UsageError("--step-at takes a frame's text, e.g. models.py:153");
    } else if (a == "--steps") {
      options.record_steps = true;
    } else if (a == "--empty-cache") {
      options.empty_cache_each_step = true;
    } else if (a == "--strict-empty-cache") {
      options.empty_cache_each_step = true;
      options.engine.strict_empty_cache = true;
    } else if (a == "--lag") {
      options.lag_us = parse_lag(option_value(args, i));
    } else if (a == "--passes") {
      options.passes = parse_count(a, option_value(args, i));
      if (options.passes > 1000) throw UsageError("--passes takes a count from 1 to 1000, not " + std::to_string(options.passes));
    } else if (a == "--malloc-log") {
      malloc_log_path = option_value(args, i);
    } else if (a == "--map-ahead") {
      options.engine.map_ahead = true;
    } else if (a == "--page-size") {
      options.engine.page_size = parse_bytes(option_value(args, i));
      if (options.engine.page_size == 0) throw UsageError("--page-size must be more than 0");
    } else if (a.starts_with("-") && a != "-") {
      throw UsageError("replay: unknown option " + a + " (see gmem help replay)");
    } else {
      add_trace_argument(files, a);
    }
  }
  if (files.empty()) throw UsageError("replay: no trace given: FILE..., or - for standard input (see gmem help replay)");
  std::optional<MallocLog> malloc_log;
  if (!malloc_log_path.empty()) malloc_log.emplace(malloc_log_path);

  // --wide: every figure, bytes and ratio; by default ratios only, to fit 100 columns (a table
  // wider than the terminal wraps into an unreadable one).
  Table table = wide ? Table({"trace", "events", "peak allocated", "PyTorch reserved", "gmem reserved",
                              "min capacity", "creates/maps/unmaps", "ns/op", "device ms/step"},
                             {false, true, true, true, true, true, true, true, true})
                     : Table({"trace", "peak allocated", "PyTorch", "gmem", "min capacity", "device ms/step"},
                             {false, true, true, true, true, true});
  auto ratio = [](std::uint64_t bytes, double r) { return bytes == 0 ? std::string("-") : fixed(r, 3); };
  std::size_t rows = 0;
  int status = 0;
  std::vector<std::pair<std::string, std::vector<trace::StepFigures>>> per_step;  // --steps
  std::vector<trace::ReplayResult> per_pass;  // --passes
  for (const std::string& file : files) {
    const trace::Trace t = read_trace_argument(file, limits);
    if (report_empty_trace(t, file, limits, "replay")) {
      status = 1;
      continue;
    }
    if (t.window.mid_run)  // on stderr: the table and --json lines stay as they are
      std::fprintf(stderr, "gmem: %s: %s\n", t.path.c_str(), t.window.describe().c_str());
    if (step_frame.empty()) {
      options.step_ends = trace::step_ends_at_markers(t);
      if (options.step_ends.empty()) options.step_ends = step_ends(t);
    } else {
      options.step_ends = trace::step_ends_after_frame(t, step_frame);
      if (options.step_ends.empty())
        throw UsageError("replay: " + t.path + ": no event's user frame names '" + step_frame + "' (--step-at)");
    }
    if (malloc_log) options.on_malloc = malloc_log->writer(t.name);
    const trace::ReplayResult r = trace::replay(t, options);
    const std::uint64_t min_cap = trace::min_capacity(
        t, options.lag_us, std::size_t{2} << 20,
        options.mark_steps ? options.step_ends : std::vector<std::size_t>{}, options.engine);
    if (options.record_steps && !as_json) per_step.emplace_back(r.trace, r.per_step);
    if (options.passes > 1 && !as_json) per_pass.push_back(r);
    if (as_json) {
      std::printf("%s\n", json_line(r, file, min_cap).c_str());
      std::fflush(stdout);
    } else if (!wide) {
      ++rows;
      table.add({r.trace, format_bytes(r.peak_allocated), ratio(r.recorded_peak_reserved, r.recorded_ratio()),
                 r.failed ? "FAILED" : ratio(r.peak_reserved, r.reserved_ratio()),
                 ratio(min_cap, r.ratio(min_cap)),
                 fixed(late_device_ms(r), 2) + (r.late_steps ? "" : " (half)")});
    } else {
      ++rows;
      table.add({r.trace, std::to_string(r.events), format_bytes(r.peak_allocated),
                 bytes_with_ratio(r.recorded_peak_reserved, r.recorded_ratio()),
                 r.failed ? "FAILED" : bytes_with_ratio(r.peak_reserved, r.reserved_ratio()),
                 bytes_with_ratio(min_cap, r.ratio(min_cap)),
                 std::to_string(r.creates) + "/" + std::to_string(r.maps) + "/" + std::to_string(r.unmaps),
                 fixed(r.ns_per_op, 0),
                 fixed(late_device_ms(r), 2) + (r.late_steps ? "" : " (half)")});
    }
    if (r.failed) {
      std::fprintf(stderr, "gmem: %s: replay failed on a %s device: %s\n", r.trace.c_str(),
                   format_bytes(r.capacity).c_str(), r.failure.c_str());
      status = 1;
    }
  }
  if (!as_json && rows > 0) {
    if (!wide) table.fit(100, 0);
    table.print(stdout);
    std::printf("\n%s", kLegend);
    std::fputs(explain ? kExplain : wide ? "--explain: how each is measured\n" : kLegendMore, stdout);
  }
  if (malloc_log) malloc_log->close();
  for (const auto& [name, steps] : per_step) print_steps(name, steps);
  for (const trace::ReplayResult& r : per_pass) print_passes(r.trace, r);
  return status;
}

}  // namespace gmem::cli
