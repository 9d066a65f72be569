// Snapshots: the block layout, consistency with the history, gmem's JSON, and the PyTorch pickle
// (read back by Python's pickle, compared with a real torch snapshot, and replayed backwards the
// way memory_viz does).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>

#include "gmem/engine.hpp"
#include "gmem/scope.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/snapshot.hpp"
#include "gmem/trace.hpp"
#include "gmem/tracker.hpp"
#include "temp_files.hpp"
#include "tracking/pickle_writer.hpp"

#ifndef GMEM_TEST_DATA
#define GMEM_TEST_DATA "tests/data"
#endif

namespace gmem {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t kPage = 2 * MiB;

bool have_python() { return std::system("python3 -c pass >/dev/null 2>&1") == 0; }

using gmem::testing::TempPath;

TempPath write_temp(const std::string& name, const std::string& bytes) {
  TempPath path(name);
  std::ofstream(path.str(), std::ios::binary) << bytes;
  return path;
}

int run_python(const std::string& script, const std::string& args) {
  const TempPath path = write_temp("gmem_check.py", script);
  return std::system(("python3 " + path.str() + " " + args).c_str());
}

// Every segment is tiled by its blocks, page-aligned, and the blocks agree with themselves.
void expect_well_formed(const Snapshot& s) {
  std::uintptr_t previous_end = 0;
  for (const SnapshotSegment& seg : s.segments) {
    EXPECT_EQ(seg.address % kPage, 0u);
    EXPECT_EQ(seg.size % kPage, 0u);
    EXPECT_GT(seg.address, previous_end);  // sorted, disjoint and not touching (coalesced)
    previous_end = seg.address + seg.size;
    std::uintptr_t at = seg.address;
    for (const SnapshotBlock& b : seg.blocks) {
      EXPECT_EQ(b.address, at);
      EXPECT_GT(b.size, 0u);
      at += b.size;
    }
    EXPECT_EQ(at, seg.address + seg.size);
  }
}

std::vector<const SnapshotBlock*> allocated_blocks(const Snapshot& s) {
  std::vector<const SnapshotBlock*> out;
  for (const SnapshotSegment& seg : s.segments)
    for (const SnapshotBlock& b : seg.blocks)
      if (b.allocated) out.push_back(&b);
  return out;
}

// --- make_snapshot, pure -----------------------------------------------------------------------

TEST(MakeSnapshot, EngineBlocksAloneMakePageSegments) {
  SnapshotInput in;
  in.granularity = kPage;
  const std::uintptr_t base = 0x7f0000000000;
  in.blocks.push_back(BlockInfo{reinterpret_cast<void*>(base + 512), 1024, 1000, 0, true});
  in.blocks.push_back(BlockInfo{reinterpret_cast<void*>(base + kPage), 3 * MiB, 3 * MiB, 5, false});
  in.blocks.push_back(BlockInfo{reinterpret_cast<void*>(base + 10 * kPage), kPage, kPage, 0, false});
  const Snapshot s = make_snapshot(in);
  expect_well_formed(s);
  ASSERT_EQ(s.segments.size(), 2u);
  EXPECT_EQ(s.segments[0].address, base);
  EXPECT_EQ(s.segments[0].size, 3 * kPage);  // the first two blocks' pages, coalesced
  ASSERT_EQ(s.segments[0].blocks.size(), 5u);
  EXPECT_FALSE(s.segments[0].blocks[0].allocated);  // the 512 B before the first block
  EXPECT_EQ(s.segments[0].blocks[1].requested, 1000u);
  EXPECT_EQ(s.segments[0].blocks[3].stream, 5u);
  EXPECT_EQ(s.segments[1].blocks.size(), 1u);
  EXPECT_FALSE(s.tracking);
}

TEST(MakeSnapshot, TrackerDescribesItsBlocksAndHistoryDecidesFate) {
  const std::uintptr_t base = 0x7f0000000000;
  TrackerState t;
  t.mapped = {{base, 4 * kPage}};
  LiveAllocation a;
  a.addr = base;
  a.id = 7;
  a.size = 4096;
  a.requested = 4000;
  a.scope = scopes::intern("model.mlp");
  a.frames = frames::intern("m.py:3:forward");
  t.live.push_back(a);
  HistoryEvent freed;  // the engine still listed it, but the tracker saw it freed since
  freed.kind = EventKind::free;
  freed.addr = base + kPage;
  freed.size = 512;
  t.history.push_back(freed);

  SnapshotInput in;
  in.granularity = kPage;
  in.tracker = &t;
  in.blocks.push_back(BlockInfo{reinterpret_cast<void*>(base), 4096, 4000, 0, true});
  in.blocks.push_back(BlockInfo{reinterpret_cast<void*>(base + kPage), 512, 512, 0, true});
  in.blocks.push_back(BlockInfo{reinterpret_cast<void*>(base + 2 * kPage), 512, 512, 0, true});
  const Snapshot s = make_snapshot(in);
  expect_well_formed(s);
  ASSERT_EQ(s.segments.size(), 1u);
  EXPECT_EQ(s.segments[0].size, 4 * kPage);  // the mapped range the tracker saw
  const auto blocks = allocated_blocks(s);
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(blocks[0]->id, 7u);
  EXPECT_EQ(blocks[0]->scope, "model.mlp");
  EXPECT_EQ(blocks[0]->frames, a.frames);
  EXPECT_EQ(blocks[1]->address, base + 2 * kPage);  // allocated before tracking: kept, bare
  EXPECT_EQ(blocks[1]->id, 0u);
  ASSERT_EQ(s.frames.count(a.frames), 1u);
  EXPECT_EQ(s.frames.at(a.frames)[0].filename, "m.py");
}

TEST(MakeSnapshot, HistoryBlocksOutsideKnownMappingsGetSegments) {
  // A block allocated and freed in pages mapped before tracking began: replaying the history
  // backwards must still find it inside a segment.
  const std::uintptr_t base = 0x7f0000000000;
  TrackerState t;
  HistoryEvent alloc;
  alloc.kind = EventKind::alloc;
  alloc.addr = base + 5 * kPage + 512;
  alloc.size = 1024;
  HistoryEvent free = alloc;
  free.kind = EventKind::free;
  HistoryEvent map;  // pages mapped, used and unmapped within the history need nothing extra
  map.kind = EventKind::map;
  map.addr = base + 20 * kPage;
  map.size = kPage;
  HistoryEvent inside = alloc;
  inside.addr = base + 20 * kPage;
  HistoryEvent inside_free = inside;
  inside_free.kind = EventKind::free;
  HistoryEvent unmap = map;
  unmap.kind = EventKind::unmap;
  t.history = {alloc, free, map, inside, inside_free, unmap};
  SnapshotInput in;
  in.granularity = kPage;
  in.tracker = &t;
  const Snapshot s = make_snapshot(in);
  expect_well_formed(s);
  ASSERT_EQ(s.segments.size(), 1u);
  EXPECT_EQ(s.segments[0].address, base + 5 * kPage);
  EXPECT_EQ(s.segments[0].size, kPage);
  EXPECT_TRUE(allocated_blocks(s).empty());
}

// --- the pickle writer ---------------------------------------------------------------------------

TEST(PickleWriter, PythonReadsWhatItWrites) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: pickles not checked";
  detail::PickleWriter p;
  p.begin_dict();
  p.key("ints").begin_list();
  for (std::int64_t v : {std::int64_t{0}, std::int64_t{255}, std::int64_t{256}, std::int64_t{65535},
                         std::int64_t{65536}, std::int64_t{-1}, std::int64_t{-129},
                         std::int64_t{2147483647}, std::int64_t{2147483648},
                         std::int64_t{140543409520640}, std::int64_t{-140543409520640},
                         INT64_MAX, INT64_MIN})
    p.integer(v);
  p.unsigned_integer(UINT64_MAX);
  p.end_list();
  p.key("strings").begin_list().string("").string("caf\xc3\xa9").string(std::string(300, 'x'))
      .string("bad \xff byte").string("caf\xc3\xa9").end_list();
  p.key("misc").begin_list().boolean(true).boolean(false).none().real(0.25).int_pair(3, -4).end_list();
  p.key("big").begin_list();
  for (int i = 0; i < 2500; ++i) p.integer(i);
  p.end_list();
  p.key("wide").begin_dict();
  for (int i = 0; i < 2500; ++i) p.key("k" + std::to_string(i)).integer(i);
  p.end_dict();
  p.key("shared").begin_list().integer(1).end_list();
  const std::uint32_t memo = p.memoize();
  p.key("again").get(memo);
  p.end_dict();
  const TempPath path = write_temp("writer.pickle", p.finish());
  const char* script = R"PY(
import pickle, pickletools, sys
data = open(sys.argv[1], 'rb').read()
d = pickle.loads(data)
assert d['ints'] == [0, 255, 256, 65535, 65536, -1, -129, 2147483647, 2147483648,
                     140543409520640, -140543409520640, 2**63 - 1, -2**63, 2**64 - 1], d['ints']
assert d['strings'] == ['', 'caf\u00e9', 'x' * 300, 'bad \ufffd byte', 'caf\u00e9'], d['strings']
assert d['misc'] == [True, False, None, 0.25, (3, -4)], d['misc']
assert d['big'] == list(range(2500))
assert d['wide'] == {'k%d' % i: i for i in range(2500)}
assert d['again'] is d['shared']
# Only opcodes that PyTorch's JavaScript unpickler (memory_viz) knows.
known = set('PROTO FRAME EMPTY_DICT EMPTY_LIST MEMOIZE MARK SHORT_BINUNICODE BINUNICODE BININT '
            'BININT1 BININT2 LONG1 NEWFALSE NEWTRUE NONE TUPLE2 APPEND APPENDS SETITEMS BINGET '
            'LONG_BINGET BINFLOAT STOP'.split())
used = {op.name for op, _, _ in pickletools.genops(data)}
assert used <= known, used - known
)PY";
  EXPECT_EQ(run_python(script, path), 0);
}

