// In-process tracking: who holds device memory, and what happened to it lately.
//
//   Tracker: opt-in, attached to one Engine. Keeps, for every live allocation, its id, size,
//   stream, time, step, scope and call site, and a bounded history of events (alloc, free, map,
//   unmap, oom, step, annotation). Cheap enough to leave on while training: the engine records
//   into its own block records and an event ring under the lock it holds anyway (see
//   src/tracking/tracking_log.hpp), adding a few stores to a malloc+free.
//
//   Call sites: each thread has a "current frames" value the Python layer sets (its Python stack),
//   or, with capture_backtrace, the tracker takes a C++ backtrace per allocation (slow: ~1 us).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/leaks.hpp"
#include "gmem/scope.hpp"

namespace gmem {

// --- call sites ----------------------------------------------------------------------------------

struct Frame {
  std::string filename;
  int line = 0;
  std::string name;  // function
};

using FramesId = std::uint32_t;  // an interned stack of frames; 0: none

namespace frames {

// Interns a stack given as "file:line:function" lines, innermost first ("" gives 0). A line not in
// that form becomes a frame with only a name.
FramesId intern(std::string_view text);
// Sets this thread's call site for the allocations it makes from now on ("" clears it).
void set_current(std::string_view text);
void set_current(FramesId id) noexcept;
FramesId current() noexcept;
// The C++ call stack here, skipping `skip` innermost frames; symbolised only when read.
FramesId capture_backtrace(int skip = 0, int depth = 32);
// The calling thread's Python stack, innermost first (0 in a process without Python, on a
// thread Python never ran on, while the interpreter shuts down, or when the thread has frames
// set: those are the program's choice). Takes the GIL for the walk.
FramesId capture_python(int skip = 0, int depth = 32);
// Python files under `prefix` (gmem's own package) are left out of captured stacks.
void skip_python_files(std::string_view prefix);
// Whether this process runs a Python interpreter capture_python can read.
bool python_available();
// The frames of `id`, innermost first (empty for 0 or an unknown id).
std::vector<Frame> get(FramesId id);
// "file:line:function" lines, innermost first.
std::string to_text(FramesId id);

}  // namespace frames

// --- the tracker ---------------------------------------------------------------------------------

struct TrackerOptions {
  static constexpr std::size_t kEventBytes = 56;  // host memory per history event
  // Events kept, oldest dropped first; 0 keeps none. An allocation makes two (alloc, free): the
  // default (7 MiB) holds ~13 training steps of a Llama-style model (~9,400 events a step, the
  // heaviest of tests/data) and ~40 of GPT-2 (~3,000), enough steps for leak detection over a
  // wrapped history (docs/wrapped-histories.md). A ring larger than the CPU's L2 cache costs the
  // hot path cache misses (+10 to +22% on a 53 ns malloc+free pair at 100k events on a Xeon,
  // none measurable on an EPYC: docs/diagnostics.md), a few ns a pair.
  std::size_t history_capacity = 131'072;
  bool capture_backtrace = false;          // a C++ backtrace per allocation instead of the
                                           // thread's current frames
  int backtrace_depth = 32;
  bool capture_python = false;             // the allocating thread's Python stack (where it has
                                           // one; else the thread's current frames)
};

enum class EventKind : std::uint8_t { alloc, free, map, unmap, oom, step, annotation };
const char* event_kind_name(EventKind kind) noexcept;  // "alloc", "free", ...

struct LiveAllocation {
  std::uintptr_t addr = 0;
  std::uint64_t id = 0;         // 1, 2, ... in allocation order, per tracker
  std::size_t size = 0;         // as handed out (rounded)
  std::size_t requested = 0;    // as asked for
  StreamId stream = 0;
  std::int64_t time_ns = 0;     // wall clock, ns since the Unix epoch; read every 64 mallocs
                                // (and at steps and maps), so exact to within those
  std::uint64_t step = 0;       // the tracker's step counter when allocated
  ScopeId scope = 0;
  FramesId frames = 0;
  bool saved_for_backward = false;  // holds a tensor saved for a backward pass not yet run
};

struct HistoryEvent {
  EventKind kind = EventKind::alloc;
  std::uintptr_t addr = 0;      // alloc, free, map, unmap; 0 otherwise
  std::size_t size = 0;         // the block (alloc, free), the range (map, unmap), the request (oom)
  StreamId stream = 0;
  std::int64_t time_ns = 0;     // wall clock, ns since the Unix epoch
  std::uint64_t step = 0;       // step counter at the event (for `step`: the new step)
  ScopeId scope = 0;            // alloc, free: the allocation's scope; oom: the failing thread's
  FramesId frames = 0;          // where it happened (for free: where the free was called)
  std::uint64_t id = 0;         // alloc, free: the allocation id
  std::string text;             // annotation: its text; oom: the reason ("limit", "device")
  std::size_t device_free = 0;  // oom: the device's free memory
};

// A consistent copy of a tracker's state, taken under its lock.
struct TrackerState {
  std::vector<LiveAllocation> live;                          // by address
  std::vector<HistoryEvent> history;                         // oldest first
  std::vector<std::pair<std::uintptr_t, std::size_t>> mapped;  // the engine's mapped ranges, by address
  std::uint64_t step = 0;
  std::uint64_t allocations = 0;     // allocations tracked so far
  std::uint64_t dropped_events = 0;  // history events overwritten by newer ones
  std::size_t history_capacity = 0;  // events the history keeps (TrackerOptions::history_capacity)
  std::uint64_t untracked_frees = 0; // frees of blocks allocated before tracking began
  bool backward_runs = false;        // note_backward() was called: the program runs backward
  std::optional<OomInfo> last_oom;
};

// Live bytes grouped by a key (a scope path or a call site), largest first.
struct UsageGroup {
  std::string key;
  std::size_t bytes = 0;
  std::size_t count = 0;
};

class Tracker final {
 public:
  // Starts tracking `engine`'s allocations from now on; blocks already live are not tracked.
  // The engine must outlive the tracker. Throws Error(invalid_argument) when another tracker is
  // attached to it.
  explicit Tracker(Engine& engine, TrackerOptions options = {});
  ~Tracker();  // detaches
  Tracker(const Tracker&) = delete;
  Tracker& operator=(const Tracker&) = delete;

