// Snapshots: what gmem holds on a device right now, block by block, with the tracker's recent
// history. Written as JSON (gmem's schema, docs/snapshot-schema.md) or as the pickle that
// torch.cuda.memory._dump_snapshot() writes, so that PyTorch's memory_viz
// (https://pytorch.org/memory_viz) and torch.cuda._memory_viz open gmem's snapshots.
//
// Segments are mapped virtual ranges (gmem maps 2 MiB chunks anywhere, like PyTorch's expandable
// segments): those the tracker saw mapped, plus the pages of every live block. Without a tracker
// only the latter are known. Each segment's blocks tile it: live blocks and the free gaps between.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <map>
#include <string>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/stats.hpp"
#include "gmem/tracker.hpp"

namespace gmem {

struct SnapshotBlock {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::size_t requested = 0;  // 0 for free gaps
  bool allocated = false;     // false: a free gap ("inactive")
  StreamId stream = 0;
  // From the tracker (zero / empty when the block was not tracked):
  std::uint64_t id = 0;
  std::int64_t time_ns = 0;
  std::uint64_t step = 0;
  std::string scope;
  FramesId frames = 0;
  bool saved_for_backward = false;  // graph tracking: saved for a backward pass not yet run
};

struct SnapshotSegment {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::vector<SnapshotBlock> blocks;  // by address, tiling [address, address + size)
};

struct Snapshot {
  int device = 0;
  std::string device_name;
  std::size_t device_total = 0;
  std::size_t device_free = 0;
  std::size_t granularity = 0;
  std::size_t memory_limit = 0;
  MemoryStats stats;
  bool tracking = false;  // a tracker contributed ids, scopes, frames and history
  std::uint64_t step = 0;
  std::uint64_t dropped_events = 0;  // history events the ring overwrote: > 0 when it wrapped
  std::size_t history_capacity = 0;  // events the ring keeps
  bool backward_runs = false;  // graph tracking saw a backward pass
  std::vector<SnapshotSegment> segments;  // by address
  std::vector<HistoryEvent> history;      // oldest first
  std::map<FramesId, std::vector<Frame>> frames;  // every frames id the blocks and history use
};

// What a snapshot is made from; take_snapshot gathers it from an engine and a tracker.
struct SnapshotInput {
  int device = 0;
  std::string device_name;
  DeviceMemInfo mem_info;
  std::size_t granularity = 0;
  std::size_t memory_limit = 0;
  MemoryStats stats;
  std::vector<BlockInfo> blocks;       // the engine's live blocks
  const TrackerState* tracker = nullptr;
};

// Pure: the snapshot of `input`. Blocks the tracker knows are described by it; the engine's other
// blocks (allocated before tracking began) appear without ids or frames. Segments are made
// consistent with the history, so that replaying it backwards (as memory_viz does) never meets a
// block outside a segment.
Snapshot make_snapshot(const SnapshotInput& input);

// The snapshot of `engine` now, with `tracker`'s state when given (it should be the engine's
// listener). Takes the engine's lock, then the tracker's, never both at once.
Snapshot take_snapshot(Engine& engine, const Tracker* tracker = nullptr);

// gmem's JSON (docs/snapshot-schema.md).
std::string snapshot_json(const Snapshot& snapshot);

// torch.cuda.memory._snapshot()'s layout, pickled (protocol 4, plain data only: dicts, lists,
// strings, ints, bools). Throws Error(bad_input) naming `path` when it cannot be written.
void write_snapshot_pickle(const Snapshot& snapshot, std::ostream& out);
void write_snapshot_pickle(const Snapshot& snapshot, const std::string& path);
std::string snapshot_pickle(const Snapshot& snapshot);

}  // namespace gmem
