// Building a snapshot from the engine's blocks and the tracker's state, and gmem's JSON of it.
#include "gmem/snapshot.hpp"

#include <algorithm>
#include <unordered_set>

#include "common/json.hpp"
#include "tracking/interval_set.hpp"

namespace gmem {
namespace {

struct Pages {
  std::size_t granularity;
  std::uintptr_t down(std::uintptr_t a) const { return a / granularity * granularity; }
  std::uintptr_t up(std::uintptr_t a) const { return (a + granularity - 1) / granularity * granularity; }
};

bool is_block_event(EventKind kind) { return kind == EventKind::alloc || kind == EventKind::free; }

// The live blocks at the end of the history: the tracker's, then the engine's others, except
// those the history shows allocated or freed (the tracker knows their fate better).
std::vector<SnapshotBlock> final_blocks(const SnapshotInput& input) {
  std::vector<SnapshotBlock> out;
  std::unordered_set<std::uintptr_t> known;
  if (const TrackerState* t = input.tracker) {
    for (const HistoryEvent& e : t->history)
      if (is_block_event(e.kind)) known.insert(e.addr);
    for (const LiveAllocation& a : t->live) {
      known.insert(a.addr);
      SnapshotBlock b;
      b.address = a.addr;
      b.size = a.size;
      b.requested = a.requested;
      // Not the engine's size for it: the engine's blocks were listed at another moment, and
      // another thread may have freed the block and allocated one of another size there since
      // (both hold the size the engine handed out). The tracker's is the one its history agrees with.
      b.allocated = true;
      b.stream = a.stream;
      b.id = a.id;
      b.time_ns = a.time_ns;
      b.step = a.step;
      b.scope = a.scope != 0 ? scopes::path(a.scope) : std::string();
      b.frames = a.frames;
      b.saved_for_backward = a.saved_for_backward;
      out.push_back(std::move(b));
    }
  }
  for (const BlockInfo& info : input.blocks) {
    const auto addr = reinterpret_cast<std::uintptr_t>(info.ptr);
    if (known.count(addr) != 0) continue;
    SnapshotBlock b;
    b.address = addr;
    b.size = info.size;
    b.requested = info.requested;
    b.allocated = true;
    b.stream = info.stream;
    out.push_back(std::move(b));
  }
  std::sort(out.begin(), out.end(),
            [](const SnapshotBlock& a, const SnapshotBlock& b) { return a.address < b.address; });
  return out;
}

// The mapped ranges at the end of the history, made consistent with it: walking the history
// backwards (undoing maps and unmaps), every block event must land in a mapped range. Where one
// does not, its pages were mapped before tracking began and still are.
detail::IntervalSet final_segments(const SnapshotInput& input,
                                   const std::vector<SnapshotBlock>& blocks, Pages pages) {
  detail::IntervalSet mapped;
  if (input.tracker != nullptr)
    for (const auto& [addr, size] : input.tracker->mapped) mapped.add(addr, addr + size);
  for (const SnapshotBlock& b : blocks)
    mapped.add(pages.down(b.address), pages.up(b.address + std::max<std::size_t>(b.size, 1)));
  if (input.tracker == nullptr) return mapped;
  detail::IntervalSet then = mapped;  // the mapping as it was at the event being undone
  const std::vector<HistoryEvent>& history = input.tracker->history;
  for (auto e = history.rbegin(); e != history.rend(); ++e) {
    if (e->kind == EventKind::map) {
      then.remove(e->addr, e->addr + e->size);
    } else if (e->kind == EventKind::unmap) {
      then.add(e->addr, e->addr + e->size);
    } else if (is_block_event(e->kind) && !then.contains(e->addr)) {
      const std::uintptr_t begin = pages.down(e->addr);
      const std::uintptr_t end = pages.up(e->addr + std::max<std::size_t>(e->size, 1));
      then.add(begin, end);
      mapped.add(begin, end);
    }
  }
  return mapped;
}

}  // namespace

Snapshot make_snapshot(const SnapshotInput& input) {
  Snapshot s;
  s.device = input.device;
  s.device_name = input.device_name;
  s.device_total = input.mem_info.total;
  s.device_free = input.mem_info.free;
  s.granularity = input.granularity;
  s.memory_limit = input.memory_limit;
  s.stats = input.stats;
  if (const TrackerState* t = input.tracker) {
    s.tracking = true;
    s.step = t->step;
    s.dropped_events = t->dropped_events;
    s.history_capacity = t->history_capacity;
    s.backward_runs = t->backward_runs;
    s.history = t->history;
  }
  const Pages pages{std::max<std::size_t>(input.granularity, 1)};
  std::vector<SnapshotBlock> blocks = final_blocks(input);
  const detail::IntervalSet mapped = final_segments(input, blocks, pages);

  auto block = blocks.begin();
  for (const auto& [begin, end] : mapped.ranges()) {
    SnapshotSegment segment;
    segment.address = begin;
    segment.size = end - begin;
    std::uintptr_t at = begin;
    auto gap_to = [&](std::uintptr_t to) {
      if (to <= at) return;
      SnapshotBlock gap;
      gap.address = at;
      gap.size = to - at;
      segment.blocks.push_back(std::move(gap));
      at = to;
    };
    for (; block != blocks.end() && block->address < end; ++block) {
      if (block->address < at) continue;  // overlaps the previous one (a missed free): drop it
      gap_to(block->address);
      at = block->address + block->size;
      segment.blocks.push_back(std::move(*block));
    }
    gap_to(end);
    s.segments.push_back(std::move(segment));
  }

  for (const SnapshotSegment& seg : s.segments)
    for (const SnapshotBlock& b : seg.blocks)
      if (b.frames != 0) s.frames.emplace(b.frames, std::vector<Frame>{});
  for (const HistoryEvent& e : s.history)
    if (e.frames != 0) s.frames.emplace(e.frames, std::vector<Frame>{});
  for (auto& [id, stack] : s.frames) stack = frames::get(id);
  return s;
}

std::string snapshot_json(const Snapshot& s) {
  json::Writer j;
  j.begin_object();
  j.field("schema", "gmem.snapshot").field("version", 1);
  j.key("device").begin_object();
  j.field("index", s.device).field("name", s.device_name).field("total", s.device_total);
  j.field("free", s.device_free).field("granularity", s.granularity);
  j.end_object();
  j.field("memory_limit", s.memory_limit);
  j.key("tracking").begin_object();
  j.field("enabled", s.tracking).field("step", s.step).field("dropped_events", s.dropped_events);
  j.field("history_capacity", s.history_capacity).field("history_wrapped", s.dropped_events > 0);
  // When the kept history begins (its oldest event), 0 when empty: before it, only state is known.
  j.field("history_begins_ns", s.history.empty() ? std::int64_t{0} : s.history.front().time_ns);
  j.field("backward_runs", s.backward_runs);
  j.end_object();
  j.key("stats").begin_object();
  for (const auto& [name, value] : s.stats.flatten()) j.field(name, value);
  j.end_object();

  j.key("segments").begin_array();
  for (const SnapshotSegment& seg : s.segments) {
    std::size_t allocated = 0, requested = 0;
    for (const SnapshotBlock& b : seg.blocks) {
      if (!b.allocated) continue;
      allocated += b.size;
      requested += b.requested;
    }
    j.begin_object();
    j.field("address", seg.address).field("size", seg.size);
    j.field("allocated_size", allocated).field("requested_size", requested);
    j.key("blocks").begin_array();
    for (const SnapshotBlock& b : seg.blocks) {
      j.begin_object();
      j.field("address", b.address).field("size", b.size);
      j.field("state", b.allocated ? "active_allocated" : "inactive");
      if (b.allocated) {
        j.field("requested_size", b.requested).field("stream", b.stream);
        j.field("id", b.id).field("step", b.step).field("time_ns", b.time_ns);
        j.field("scope", b.scope).field("frames", b.frames);
        j.field("saved_for_backward", b.saved_for_backward);
      }
      j.end_object();
    }
    j.end_array();
    j.end_object();
  }
  j.end_array();

  j.key("history").begin_array();
  for (const HistoryEvent& e : s.history) {
    j.begin_object();
    j.field("action", event_kind_name(e.kind));
    j.field("addr", e.addr).field("size", e.size).field("stream", e.stream);
    j.field("time_ns", e.time_ns).field("step", e.step);
    j.field("scope", e.scope != 0 ? scopes::path(e.scope) : std::string());
    j.field("frames", e.frames).field("id", e.id);
    if (e.kind == EventKind::annotation || e.kind == EventKind::oom) j.field("text", e.text);
    if (e.kind == EventKind::oom) j.field("device_free", e.device_free);
    j.end_object();
  }
  j.end_array();

  j.key("frames").begin_object();
  for (const auto& [id, stack] : s.frames) {
    j.key(std::to_string(id)).begin_array();
    for (const Frame& f : stack) {
      j.begin_object();
      j.field("filename", f.filename).field("line", f.line).field("name", f.name);
      j.end_object();
    }
    j.end_array();
  }
  j.end_object();
  j.end_object();
  return j.take();
}

}  // namespace gmem
