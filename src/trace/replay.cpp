// Replay in two passes: the trace is first compiled into a flat list of malloc/free operations on
// numbered slots (resolving addresses, checking the trace, computing its own peaks), so that the
// timed pass does nothing but call the engine.
#include "trace/replay.hpp"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <unordered_map>

#include "gmem/engine.hpp"
#include "gmem/error.hpp"
#include "gmem/sim_device.hpp"

namespace gmem::trace {

namespace {

constexpr std::uint64_t round_up(std::uint64_t value, std::uint64_t to) { return (value + to - 1) / to * to; }

std::string hex(std::uint64_t value) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(value));
  return buf;
}

struct Op {
  std::uint64_t size = 0;    // malloc only
  std::uint64_t stream = 0;  // malloc only
  double host_advance_us = 0;  // trace time since the previous op (0 if the clock went back)
  std::uint32_t slot = 0;    // which live block
  bool malloc = false;
  std::uint32_t event = 0;   // index into the trace's events, for messages
  // malloc only: the earlier malloc op the trace put at this address with this size, when its
  // last block there had this size (ReplayResult::same_place_recorded); kNoOp otherwise.
  std::uint32_t same_place_as = kNoOp;
  static constexpr std::uint32_t kNoOp = ~std::uint32_t{0};
};

struct Program {
  std::vector<Op> ops;
  std::size_t slots = 0;
  std::size_t mallocs = 0;
  std::size_t live_at_end = 0;
  std::uint64_t peak_allocated = 0;
  std::uint64_t recorded_peak_reserved = 0;
};

Program compile(const Trace& trace) {
  Program p;
  struct Live {
    std::uint32_t slot;
    std::uint64_t size;
    std::size_t line;
  };
  std::unordered_map<std::uint64_t, Live> live;  // trace address -> block
  struct LastThere {
    std::uint64_t size;
    std::uint32_t op;
  };
  std::unordered_map<std::uint64_t, LastThere> last_there;  // trace address -> its last malloc
  std::vector<std::uint32_t> free_slots;
  std::uint64_t allocated = 0, reserved = 0;
  std::int64_t last_op_time_us = 0;
  // Host time between an op and the one before it; the first op starts the clock at 0.
  auto since_last_op = [&](const Event& e) {
    const std::int64_t gap = p.ops.empty() ? 0 : e.time_us - last_op_time_us;
    last_op_time_us = p.ops.empty() ? e.time_us : std::max(last_op_time_us, e.time_us);
    return static_cast<double>(std::max<std::int64_t>(gap, 0));
  };
  p.ops.reserve(trace.events.size());
  for (std::size_t i = 0; i < trace.events.size(); ++i) {
    const Event& e = trace.events[i];
    const auto index = static_cast<std::uint32_t>(i);
    switch (e.action) {
      case Action::alloc: {
        if (e.size == 0) throw BadInputError(trace.path, e.line, "alloc of 0 bytes");
        std::uint32_t slot;
        if (free_slots.empty()) {
          slot = static_cast<std::uint32_t>(p.slots++);
        } else {
          slot = free_slots.back();
          free_slots.pop_back();
        }
        auto [it, fresh] = live.try_emplace(e.addr, Live{slot, e.size, e.line});
        if (!fresh)
          throw BadInputError(trace.path, e.line,
                              "alloc at " + hex(e.addr) + ", which is still live (allocated at line " +
                                  std::to_string(it->second.line) + ")");
        Op op{e.size, e.stream, since_last_op(e), slot, true, index};
        const auto op_index = static_cast<std::uint32_t>(p.ops.size());
        auto [there, first] = last_there.try_emplace(e.addr, LastThere{e.size, op_index});
        if (!first) {
          if (there->second.size == e.size) op.same_place_as = there->second.op;
          there->second = LastThere{e.size, op_index};
        }
        p.ops.push_back(op);
        ++p.mallocs;
        allocated += round_up(e.size, kAlignment);
        p.peak_allocated = std::max(p.peak_allocated, allocated);
        break;
      }
      case Action::free_completed: {
        auto it = live.find(e.addr);
        if (it == live.end())
          throw BadInputError(trace.path, e.line, "free of " + hex(e.addr) + ", which is not live");
        p.ops.push_back(Op{0, 0, since_last_op(e), it->second.slot, false, index});
        free_slots.push_back(it->second.slot);
        allocated -= round_up(it->second.size, kAlignment);
        live.erase(it);
        break;
      }
      case Action::segment_alloc:
        reserved += e.size;
        p.recorded_peak_reserved = std::max(p.recorded_peak_reserved, reserved);
        break;
      case Action::segment_free:
        reserved -= std::min(reserved, e.size);  // a trace cut short may free what it never saw
        break;
      case Action::free_requested:  // the block is reusable only at free_completed
      case Action::oom:
        break;
    }
  }
  p.live_at_end = live.size();
  return p;
}

