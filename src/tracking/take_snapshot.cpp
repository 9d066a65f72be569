// Gathers a snapshot from a live engine (kept apart from make_snapshot: only this needs Engine).
#include "gmem/snapshot.hpp"

namespace gmem {

Snapshot take_snapshot(Engine& engine, const Tracker* tracker) {
  SnapshotInput input;
  Device& device = engine.device();
  input.device = device.index();
  input.device_name = device.name();
  input.granularity = device.granularity();
  try {
    input.mem_info = device.mem_info();
  } catch (const Error&) {  // the snapshot goes on without it
  }
  input.memory_limit = engine.memory_limit();
  input.stats = engine.detailed_stats();
  // The engine's blocks first, then the tracker's state: the tracker's history then covers
  // every change made after the blocks were listed.
  engine.for_each_block([&](const BlockInfo& b) { input.blocks.push_back(b); });
  TrackerState state;
  if (tracker != nullptr) {
    state = tracker->state();
    input.tracker = &state;
  }
  return make_snapshot(input);
}

}  // namespace gmem