  // Stops tracking. The history stays readable; no allocation is live any more to the tracker.
  void detach();
  // A training step ends: the step counter advances and leak detection takes its sample.
  void step();
  void annotate(std::string_view text);
  // Autograd graphs (PyTorch's saved-tensor hooks call these): the block at `addr` holds a tensor
  // saved for a backward pass (`saved`), or that backward has used it (!saved). Returns false when
  // `addr` is not the start of a live tracked block (it was allocated before tracking, or by
  // another allocator); nothing changes then. A block saved and still live steps later is
  // reported by leak detection as a graph kept alive (LeakFinding::graph_bytes).
  bool mark_saved(std::uintptr_t addr, bool saved);
  // A backward pass ran (the first unpack of a saved tensor): graphs kept alive are then values
  // kept with their graph (a loss in a list), not inference run without no_grad.
  void note_backward();

  Engine& engine() const noexcept;
  const TrackerOptions& options() const noexcept;
  std::uint64_t current_step() const;
  std::size_t live_count() const;
  std::size_t live_bytes() const;
  TrackerState state() const;
  std::optional<OomInfo> last_oom() const;
  // Live memory by scope path ("<no scope>" for none) and by call site (the innermost frame,
  // "<unknown>" for none), largest first, at most `limit` groups.
  std::vector<UsageGroup> usage_by_scope(std::size_t limit = 20) const;
  std::vector<UsageGroup> usage_by_site(std::size_t limit = 20) const;
  // Sites whose surviving memory grows step after step (needs step() to be called each step).
  std::vector<LeakFinding> leak_suspects() const;
  // When tracking began, on the clock of LeakFinding's times (wall clock, microseconds).
  std::int64_t started_us() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// The site of an allocation as people read it: its innermost frame of the program's own Python
// code ("train.py:42:forward", not torch's or an installed package's), else its innermost frame,
// else its scope path, else "<unknown>".
std::string site_of(ScopeId scope, FramesId frames);

}  // namespace gmem
