// Replays a trace's alloc/free sequence through gmem's Engine on a SimulatedDevice and measures
// what it reserved, the device calls it made and its host time, next to what the trace's own
// allocator (PyTorch's native one) reserved. The device's host clock follows the trace's
// timestamps, and with a lag the GPU runs behind it: memory freed on a stream moves to another
// stream, or is unmapped, only once the stream has caught up, and what that costs (device calls
// and host waits) is reported in modelled time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/trace.hpp"

namespace gmem::trace {

// One malloc replayed and what it cost (ReplayOptions::on_malloc): where gmem put it, and the
// device calls and stream waits made while it ran (modelled, as ReplayResult's figures are).
struct MallocCost {
  std::size_t pass = 0;      // 0-based (ReplayOptions::passes)
  std::size_t step = 0;      // 1-based: step ends (ReplayOptions::step_ends) before it, plus one
  std::size_t line = 0;      // its event's line (or record) in the trace file
  std::string_view frame;    // its event's user frame ("train.py:42:step"), empty if none
  StreamId stream = 0;
  std::size_t size = 0;      // requested
  DevicePtr address = 0;     // where gmem put it
  std::uint64_t creates = 0, maps = 0, unmaps = 0;
  double call_us = 0;        // modelled host time in device calls
  double wait_us = 0;        // modelled host time waiting for streams
};

struct ReplayOptions {
  std::size_t capacity = std::size_t{80} << 30;  // the simulated device's memory
  EngineOptions engine;                          // the engine's policy (cache_slack, ...)
  // Run Engine::check_invariants() at the end, and every `check_every` operations when nonzero.
  bool check_invariants = false;
  std::size_t check_every = 0;
  // Replays only the trace's first `stop_at_event` events (0: all of them): the state at a point.
  std::size_t stop_at_event = 0;
  // How far (modelled microseconds) the GPU runs behind the host: SimDeviceOptions::lag_us.
  // 0: stream work completes at once, the model of replays before the lag existed.
  double lag_us = 0;
  // Indices of the trace events after which a training step ends, ascending, when the caller
  // knows them (analysis::step_ends_from_live_minima, say): the result then counts steps.
  std::vector<std::size_t> step_ends;
  // Call Engine::mark_step() after each of `step_ends` (planned step layouts).
  bool mark_steps = false;
  // Fill ReplayResult::per_step: the figures at each of `step_ends` (does the layout settle?).
  bool record_steps = false;
  // Call Engine::empty_cache() after each of `step_ends`, as a program that calls
  // torch.cuda.empty_cache() after every step does: what that costs in device calls.
  bool empty_cache_each_step = false;
  // Runs the whole trace this many times in one engine, freeing what a pass leaves live before
  // the next: a program whose phases come back (a model built again, a sweep in one process).
  // With more than one, the "late" figures are the last pass's (ReplayResult::per_pass).
  std::size_t passes = 1;
  // Called after each malloc replayed, in every pass, with what it cost (`gmem replay
  // --malloc-log`): which blocks made the device calls, on which stream, in which step. Unset,
  // it costs the replay nothing; set, ReplayResult::ns_per_op counts its time too.
  std::function<void(const MallocCost&)> on_malloc;
  // Called when the replay stops, the engine still holding the live blocks (for summaries), with
  // each live block's engine pointer and the index of the trace event that allocated it.
  std::function<void(const Engine& engine, const std::vector<std::pair<std::uint32_t, void*>>& live)>
      on_stop;
};

// The replay at a step end (ReplayOptions::record_steps), or at a pass's end
// (ReplayOptions::passes, before the pass's leftovers are freed): what the step or pass did and
// where it left off.
struct StepFigures {
  std::size_t event = 0;          // the trace event it ended at
  std::uint64_t device_calls = 0; // creates + maps + unmaps during the step (or pass)
  double device_us = 0;           // modelled host time in device calls and stream waits
  std::uint64_t reserved = 0;     // gmem's reserved bytes at the step's end
  std::uint64_t peak_reserved = 0;
  std::uint64_t peak_allocated = 0;  // so far (requested sizes rounded as the engine counts them)
  // Steps only (ReplayOptions::record_steps): the first earlier step whose mallocs asked for the
  // same sizes on the same streams in the same order (1-based; 0: none, a shape not seen before),
  // and how many earlier steps did. A planned layout is made at a shape's first repeat, so from
  // its second repeat on (`times_seen` >= 2) a step should make no device calls.
  std::size_t repeats_step = 0;
  std::size_t times_seen = 0;
};

struct ReplayResult {
  std::string trace;            // the trace's name
  std::size_t events = 0;       // events in the trace (the allocs rebuilt before its history not counted)
  std::size_t mallocs = 0;      // engine calls made (allocs and frees replayed)
  std::size_t frees = 0;
  std::size_t live_at_end = 0;  // blocks never freed in the trace
  std::size_t capacity = 0;     // of the simulated device