// --- from a live engine --------------------------------------------------------------------------

struct Workload {
  SimulatedDevice device{SimDeviceOptions{std::size_t{1} << 30}};
  Engine engine{device};
  std::optional<Tracker> tracker;  // attached in run()
  std::vector<void*> untracked;  // allocated before tracking began
  std::vector<void*> kept;

  // Allocations before and after tracking starts, in scopes and at call sites, frees, a step,
  // an annotation, and (with `unmap`) a second stream and pages unmapped and mapped again.
  // Without it, tracked blocks come and go in pages mapped before tracking began: the tracker
  // knows them as mapped but has no map events for them.
  void run(bool unmap = true) {
    untracked.push_back(engine.malloc(3 * MiB));
    untracked.push_back(engine.malloc(700));
    void* early = engine.malloc(5 * MiB);
    engine.free(engine.malloc(4 * MiB));  // cached mapped pages: mapped before tracking began
    tracker.emplace(engine);
    engine.free(early);  // a free of a block allocated before tracking
    tracker->annotate("warm-up done");
    for (int step = 0; step < 3; ++step) {
      Scope s("model.h." + std::to_string(step) + ".mlp");
      frames::set_current("train.py:" + std::to_string(40 + step) + ":forward\ntrain.py:90:<module>");
      std::vector<void*> temp;
      for (std::size_t size : {std::size_t{512}, 64 * std::size_t{1024}, MiB, 6 * MiB})
        temp.push_back(engine.malloc(size, unmap && step == 2 ? 7 : 0));
      kept.push_back(engine.malloc(3000 + static_cast<std::size_t>(step)));
      for (void* p : temp) engine.free(p);
      frames::set_current("");
      tracker->step();
      if (unmap && step == 1) engine.empty_cache();  // later allocations map again
    }
  }
};