struct DeviceCounts {
  std::uint64_t creates, maps, unmaps;
  double call_us, wait_us;  // modelled
  static DeviceCounts of(const SimulatedDevice& d) {
    const SimCallLedger& ledger = d.ledger();
    return {ledger.calls(DeviceCall::create_chunk), ledger.calls(DeviceCall::map),
            ledger.calls(DeviceCall::unmap), ledger.modelled_call_us(), ledger.modelled_wait_us()};
  }
  std::uint64_t total() const { return creates + maps + unmaps; }
};

// A step's requests hashed in order (FNV-1a over each malloc's size and stream): equal steps
// hash equal, and two different ones collide once in 2^64.
constexpr std::uint64_t kRequestsSeed = 0xcbf29ce484222325ull;
std::uint64_t add_request(std::uint64_t hash, std::size_t size, StreamId stream) {
  for (std::uint64_t word : {static_cast<std::uint64_t>(size), static_cast<std::uint64_t>(stream)})
    for (int byte = 0; byte < 8; ++byte) hash = (hash ^ ((word >> (8 * byte)) & 0xff)) * 0x100000001b3ull;
  return hash;
}

ReplayResult run(const Trace& trace, const Program& program, const ReplayOptions& options) {
  ReplayResult r;
  r.trace = trace.name;
  r.events = trace.events.size() - trace.window.blocks_at_start;  // the file's, not the rebuilt allocs
  r.capacity = options.capacity;
  r.live_at_end = program.live_at_end;
  r.peak_allocated = program.peak_allocated;
  r.recorded_peak_reserved = program.recorded_peak_reserved;

  SimDeviceOptions device_options;
  device_options.capacity = options.capacity;
  device_options.lag_us = options.lag_us;
  SimulatedDevice device(device_options);
  Engine engine(device, options.engine);
  std::vector<void*> blocks(program.slots);
  std::vector<void*> placed(program.ops.size());  // each malloc op's block (same_place_kept)

  // Timed stretches end at the half-way mark (to count late device calls) and at checks.
  const std::size_t n =
      options.stop_at_event == 0
          ? program.ops.size()
          : static_cast<std::size_t>(std::partition_point(program.ops.begin(), program.ops.end(),
                                                          [&](const Op& op) { return op.event < options.stop_at_event; }) -
                                     program.ops.begin());
  // One pass: the first half and the second are timed apart (late device calls). Repeated
  // passes: the last pass is the late part.
  const std::size_t passes = std::max<std::size_t>(options.passes, 1);
  const std::size_t half = passes > 1 ? 0 : n / 2;
  const std::size_t every = options.check_invariants ? options.check_every : 0;
  std::chrono::nanoseconds engine_time{0};
  DeviceCounts at_half{};
  std::size_t done = 0, pass = 0;
  std::size_t next_end = 0;  // into options.step_ends, when marking or recording them
  const bool log_mallocs = static_cast<bool>(options.on_malloc);
  const std::size_t ends = options.mark_steps || options.record_steps ||
                                   options.empty_cache_each_step || log_mallocs
                               ? options.step_ends.size()
                               : 0;
  // The figures at `event`, device calls and time counted since `from` (which moves on to now).
  auto figures = [&](std::size_t event, DeviceCounts& from) {
    const DeviceCounts now = DeviceCounts::of(device);
    const MemoryStats stats = engine.stats();
    const StepFigures f{event, now.total() - from.total(),
                        now.call_us + now.wait_us - from.call_us - from.wait_us,
                        static_cast<std::uint64_t>(stats.reserved_bytes[kAllPools].current),
                        static_cast<std::uint64_t>(stats.reserved_bytes[kAllPools].peak),
                        static_cast<std::uint64_t>(stats.allocated_bytes[kAllPools].peak)};
    from = now;
    return f;
  };
  DeviceCounts at_step{};
  // The open step's requests (sizes and streams, in order) as a hash, and the steps seen by
  // their hash: which earlier step a step repeats (StepFigures::repeats_step), in any pass.
  std::uint64_t step_requests = kRequestsSeed;
  std::unordered_map<std::uint64_t, std::pair<std::size_t, std::size_t>> steps_seen;  // first, count
  auto end_step = [&](std::size_t event) {
    if (options.mark_steps) engine.mark_step();
    if (options.empty_cache_each_step) engine.empty_cache();
    if (!options.record_steps) return;
    StepFigures f = figures(event, at_step);
    auto [seen, fresh] = steps_seen.try_emplace(step_requests, r.per_step.size() + 1, 0);
    if (!fresh) f.repeats_step = seen->second.first;
    f.times_seen = seen->second.second++;
    step_requests = kRequestsSeed;
    r.per_step.push_back(f);
  };
  // The slots a pass's first `count` ops leave live (a slot is live when its last op mallocs).
  auto live_slots = [&](std::size_t count) {
    std::vector<bool> live(program.slots, false);
    for (std::size_t i = 0; i < count; ++i) live[program.ops[i].slot] = program.ops[i].malloc;
    return live;
  };
  try {
    for (; pass < passes; ++pass) {
      DeviceCounts at_pass = DeviceCounts::of(device);
      if (pass > 0) {  // free what the last pass left live, then run the trace again
        const std::vector<bool> live = live_slots(n);
        done = 0;  // (before the frees: the error report reads program.ops[done])
        next_end = 0;
        step_requests = kRequestsSeed;  // what followed the last step end is no step's
        for (std::size_t slot = 0; slot < program.slots; ++slot)
          if (live[slot]) engine.free(blocks[slot]);
      }
      if (passes > 1 && pass + 1 == passes) at_half = DeviceCounts::of(device);
      while (done < n) {
        std::size_t end = n;
        if (done < half) end = half;
        if (every) end = std::min(end, (done / every + 1) * every);
        const auto start = std::chrono::steady_clock::now();
        for (; done < end; ++done) {
          const Op& op = program.ops[done];
          // Step ends before this op's event are marked (and recorded) before it (a step end is
          // an op's event, so the mark comes right after that op).
          while (next_end < ends && options.step_ends[next_end] < op.event) [[unlikely]]
            end_step(options.step_ends[next_end++]);
          // The host clock follows the trace from where it stands: after a modelled wait, the
          // rest of the trace happens that much later.
          if (op.host_advance_us > 0) device.ledger().advance_host_time(op.host_advance_us);
          if (op.malloc) {
            if (options.record_steps) step_requests = add_request(step_requests, op.size, op.stream);
            const DeviceCounts before = log_mallocs ? DeviceCounts::of(device) : DeviceCounts{};
            void* const block = engine.malloc(op.size, op.stream);
            if (log_mallocs) [[unlikely]] {
              const DeviceCounts after = DeviceCounts::of(device);
              const Event& e = trace.events[op.event];
              options.on_malloc({pass, next_end + 1, e.line, trace.frames[e.user_frame], op.stream,
                                 op.size, reinterpret_cast<DevicePtr>(block), after.creates - before.creates,
                                 after.maps - before.maps, after.unmaps - before.unmaps,
                                 after.call_us - before.call_us, after.wait_us - before.wait_us});
            }
            blocks[op.slot] = block;
            placed[done] = block;
            if (op.same_place_as != Op::kNoOp) {
              ++r.same_place_recorded;
              r.same_place_kept += placed[op.same_place_as] == block;
            }
          } else {
            engine.free(blocks[op.slot]);
          }
        }
        engine_time += std::chrono::steady_clock::now() - start;
        if (passes == 1 && done == half) at_half = DeviceCounts::of(device);
        if (every && done % every == 0) engine.check_invariants();
      }
      if (done == program.ops.size())  // step ends after the last op
        while (next_end < ends) end_step(options.step_ends[next_end++]);
      if (passes > 1) r.per_pass.push_back(figures(n ? program.ops[n - 1].event : 0, at_pass));
    }
  } catch (const Error& error) {
    const Op& op = program.ops[done];
    const Event& e = trace.events[op.event];
    r.failed = true;
    r.failure = trace.path + ":" + std::to_string(e.line) + ": " +
                (op.malloc ? "alloc of " + std::to_string(op.size) + " bytes" : std::string("free")) +
                " failed: " + error.what() + (passes > 1 ? " (pass " + std::to_string(pass + 1) + ")" : "");
  }
  if (options.check_invariants) engine.check_invariants();
  if (options.on_stop) {  // which blocks are live, and which trace event allocated each
    std::vector<std::uint32_t> allocated_by(program.slots);
    const std::vector<bool> live = live_slots(done);
    for (std::size_t i = 0; i < done; ++i) allocated_by[program.ops[i].slot] = program.ops[i].event;
    std::vector<std::pair<std::uint32_t, void*>> live_blocks;
    for (std::size_t slot = 0; slot < program.slots; ++slot)
      if (live[slot]) live_blocks.emplace_back(allocated_by[slot], blocks[slot]);
    options.on_stop(engine, live_blocks);
  }

  const DeviceCounts end_counts = DeviceCounts::of(device);
  const MemoryStats stats = engine.stats();
  r.peak_reserved = static_cast<std::uint64_t>(stats.reserved_bytes[kAllPools].peak);
  r.steps_marked = static_cast<std::size_t>(stats.steps_marked);
  r.creates = end_counts.creates;
  r.maps = end_counts.maps;
  r.unmaps = end_counts.unmaps;
  const bool reached_late = passes > 1 ? pass + 1 >= passes : done >= half;  // pass: as far as it got
  r.late_device_calls = reached_late ? end_counts.total() - at_half.total() : 0;
  r.lag_us = options.lag_us;
  r.device_call_us = end_counts.call_us;
  r.host_wait_us = end_counts.wait_us;
  r.host_clock_us = device.host_time();
  r.stream_handovers = static_cast<std::uint64_t>(stats.num_stream_handovers);
  if (reached_late) {
    r.late_device_call_us = end_counts.call_us - at_half.call_us;
    r.late_host_wait_us = end_counts.wait_us - at_half.wait_us;
  }
  // Ops, mallocs and step ends replayed: `whole` passes of the first n ops, then `done` ops of
  // the pass that failed. The late part: the second half of one pass, or the last of several.
  const std::size_t whole = r.failed ? pass : passes;
  const std::size_t partial = r.failed ? done : 0;
  auto count = [&](std::size_t ops, std::size_t& mallocs, std::size_t& steps, std::size_t& late) {
    for (std::size_t i = 0; i < ops; ++i) mallocs += program.ops[i].malloc;
    if (ops == 0) return;
    const std::size_t last_event = program.ops[ops - 1].event;
    const std::size_t late_from = half < ops ? program.ops[half].event : last_event + 1;
    for (std::size_t end : options.step_ends) {
      if (end > last_event) break;
      ++steps;
      late += end >= late_from;
    }
  };
  std::size_t pass_mallocs = 0, pass_steps = 0, pass_late = 0;
  count(n, pass_mallocs, pass_steps, pass_late);
  std::size_t partial_mallocs = 0, partial_steps = 0, partial_late = 0;
  count(partial, partial_mallocs, partial_steps, partial_late);
  r.mallocs = pass_mallocs * whole + partial_mallocs;
  r.frees = (n - pass_mallocs) * whole + (partial - partial_mallocs);
  r.steps = pass_steps * whole + partial_steps;
  if (passes == 1) r.late_steps = r.failed ? partial_late : pass_late;
  else r.late_steps = r.failed ? (pass + 1 == passes ? partial_steps : 0) : pass_steps;
  const std::size_t ops_done = n * whole + partial;
  r.ns_per_op = ops_done ? static_cast<double>(engine_time.count()) / static_cast<double>(ops_done) : 0.0;
  return r;
}

}  // namespace

