// A snapshot in the layout of torch.cuda.memory._snapshot(), pickled:
//   {'segments': [{'device', 'address', 'total_size', 'allocated_size', 'active_size',
//                  'requested_size', 'stream', 'segment_type', 'segment_pool_id', 'is_expandable',
//                  'frames', 'blocks': [{'address', 'size', 'requested_size', 'state', 'frames'}]}],
//    'device_traces': [[{'action', 'addr', 'size', 'stream', 'time_us', 'compile_context',
//                        'user_metadata', 'frames'}]],   (one list per device index)
//    'allocator_settings': {...}, 'external_annotations': [{'device', 'time_us', 'name', ...}],
//    'gmem_graphs': {'backward_runs', 'saved_for_backward': [address, ...]},   (when tracked)
//    'gmem_history': {'capacity', 'dropped_events', 'wrapped', 'begins_time_us'}}   (when tracked)
//
// gmem's mapped ranges behave like PyTorch's expandable segments, so maps and unmaps become
// 'segment_map' / 'segment_unmap'; a free becomes the 'free_requested' + 'free_completed' pair
// PyTorch records. The scope of a block travels as its outermost frame ("<gmem scope>") and, on
// trace entries, as 'user_metadata'. Steps and annotations go to 'external_annotations'.
#include <fstream>
#include <map>
#include <ostream>

#include "gmem/error.hpp"
#include "gmem/snapshot.hpp"
#include "tracking/pickle_writer.hpp"

namespace gmem {
namespace {

constexpr const char* kScopeFile = "<gmem scope>";

class SnapshotPickler {
 public:
  explicit SnapshotPickler(const Snapshot& s) : s_(s) {}

  std::string run() {
    p_.begin_dict();
    p_.key("segments");
    segments();
    p_.key("device_traces");
    device_traces();
    p_.key("allocator_settings");
    allocator_settings();
    p_.key("external_annotations");
    annotations();
    if (s_.tracking) {
      p_.key("gmem_graphs");
      graphs();
      p_.key("gmem_history");
      history();
    }
    p_.end_dict();
    return p_.finish();
  }

 private:
  void segments() {
    p_.begin_list();
    for (const SnapshotSegment& seg : s_.segments) {
      std::size_t allocated = 0, requested = 0;
      for (const SnapshotBlock& b : seg.blocks) {
        if (!b.allocated) continue;
        allocated += b.size;
        requested += b.requested;
      }
      p_.begin_dict();
      p_.key("device").integer(s_.device);
      p_.key("address").unsigned_integer(seg.address);
      p_.key("total_size").unsigned_integer(seg.size);
      p_.key("allocated_size").unsigned_integer(allocated);
      p_.key("active_size").unsigned_integer(allocated);
      p_.key("requested_size").unsigned_integer(requested);
      p_.key("stream").integer(0);  // a range serves blocks of any stream
      p_.key("segment_type").string("large");
      p_.key("segment_pool_id").int_pair(0, 0);
      p_.key("is_expandable").boolean(true);
      p_.key("frames").begin_list().end_list();
      p_.key("blocks");
      p_.begin_list();
      for (const SnapshotBlock& b : seg.blocks) {
        p_.begin_dict();
        p_.key("address").unsigned_integer(b.address);
        p_.key("size").unsigned_integer(b.size);
        p_.key("requested_size").unsigned_integer(b.requested);
        p_.key("state").string(b.allocated ? "active_allocated" : "inactive");
        p_.key("frames");
        frames(b.frames, b.scope);
        p_.end_dict();
      }
      p_.end_list();
      p_.end_dict();
    }
    p_.end_list();
  }

  void device_traces() {
    p_.begin_list();
    for (int d = 0; d < s_.device; ++d) {  // memory_viz indexes the traces by device
      p_.begin_list();
      p_.end_list();
    }
    p_.begin_list();
    for (const HistoryEvent& e : s_.history) {
      const std::string scope = e.scope != 0 ? scopes::path(e.scope) : std::string();
      switch (e.kind) {
        case EventKind::alloc: entry("alloc", e, e.addr, scope); break;
        case EventKind::free:
          entry("free_requested", e, e.addr, scope);
          entry("free_completed", e, e.addr, scope);
          break;
        case EventKind::map: entry("segment_map", e, e.addr, {}); break;
        case EventKind::unmap: entry("segment_unmap", e, e.addr, {}); break;
        case EventKind::oom: entry("oom", e, e.device_free, scope); break;  // PyTorch: addr = free
        case EventKind::step:
        case EventKind::annotation: break;  // external_annotations
      }
    }
    p_.end_list();
    p_.end_list();
  }