TEST(TakeSnapshot, MatchesTheEngine) {
  Workload w;
  w.run();
  const Snapshot s = take_snapshot(w.engine, &*w.tracker);
  expect_well_formed(s);
  EXPECT_TRUE(s.tracking);
  EXPECT_EQ(s.step, 3u);
  EXPECT_EQ(s.granularity, kPage);
  EXPECT_EQ(s.device_total, std::size_t{1} << 30);
  std::size_t live = 0;
  w.engine.for_each_block([&](const BlockInfo&) { ++live; });
  const auto blocks = allocated_blocks(s);
  ASSERT_EQ(blocks.size(), live);
  std::size_t tracked = 0;
  for (const SnapshotBlock* b : blocks) {
    const BlockInfo info = w.engine.block_info(reinterpret_cast<void*>(b->address));
    EXPECT_EQ(b->size, info.size);
    EXPECT_EQ(b->requested, info.requested);
    if (b->id == 0) continue;
    ++tracked;
    EXPECT_EQ(b->scope.rfind("model.h.", 0), 0u) << b->scope;
    ASSERT_EQ(s.frames.count(b->frames), 1u);
    EXPECT_EQ(s.frames.at(b->frames).size(), 2u);
  }
  EXPECT_EQ(tracked, w.kept.size());
  EXPECT_EQ(static_cast<std::int64_t>(live), s.stats.allocation[kAllPools].current);
}

TEST(TakeSnapshot, JsonFollowsTheSchema) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: JSON not checked";
  Workload w;
  w.run();
  const TempPath path = write_temp("snapshot.json", snapshot_json(take_snapshot(w.engine, &*w.tracker)));
  const char* script = R"PY(