void check_trace(const Trace& trace) { (void)compile(trace); }

namespace {

// Whether `frame` ("file.py:42:function") names `what` ("file.py:42", "file.py", "42:function"):
// an occurrence not inside a longer name or number, so that train.py:42 is not train.py:420 nor
// mytrain.py:42.
bool frame_names(std::string_view frame, std::string_view what) {
  auto word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (std::size_t at = frame.find(what); at != std::string_view::npos; at = frame.find(what, at + 1)) {
    const std::size_t end = at + what.size();
    const bool starts = at == 0 || !word(what.front()) || !word(frame[at - 1]);
    const bool ends = end == frame.size() || !word(what.back()) || !word(frame[end]);
    if (starts && ends) return true;
  }
  return false;
}

}  // namespace

std::vector<std::size_t> step_ends_after_frame(const Trace& trace, std::string_view frame) {
  std::vector<bool> matches(trace.frames.size());
  for (std::size_t f = 1; f < trace.frames.size(); ++f)
    matches[f] = !frame.empty() && frame_names(trace.frames[f], frame);
  auto at = [&](std::size_t i) {
    return i < trace.events.size() && trace.events[i].user_frame < matches.size() && matches[trace.events[i].user_frame];
  };
  std::vector<std::size_t> ends;
  for (std::size_t i = 0; i < trace.events.size(); ++i)
    if (at(i) && !at(i + 1)) ends.push_back(i);
  return ends;
}

