// torch.cuda.memory._snapshot() as pickled by _dump_snapshot(): its `device_traces` (one list of
// event dicts per device) become trace events, with frames reduced to the CSV's two columns.
#include <algorithm>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "common/python_frames.hpp"
#include "gmem/error.hpp"
#include "trace/formats.hpp"
#include "trace/frame_table.hpp"
#include "trace/pickle.hpp"

namespace gmem::trace::detail {

namespace {
using pickle::Value;

// The frame gmem's snapshots (src/tracking/snapshot_pickle.cpp) write for a block's scope, outermost;
// its 'name' is the scope path.
constexpr std::string_view kScopeFile = "<gmem scope>";

// "…/site-packages/transformers/x.py" -> "transformers/x.py"; empty when not such a library.
std::string_view library_path(std::string_view file) {
  for (std::string_view lib : {"transformers/", "torchvision/"}) {
    if (file.starts_with(lib)) return file;
    const std::size_t at = file.find("/" + std::string(lib));
    if (at != std::string_view::npos) return file.substr(at + 1);
  }
  return {};
}

// The pickle shares what its memo refers to more than once, so that an event dict or a frames
// list may be reached many times for the bytes of one. Each is converted once and remembered:
// a repeated frames list costs a lookup, not a walk, and a repeated event dict or event list
// counts against limits.max_memo_refs, so that a small pickle cannot multiply into billions.
class Converter {
 public:
  Converter(Trace& trace, const ReadLimits& limits) : trace_(trace), limits_(limits), frames_(trace.frames) {}

  void device(const Value& events) {
    if (!events.is_sequence()) fail("device_traces holds a " + std::string(events.kind_name()) + ", not a list");
    if (!devices_seen_.insert(&events.as_list()).second) count_memo_ref();
    for (const Value& entry : events.as_list()) {
      ++record_;
      if (!entry.is_dict()) fail("event is a " + std::string(entry.kind_name()) + ", not a dict");
      event(entry);
    }
  }

  // The segments' live blocks (torch.cuda.memory._snapshot()'s 'segments': dicts with 'address',
  // 'stream' and 'blocks' of 'address', 'size', 'state', 'frames'): the state at dump time, which
  // closes a history that began mid-run.
  void segments(const Value& segments) {
    context_ = "snapshot's segments";
    record_ = 0;
    if (!segments.is_sequence()) fail("is a " + std::string(segments.kind_name()) + ", not a list");
    for (const Value& segment : segments.as_list()) {
      if (!segment.is_dict()) fail("holds a " + std::string(segment.kind_name()) + ", not a dict");
      const std::uint64_t stream = static_cast<std::uint64_t>(integer(segment, "stream", true));
      const Value& blocks = field(segment, "blocks");
      if (!blocks.is_sequence()) fail("'blocks' is a " + std::string(blocks.kind_name()) + ", not a list");
      for (const Value& block : blocks.as_list()) {
        if (!block.is_dict()) fail("a block is a " + std::string(block.kind_name()) + ", not a dict");
        const Value& state = field(block, "state");
        if (!state.is_string()) fail("a block's 'state' is a " + std::string(state.kind_name()) + ", not a str");
        // active_pending_free: freed by the program, not yet by the allocator (free_completed).
        if (state.as_string() != "active_allocated" && state.as_string() != "active_pending_free") continue;
        if (trace_.dumped_blocks.size() >= limits_.max_events)
          exceeds(trace_.path, 0, std::to_string(limits_.max_events) + " live blocks in the segments", "--max-events");
        DumpedBlock b;
        b.addr = unsigned_integer(block, "address");
        b.size = unsigned_integer(block, "size");
        b.stream = stream;
        if (const Value* frames = block.get("frames")) {
          const FrameIds ids = stack(*frames);
          b.user_frame = ids.user;
          b.lib_frame = ids.lib;
          b.scope = ids.scope;
        }
        trace_.dumped_blocks.push_back(b);
      }
    }
    trace_.has_segments = true;
  }

 private:
  [[noreturn]] void fail(const std::string& problem) const {
    throw BadInputError(trace_.path, record_, context_ + ": " + problem);
  }

  const Value& field(const Value& entry, std::string_view key) const {
    const Value* v = entry.get(key);
    if (!v) fail("missing '" + std::string(key) + "'");
    return *v;
  }
  std::int64_t integer(const Value& entry, std::string_view key, bool optional = false) const {
    const Value* v = entry.get(key);
    if (!v && optional) return 0;
    if (!v) fail("missing '" + std::string(key) + "'");
    if (!v->is_int()) fail("'" + std::string(key) + "' is a " + v->kind_name() + ", not an int");
    return v->as_int();
  }
  std::uint64_t unsigned_integer(const Value& entry, std::string_view key) const {
    const std::int64_t v = integer(entry, key);
    if (v < 0) fail("'" + std::string(key) + "' is negative");
    return static_cast<std::uint64_t>(v);
  }

  void count_memo_ref() {
    if (++memo_refs_ > limits_.max_memo_refs)
      exceeds(trace_.path, record_, std::to_string(limits_.max_memo_refs) + " repeated references in a snapshot pickle",
              "--max-memo-refs");
  }