  void entry(const char* action, const HistoryEvent& e, std::uintptr_t addr,
             const std::string& scope) {
    p_.begin_dict();
    p_.key("action").string(action);
    p_.key("addr").unsigned_integer(addr);
    p_.key("size").unsigned_integer(e.size);
    p_.key("stream").unsigned_integer(e.stream);
    p_.key("time_us").integer(e.time_ns / 1000);
    if (e.kind == EventKind::oom) p_.key("device_free").unsigned_integer(e.device_free);
    p_.key("compile_context").string("N/A");
    p_.key("user_metadata").string(scope);
    p_.key("frames");
    frames(e.frames, scope);
    p_.end_dict();
  }

  void allocator_settings() {
    p_.begin_dict();
    p_.key("PYTORCH_CUDA_ALLOC_CONF").string("");
    p_.key("max_split_size").integer(-1);
    p_.key("garbage_collection_threshold").real(0.0);
    p_.key("expandable_segments").boolean(true);
    p_.key("pinned_num_register_threads").integer(1);
    p_.key("release_lock_on_cudamalloc").boolean(false);
    p_.key("pinned_use_cuda_host_register").boolean(false);
    p_.key("graph_capture_record_stream_reuse").boolean(false);
    p_.key("roundup_power2_divisions").begin_dict().end_dict();
    p_.key("allocator").string("gmem");
    p_.key("memory_limit").unsigned_integer(s_.memory_limit);
    p_.key("granularity").unsigned_integer(s_.granularity);
    p_.end_dict();
  }

  void annotations() {
    p_.begin_list();
    for (const HistoryEvent& e : s_.history) {
      if (e.kind != EventKind::step && e.kind != EventKind::annotation) continue;
      p_.begin_dict();
      p_.key("device").integer(s_.device);
      p_.key("time_us").integer(e.time_ns / 1000);
      p_.key("stage").string(e.kind == EventKind::step ? "STEP" : "ANNOTATION");
      p_.key("name").string(e.kind == EventKind::step ? "step " + std::to_string(e.step) : e.text);
      p_.key("step").unsigned_integer(e.step);
      p_.end_dict();
    }
    p_.end_list();
  }

  // Graph tracking (gmem.torch.track_graphs): the live blocks saved for a backward pass not yet
  // run, and whether the program runs backward at all, for `gmem leaks` to tell a graph kept
  // alive. PyTorch's readers ignore the key.
  void graphs() {
    p_.begin_dict();
    p_.key("backward_runs").boolean(s_.backward_runs);
    p_.key("saved_for_backward");
    p_.begin_list();
    for (const SnapshotSegment& seg : s_.segments)
      for (const SnapshotBlock& b : seg.blocks)
        if (b.allocated && b.saved_for_backward) p_.unsigned_integer(b.address);
    p_.end_list();
    p_.end_dict();
  }

  // The tracking history's ring: whether it wrapped (dropped older events), so that readers say the
  // history began mid-run (gmem replay / leaks / summary rebuild what was live before it).
  // PyTorch's readers ignore the key.
  void history() {
    p_.begin_dict();
    p_.key("capacity").unsigned_integer(s_.history_capacity);
    p_.key("dropped_events").unsigned_integer(s_.dropped_events);
    p_.key("wrapped").boolean(s_.dropped_events > 0);
    p_.key("begins_time_us").integer(s_.history.empty() ? 0 : s_.history.front().time_ns / 1000);
    p_.end_dict();
  }

  // Each (frames, scope) list is written once and referenced after that, as Python would for a
  // shared list.
  void frames(FramesId id, const std::string& scope) {
    const auto key = std::pair{id, scope};
    if (auto it = frame_lists_.find(key); it != frame_lists_.end()) {
      p_.get(it->second);
      return;
    }
    p_.begin_list();
    if (auto it = s_.frames.find(id); it != s_.frames.end())
      for (const Frame& f : it->second) frame(f.filename, f.line, f.name);
    if (!scope.empty()) frame(kScopeFile, 0, scope);
    p_.end_list();
    frame_lists_.emplace(key, p_.memoize());
  }

  void frame(const std::string& filename, int line, const std::string& name) {
    p_.begin_dict();
    p_.key("filename").string(filename);
    p_.key("line").integer(line);
    p_.key("name").string(name);
    p_.end_dict();
  }

  const Snapshot& s_;
  detail::PickleWriter p_;
  std::map<std::pair<FramesId, std::string>, std::uint32_t> frame_lists_;
};

}  // namespace

std::string snapshot_pickle(const Snapshot& snapshot) { return SnapshotPickler(snapshot).run(); }

void write_snapshot_pickle(const Snapshot& snapshot, std::ostream& out) {
  const std::string bytes = snapshot_pickle(snapshot);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void write_snapshot_pickle(const Snapshot& snapshot, const std::string& path) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw BadInputError(path, 0, "cannot open the snapshot file for writing");
  write_snapshot_pickle(snapshot, out);
  out.flush();
  if (!out) throw BadInputError(path, 0, "cannot write the snapshot file (disk full?)");
}

}  // namespace gmem
