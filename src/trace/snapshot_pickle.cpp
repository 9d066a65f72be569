// torch.cuda.memory._snapshot() as pickled by _dump_snapshot(): its `device_traces` (one list of
// event dicts per device) become trace events, with frames reduced to the CSV's two columns.
#include <algorithm>
#include <string>

#include "common/python_frames.hpp"
#include "gmem/error.hpp"
#include "trace/formats.hpp"
#include "trace/frame_table.hpp"
#include "trace/pickle.hpp"

namespace gmem::trace::detail {

namespace {
using pickle::Value;

// "…/site-packages/transformers/x.py" -> "transformers/x.py"; empty when not such a library.
std::string_view library_path(std::string_view file) {
  for (std::string_view lib : {"transformers/", "torchvision/"}) {
    if (file.starts_with(lib)) return file;
    const std::size_t at = file.find("/" + std::string(lib));
    if (at != std::string_view::npos) return file.substr(at + 1);
  }
  return {};
}

class Converter {
 public:
  explicit Converter(Trace& trace) : trace_(trace), frames_(trace.frames) {}

  void device(const Value& events) {
    if (!events.is_sequence()) fail("device_traces holds a " + std::string(events.kind_name()) + ", not a list");
    for (const Value& entry : events.as_list()) {
      ++record_;
      if (!entry.is_dict()) fail("event is a " + std::string(entry.kind_name()) + ", not a dict");
      event(entry);
    }
  }

 private:
  [[noreturn]] void fail(const std::string& problem) const {
    throw BadInputError(trace_.path, record_, "snapshot event: " + problem);
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

  void event(const Value& entry) {
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
      return;
    } else {
      fail("unknown action '" + name + "'");
    }
    e.addr = unsigned_integer(entry, "addr");
    e.size = unsigned_integer(entry, "size");
    e.stream = static_cast<std::uint64_t>(integer(entry, "stream", true));
    e.time_us = integer(entry, "time_us", true);
    e.line = record_;
    if (const Value* frames = entry.get("frames")) this->frames(*frames, e);
    trace_.events.push_back(e);
  }

  // Frames come innermost first.
  void frames(const Value& frames, Event& e) {
    if (!frames.is_sequence()) fail("'frames' is a " + std::string(frames.kind_name()) + ", not a list");
    for (const Value& frame : frames.as_list()) {
      const Value* file = frame.get("filename");
      if (!file || !file->is_string()) fail("a frame without a 'filename'");
      const std::string& path = file->as_string();
      const bool user = e.user_frame == 0 && gmem::detail::is_user_python_file(path);
      const std::string_view lib = e.lib_frame == 0 ? library_path(path) : std::string_view{};
      if (!user && lib.empty()) continue;
      const Value* line = frame.get("line");
      const Value* function = frame.get("name");
      std::string suffix = ":" + std::to_string(line && line->is_int() ? line->as_int() : 0) + ":" +
                           (function && function->is_string() ? function->as_string() : "");
      if (user) e.user_frame = frames_.intern(path + suffix);
      if (!lib.empty()) e.lib_frame = frames_.intern(std::string(lib) + suffix);
      if (e.user_frame && e.lib_frame) break;
    }
  }

  Trace& trace_;
  FrameTable frames_;
  std::size_t record_ = 0;  // 1-based, over all devices' events
};
}  // namespace

void read_snapshot_pickle(std::string_view bytes, Trace& trace) {
  const pickle::Document doc = pickle::parse(bytes, trace.path);
  const Value& root = doc.root();
  if (!root.is_dict())
    throw BadInputError(trace.path, 0, std::string("snapshot pickle holds a ") + root.kind_name() +
                                           ", not the dict torch.cuda.memory._snapshot() returns");
  const Value* traces = root.get("device_traces");
  if (!traces || !traces->is_sequence())
    throw BadInputError(trace.path, 0,
                        "snapshot has no 'device_traces' list (record it with "
                        "torch.cuda.memory._record_memory_history())");
  Converter convert(trace);
  std::size_t devices_with_events = 0;
  for (const Value& device : traces->as_list()) {
    const std::size_t before = trace.events.size();
    convert.device(device);
    devices_with_events += trace.events.size() > before;
  }
  // Several devices: one timeline (addresses are unique across devices under unified addressing).
  if (devices_with_events > 1)
    std::stable_sort(trace.events.begin(), trace.events.end(),
                     [](const Event& a, const Event& b) { return a.time_us < b.time_us; });
}

}  // namespace gmem::trace::detail