  void event(const Value& entry) {
    const auto [seen, first_time] = events_seen_.try_emplace(&entry.as_dict());
    if (!first_time) count_memo_ref();
    else seen->second = convert(entry);
    if (!seen->second) return;  // not a memory event
    check_event_count(trace_, record_, limits_);
    Event e = *seen->second;
    e.line = record_;
    trace_.events.push_back(e);
  }

  std::optional<Event> convert(const Value& entry) {
    const Value& action = field(entry, "action");
    if (!action.is_string()) fail("'action' is a " + std::string(action.kind_name()) + ", not a str");
    const std::string& name = action.as_string();
    Event e;
    if (std::optional<Action> a = parse_action(name)) {
      e.action = *a;
    } else if (name == "segment_map") {  // expandable segments grow by mapping
      e.action = Action::segment_alloc;
    } else if (name == "segment_unmap") {
      e.action = Action::segment_free;
    } else if (name == "snapshot") {  // marks when a snapshot was taken: no memory changes
      return std::nullopt;
    } else {
      fail("unknown action '" + name + "'");
    }
    e.addr = unsigned_integer(entry, "addr");
    e.size = unsigned_integer(entry, "size");
    e.stream = static_cast<std::uint64_t>(integer(entry, "stream", true));
    e.time_us = integer(entry, "time_us", true);
    if (const Value* frames = entry.get("frames")) {
      const FrameIds ids = stack(*frames);
      e.user_frame = ids.user;
      e.lib_frame = ids.lib;
      e.scope = ids.scope;
    }
    return e;
  }

  struct FrameIds {
    std::uint32_t user = 0;  // index into trace.frames, 0 for none
    std::uint32_t lib = 0;
    std::uint32_t scope = 0;  // gmem's scope, written as a frame (see kScopeFile)
  };

  // The innermost user and library frames of a stack (frames come innermost first).
  FrameIds stack(const Value& frames) {
    if (!frames.is_sequence()) fail("'frames' is a " + std::string(frames.kind_name()) + ", not a list");
    const pickle::List& list = frames.as_list();
    const auto [cached, first_time] = stacks_seen_.try_emplace(&list);
    if (!first_time) {
      count_memo_ref();
      return cached->second;
    }
    if (list.size() > limits_.max_frames)
      exceeds(trace_.path, record_, std::to_string(limits_.max_frames) + " frames in one stack", "--max-frames");
    FrameIds ids;
    for (const Value& frame : list) {
      const FrameIds f = this->frame(frame);
      if (ids.user == 0) ids.user = f.user;
      if (ids.lib == 0) ids.lib = f.lib;
      if (ids.scope == 0) ids.scope = f.scope;
    }
    cached->second = ids;
    return ids;
  }

  // One frame dict as "file:line:function", if it is a user or a library frame. Frame dicts are
  // shared by many stacks in real snapshots: each is looked at once.
  FrameIds frame(const Value& frame) {
    if (!frame.is_dict()) fail("a frame without a 'filename'");
    const auto [cached, first_time] = frames_seen_.try_emplace(&frame.as_dict());
    if (!first_time) return cached->second;
    const Value* file = frame.get("filename");
    if (!file || !file->is_string()) fail("a frame without a 'filename'");
    const std::string& path = file->as_string();
    FrameIds ids;
    if (path == kScopeFile) {  // a scope, not a line of code: its name is the frame's
      const Value* name = frame.get("name");
      if (name && name->is_string() && !name->as_string().empty()) ids.scope = frames_.intern(name->as_string());
      cached->second = ids;
      return ids;
    }
    const bool user = gmem::detail::is_user_python_file(path);
    const std::string_view lib = library_path(path);
    if (user || !lib.empty()) {
      const Value* line = frame.get("line");
      const Value* function = frame.get("name");
      const std::string suffix = ":" + std::to_string(line && line->is_int() ? line->as_int() : 0) + ":" +
                                 (function && function->is_string() ? function->as_string() : "");
      if (user) ids.user = frames_.intern(path + suffix);
      if (!lib.empty()) ids.lib = frames_.intern(std::string(lib) + suffix);
    }
    cached->second = ids;
    return ids;
  }