std::vector<std::size_t> step_ends_at_markers(const Trace& trace) {
  std::vector<std::size_t> ends;
  if (trace.steps_source != kGmemStepMarkers) return ends;
  std::size_t i = 0;  // the first event at or after the marker
  for (std::int64_t t : trace.steps_us) {
    while (i < trace.events.size() && trace.events[i].time_us < t) ++i;
    if (i > 0 && (ends.empty() || ends.back() != i - 1)) ends.push_back(i - 1);
  }
  return ends;
}

ReplayResult replay(const Trace& trace, const ReplayOptions& options) {
  return run(trace, compile(trace), options);
}

std::size_t min_capacity(const Trace& trace, double lag_us, std::size_t granularity,
                         const std::vector<std::size_t>& marked_step_ends,
                         const EngineOptions& engine) {
  granularity = std::max(granularity, engine.page_size);
  const Program program = compile(trace);
  if (program.peak_allocated == 0) return 0;
  // Every replay of the bisection runs as this one does, on a device of its own capacity.
  ReplayOptions roomy;
  roomy.engine = engine;
  roomy.lag_us = lag_us;
  roomy.step_ends = marked_step_ends;
  roomy.mark_steps = !marked_step_ends.empty();
  auto runs = [&](std::size_t capacity) {
    ReplayOptions options = roomy;
    options.capacity = capacity;
    return !run(trace, program, options).failed;
  };
  // The replay on a device as large as need be bounds the answer from above.
  roomy.capacity = std::max<std::size_t>(roomy.capacity, round_up(4 * program.peak_allocated, granularity));
  const ReplayResult unlimited = run(trace, program, roomy);
  if (unlimited.failed) return 0;
  std::size_t hi = round_up(std::max<std::uint64_t>(unlimited.peak_reserved, granularity), granularity);
  while (!runs(hi)) {
    if (hi >= roomy.capacity) return roomy.capacity;
    hi = std::min<std::size_t>(hi * 2, roomy.capacity);
  }
  // Below peak allocated nothing can run: lo always fails.
  std::size_t lo = (program.peak_allocated - 1) / granularity * granularity;
  while (hi - lo > granularity) {
    const std::size_t mid = lo + (hi - lo) / granularity / 2 * granularity;
    (runs(mid) ? hi : lo) = mid;
  }
  return hi;
}

}  // namespace gmem::trace