import json, sys
d = json.load(open(sys.argv[1]))
assert d['schema'] == 'gmem.snapshot' and d['version'] == 1
assert d['device']['granularity'] == 2 << 20 and d['tracking']['step'] == 3
assert d['stats']['allocated_bytes.all.current'] == sum(
    b['size'] for s in d['segments'] for b in s['blocks'] if b['state'] == 'active_allocated')
for s in d['segments']:
    at = s['address']
    for b in s['blocks']:
        assert b['address'] == at and b['state'] in ('active_allocated', 'inactive')
        at += b['size']
    assert at == s['address'] + s['size']
scoped = [b for s in d['segments'] for b in s['blocks'] if b.get('scope')]
assert len(scoped) == 3 and all(str(b['frames']) in d['frames'] for b in scoped)
assert d['frames'][str(scoped[0]['frames'])][1] == {'filename': 'train.py', 'line': 90, 'name': '<module>'}
actions = [e['action'] for e in d['history']]
for a in ('alloc', 'free', 'map', 'unmap', 'step', 'annotation'):
    assert a in actions, a
assert [e['text'] for e in d['history'] if e['action'] == 'annotation'] == ['warm-up done']
assert {e['stream'] for e in d['history'] if e['action'] == 'alloc'} == {0, 7}
)PY";
  EXPECT_EQ(run_python(script, path), 0);
}

// memory_viz replays device_traces backwards from the segments (MemoryViz.js, simulate_memory);
// this is that replay, checking at every step what the JavaScript would trip over.
const char* kVizCheck = R"PY(
import pickle, sys
d = pickle.load(open(sys.argv[1], 'rb'))
real = pickle.load(open(sys.argv[2], 'rb'))
# The layout of a real torch snapshot: every key it has, gmem's has too.
assert set(real) <= set(d), set(real) - set(d)
assert set(real['segments'][0]) <= set(d['segments'][0])
assert set(real['segments'][0]['blocks'][0]) <= set(d['segments'][0]['blocks'][0])
assert set(real['device_traces'][0][0]) <= set(d['device_traces'][0][0])
assert set(real['allocator_settings']) <= set(d['allocator_settings'])
assert set(real['segments'][0]['frames'][0]) == {'filename', 'line', 'name'}
segs = d['segments']
for s in segs:
    assert s['device'] == 0 and s['segment_pool_id'] == (0, 0) and s['is_expandable'] is True
    at = s['address']
    for b in s['blocks']:
        assert b['address'] == at and b['state'] in ('active_allocated', 'inactive')
        at += b['size']
    assert at == s['address'] + s['total_size']
    assert s['allocated_size'] == sum(b['size'] for b in s['blocks'] if b['state'] == 'active_allocated')
trace = d['device_traces'][0]
actions = [e['action'] for e in trace]
for a in ('alloc', 'free_requested', 'free_completed', 'segment_map', 'segment_unmap'):
    assert a in actions or (a.startswith('segment') and sys.argv[3] == 'no-unmap'), a
# annotate_snapshot: free_requested directly followed by free_completed of the same block -> free
events = []
for e in trace:
    if e['action'] == 'free_completed' and events and events[-1]['action'] == 'free_requested' \
            and events[-1]['addr'] == e['addr']:
        events[-1] = dict(events[-1], action='free')
        continue
    events.append(e)
assert 'free_requested' not in [e['action'] for e in events]
segments = sorted([[s['address'], s['total_size']] for s in segs])
blocks = {b['address']: b['size'] for s in segs for b in s['blocks'] if b['state'] == 'active_allocated'}
def find(addr):
    for s in segments:
        if s[0] <= addr < s[0] + s[1]:
            return s
    return None
def map_segment(addr, size):  # undo an unmap: merge with neighbours
    segments.append([addr, size]); segments.sort()
    i = 0
    while i + 1 < len(segments):
        a, b = segments[i], segments[i + 1]
        assert a[0] + a[1] <= b[0], 'overlapping segments'
        if a[0] + a[1] == b[0]:
            a[1] += b[1]; del segments[i + 1]
        else:
            i += 1
def unmap_segment(addr, size):  # undo a map: the range must lie in one segment, with no block
    s = find(addr)
    assert s is not None and addr + size <= s[0] + s[1], 'map of a range not in one segment'
    for b in blocks:
        assert not (addr <= b < addr + size), 'block left in an unmapped range'
    end = s[0] + s[1]
    segments.remove(s)
    if s[0] < addr: segments.append([s[0], addr - s[0]])
    if addr + size < end: segments.append([addr + size, end - addr - size])
    segments.sort()