  Trace& trace_;
  const ReadLimits& limits_;
  FrameTable frames_;
  std::size_t record_ = 0;  // 1-based, over all devices' events
  std::string context_ = "snapshot event";  // what fail() names
  std::size_t memo_refs_ = 0;
  std::unordered_set<const pickle::List*> devices_seen_;
  std::unordered_map<const pickle::Dict*, std::optional<Event>> events_seen_;
  std::unordered_map<const pickle::List*, FrameIds> stacks_seen_;
  std::unordered_map<const pickle::Dict*, FrameIds> frames_seen_;
};
// "ProfilerStep#12" -> "ProfilerStep#": annotations that differ only by a trailing count are one.
std::string without_count(const std::string& name) {
  std::size_t end = name.size();
  while (end > 0 && name[end - 1] >= '0' && name[end - 1] <= '9') --end;
  return name.substr(0, end);
}

// Steps from 'external_annotations': gmem's gmem.step() markers (stage "STEP") where there are
// any; else the starts (stage "START") of the PyTorch annotation that recurs most often (at least 3
// times; torch.profiler's "ProfilerStep#N", or a record_function around the step). Entries that are
// not as expected are ignored: annotations are a hint, not the trace.
void read_step_markers(const Value& annotations, Trace& trace) {
  if (!annotations.is_sequence()) return;
  std::vector<std::int64_t> steps;
  std::vector<std::pair<std::string, std::int64_t>> starts;
  for (const Value& a : annotations.as_list()) {
    if (!a.is_dict()) continue;
    const Value* stage = a.get("stage");
    const Value* time = a.get("time_us");
    if (!stage || !stage->is_string() || !time || !time->is_int()) continue;
    if (stage->as_string() == "STEP") {
      steps.push_back(time->as_int());
    } else if (stage->as_string() == "START") {
      const Value* name = a.get("name");
      if (name && name->is_string()) starts.emplace_back(without_count(name->as_string()), time->as_int());
    }
  }
  if (!steps.empty()) {
    trace.steps_source = kGmemStepMarkers;
  } else {
    std::unordered_map<std::string, std::size_t> count;
    std::string best;
    for (const auto& [name, time] : starts)
      if (++count[name] > (best.empty() ? 2 : count[best]) && name != best) best = name;
    if (best.empty()) return;
    for (const auto& [name, time] : starts)
      if (name == best) steps.push_back(time);
    trace.steps_source = "annotation '" + best + "'";
  }
  std::sort(steps.begin(), steps.end());
  trace.steps_us = std::move(steps);
}

// gmem's graph tracking ('gmem_graphs', src/tracking/snapshot_pickle.cpp): {'backward_runs':
// bool, 'saved_for_backward': [address, ...]}.
void read_graphs(const Value& graphs, Trace& trace) {
  const auto bad = [&](const std::string& what) {
    throw BadInputError(trace.path, 0, "snapshot's 'gmem_graphs' " + what);
  };
  if (!graphs.is_dict()) bad(std::string("is a ") + graphs.kind_name() + ", not a dict");
  if (const Value* runs = graphs.get("backward_runs")) {
    if (runs->kind() != Value::Kind::boolean) bad("has a 'backward_runs' that is not a bool");
    trace.backward_runs = runs->as_bool();
  }
  if (const Value* saved = graphs.get("saved_for_backward")) {
    if (!saved->is_sequence()) bad("has a 'saved_for_backward' that is not a list");
    for (const Value& addr : saved->as_list()) {
      if (!addr.is_int() || addr.as_int() < 0)
        bad("lists an address that is not a non-negative int");
      trace.saved_for_backward.push_back(static_cast<std::uint64_t>(addr.as_int()));
    }
  }
}

// gmem's history ring ('gmem_history', src/tracking/snapshot_pickle.cpp): {'capacity',
// 'dropped_events', 'wrapped'}: how many older events the ring dropped.
void read_history(const Value& history, Trace& trace) {
  const auto bad = [&](const std::string& what) {
    throw BadInputError(trace.path, 0, "snapshot's 'gmem_history' " + what);
  };
  if (!history.is_dict()) bad(std::string("is a ") + history.kind_name() + ", not a dict");
  const Value* dropped = history.get("dropped_events");
  if (!dropped) return;
  if (!dropped->is_int() || dropped->as_int() < 0) bad("has a 'dropped_events' that is not a non-negative int");
  trace.window.dropped_events = dropped->as_int();
}

}  // namespace

void read_snapshot_pickle(std::string_view bytes, Trace& trace, const ReadLimits& limits) {
  const pickle::Document doc = pickle::parse(bytes, trace.path, limits.max_objects);
  const Value& root = doc.root();
  if (!root.is_dict())
    throw BadInputError(trace.path, 0, std::string("snapshot pickle holds a ") + root.kind_name() +
                                           ", not the dict torch.cuda.memory._snapshot() returns");
  const Value* traces = root.get("device_traces");
  if (!traces || !traces->is_sequence())
    throw BadInputError(trace.path, 0,
                        "snapshot has no 'device_traces' list (record it with "
                        "torch.cuda.memory._record_memory_history())");
  Converter convert(trace, limits);
  std::size_t devices_with_events = 0;
  for (const Value& device : traces->as_list()) {
    const std::size_t before = trace.events.size();
    convert.device(device);
    devices_with_events += trace.events.size() > before;
  }
  if (const Value* annotations = root.get("external_annotations"))
    read_step_markers(*annotations, trace);
  if (const Value* graphs = root.get("gmem_graphs")) read_graphs(*graphs, trace);
  if (const Value* history = root.get("gmem_history")) read_history(*history, trace);
  if (const Value* segments = root.get("segments")) convert.segments(*segments);
  // Several devices: one timeline (addresses are unique across devices under unified addressing).
  if (devices_with_events > 1)
    std::stable_sort(trace.events.begin(), trace.events.end(),
                     [](const Event& a, const Event& b) { return a.time_us < b.time_us; });
}

}  // namespace gmem::trace::detail