  std::uint64_t peak_allocated = 0;          // peak of live sizes rounded to 512 B (PyTorch's)
  std::uint64_t recorded_peak_reserved = 0;  // the native allocator's, from segment events
  std::uint64_t peak_reserved = 0;           // gmem's reserved_bytes.all.peak

  std::uint64_t creates = 0;  // device calls made by the engine
  std::uint64_t maps = 0;
  std::uint64_t unmaps = 0;
  // Device calls (create + map + unmap) during the second half of the replayed operations: a
  // steady loop should make none once its working set is cached.
  std::uint64_t late_device_calls = 0;
  double ns_per_op = 0;  // host time inside Engine::malloc/free, per call (and the clock's update)

  // Modelled host time (SimulatedDevice, microseconds): in the engine's device calls (priced by
  // kDeviceCallPrices) and waiting for streams to catch up (under a lag); overall and during the
  // second half of the replayed operations (the steady state, as late_device_calls).
  double lag_us = 0;  // the GPU's lag the replay ran under
  double device_call_us = 0;
  double host_wait_us = 0;
  double late_device_call_us = 0;
  double late_host_wait_us = 0;
  double host_clock_us = 0;  // the host clock at the end: the trace's replayed span plus the waits
  // Memory handed from one stream to another that may still use it, the taker made to wait on
  // the GPU instead of the host (MemoryStats::num_stream_handovers).
  std::uint64_t stream_handovers = 0;
  // Step ends (ReplayOptions::step_ends) among the replayed events, and among those of the
  // second half; 0 when unknown.
  std::size_t steps = 0;
  std::size_t late_steps = 0;
  std::size_t steps_marked = 0;  // Engine::mark_step calls (0 with ReplayOptions::mark_steps off)

  // Buffers made anew in their place: allocations that the trace's own allocator put at the
  // address where it had put the last block of the same size (same_place_recorded), and of those,
  // how many gmem put where it had put that earlier block (same_place_kept). Programs that
  // re-create buffers and depend on their addresses (CUDA-graph code records a graph again when
  // a static input moved) need the two close (docs/engine.md, "a ninth batch": static_generate).
  std::uint64_t same_place_recorded = 0;
  std::uint64_t same_place_kept = 0;

  std::vector<StepFigures> per_step;  // ReplayOptions::record_steps: one per step end replayed
  std::vector<StepFigures> per_pass;  // ReplayOptions::passes > 1: one per pass replayed

  bool failed = false;
  std::string failure;  // the first failure: which event and why

  double reserved_ratio() const { return ratio(peak_reserved); }
  double recorded_ratio() const { return ratio(recorded_peak_reserved); }
  double ratio(std::uint64_t bytes) const {
    return peak_allocated ? static_cast<double>(bytes) / static_cast<double>(peak_allocated) : 0.0;
  }
};

// Step ends where a known line ends a step (the optimizer.step() call, where gmem.torch marks
// steps): after the last event of each run of events whose user frame names `frame` (whole
// names and numbers: train.py:42 is not train.py:420 nor mytrain.py:42).
// Ascending event indices, as ReplayOptions::step_ends; none when no frame names it.
std::vector<std::size_t> step_ends_after_frame(const Trace& trace, std::string_view frame);

// Step ends at the trace's own step markers, when they are gmem's (a snapshot written under gmem,
// whose program called gmem.step() or had gmem.torch watch its optimizer): after the last event
// before each marker. Ascending event indices; none when the trace has no such markers (PyTorch's
// annotations are not taken for steps here: the most frequent one may be a layer's).
std::vector<std::size_t> step_ends_at_markers(const Trace& trace);

// Replays `trace`; a malloc the engine cannot serve ends the replay with `failed` set. Throws
// BadInputError (file and line) for a free of an address that is not live in the trace (a trace
// read by read_trace has its blocks from before its history rebuilt: rebuild_history_window).
ReplayResult replay(const Trace& trace, const ReplayOptions& options = {});

// Checks `trace` as replay() does before it starts (an alloc of 0 bytes, an alloc at an address
// still live, a free of an address not live): throws the same BadInputError, naming file and line.
// For analyses that read a trace without replaying it (`gmem leaks`), so that every command
// rejects the same traces.
void check_trace(const Trace& trace);

// The smallest device capacity, a multiple of `granularity`, on which the replay has no failed
// malloc (bisection between peak allocated and what an unlimited replay reserved), with the GPU
// `lag_us` behind the host (ReplayOptions::lag_us).
// `marked_step_ends`: step ends to mark (ReplayOptions::mark_steps), none by default; `engine`:
// the engine's options (a page size larger than `granularity` makes that the bisection's step).
std::size_t min_capacity(const Trace& trace, double lag_us = 0,
                         std::size_t granularity = std::size_t{2} << 20,
                         const std::vector<std::size_t>& marked_step_ends = {},
                         const EngineOptions& engine = {});

}  // namespace gmem::trace