for b in blocks:
    assert find(b) is not None
for e in reversed(events):
    a = e['action']
    if a in ('free', 'free_completed'):
        blocks[e['addr']] = e['size']
        assert find(e['addr']) is not None, 'freed block outside every segment'
    elif a == 'alloc':
        assert e['addr'] in blocks, 'alloc of a block not live after it'
        del blocks[e['addr']]
    elif a == 'segment_unmap':
        map_segment(e['addr'], e['size'])
    elif a == 'segment_map':
        unmap_segment(e['addr'], e['size'])
scoped = [e for e in trace if e['user_metadata']]
assert scoped and all(e['frames'][-1] == {'filename': '<gmem scope>', 'line': 0, 'name': e['user_metadata']} for e in scoped)
assert any(f['filename'] == 'train.py' and f['line'] == 40 for e in scoped for f in e['frames'])
ann = [a['name'] for a in d['external_annotations']]
assert ann == ['warm-up done', 'step 1', 'step 2', 'step 3'], ann
)PY";

TEST(TakeSnapshot, PickleOpensInMemoryViz) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: pickle not checked";
  for (bool unmap : {true, false}) {
    Workload w;
    w.run(unmap);
    const TempPath path("snapshot.pickle");
    write_snapshot_pickle(take_snapshot(w.engine, &*w.tracker), path);
    EXPECT_EQ(run_python(kVizCheck, path.str() + " " GMEM_TEST_DATA "/tiny_leak.snapshot.pickle " +
                                        (unmap ? "unmap" : "no-unmap")),
              0)
        << (unmap ? "with" : "without") << " unmaps";
  }
}

TEST(TakeSnapshot, PickleReadsBackAsATrace) {
  // gmem's own trace reader (the one `gmem replay` and `gmem leaks` use) reads the pickle.
  Workload w;
  w.run();
  const Snapshot s = take_snapshot(w.engine, &*w.tracker);
  const TempPath path("snapshot_trace.pickle");
  write_snapshot_pickle(s, path);
  const trace::Trace t = trace::read_trace(path);
  std::size_t allocs = 0, frees = 0, maps = 0, unmaps = 0;
  for (const HistoryEvent& e : s.history) {
    allocs += e.kind == EventKind::alloc;
    frees += e.kind == EventKind::free;
    maps += e.kind == EventKind::map;
    unmaps += e.kind == EventKind::unmap;
  }
  std::size_t seen[6] = {};
  for (const trace::Event& e : t.events)
    if (!e.before_history) ++seen[static_cast<int>(e.action)];  // not the blocks live before tracking
  EXPECT_EQ(seen[static_cast<int>(trace::Action::alloc)], allocs);
  EXPECT_EQ(seen[static_cast<int>(trace::Action::free_requested)], frees);
  EXPECT_EQ(seen[static_cast<int>(trace::Action::free_completed)], frees);
  EXPECT_EQ(seen[static_cast<int>(trace::Action::segment_alloc)], maps);
  EXPECT_EQ(seen[static_cast<int>(trace::Action::segment_free)], unmaps);
  bool user_frame = false;
  for (const trace::Event& e : t.events)
    user_frame = user_frame || (e.user_frame != 0 && t.frames[e.user_frame].rfind("train.py:", 0) == 0);
  EXPECT_TRUE(user_frame);
}

TEST(TakeSnapshot, WithoutATracker) {
  Workload w;
  w.run();
  const Snapshot s = take_snapshot(w.engine);
  expect_well_formed(s);
  EXPECT_FALSE(s.tracking);
  EXPECT_TRUE(s.history.empty());
  EXPECT_EQ(allocated_blocks(s).size(), w.untracked.size() + w.kept.size());
  std::ostringstream out;
  write_snapshot_pickle(s, out);
  EXPECT_EQ(out.str().substr(0, 2), std::string("\x80\x04", 2));
  EXPECT_EQ(out.str().back(), '.');
}

TEST(TakeSnapshot, UnwritablePathIsAClearError) {
  Snapshot s;
  try {
    write_snapshot_pickle(s, "/nonexistent-dir/x.pickle");
    FAIL() << "no error";
  } catch (const BadInputError& e) {
    EXPECT_EQ(e.file(), "/nonexistent-dir/x.pickle");
  }
}

}  // namespace
}  // namespace gmem
