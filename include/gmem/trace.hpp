// Allocation traces: PyTorch's (CSV from torch.cuda.memory._snapshot(), gzip or plain; snapshot
// pickles) and RMM's CSV logs, read into one event list.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace gmem::trace {

enum class Action : std::uint8_t {
  alloc,
  free_requested,
  free_completed,
  segment_alloc,
  segment_free,
  oom,
};
const char* action_name(Action action) noexcept;

struct Event {
  Action action = Action::alloc;
  // An alloc put at the front of the events by rebuild_history_window(): a block already live
  // when the file's history began (allocated before its oldest event).
  bool before_history = false;
  std::uint32_t scope = 0;       // index into Trace::frames of the gmem scope ("model.1"; 0 = none)
  std::uint64_t addr = 0;
  std::uint64_t size = 0;
  std::uint64_t stream = 0;
  std::int64_t time_us = 0;
  std::uint32_t user_frame = 0;  // index into Trace::frames (0 = none)
  std::uint32_t lib_frame = 0;
  std::size_t line = 0;          // line (or record) in the source file, for error messages
};

// A block live when a snapshot was taken, from its segments (state active_allocated or
// active_pending_free): what closes the state of a history that began mid-run.
struct DumpedBlock {
  std::uint64_t addr = 0;
  std::uint64_t size = 0;
  std::uint64_t stream = 0;
  std::uint32_t user_frame = 0;  // where it was allocated, when the snapshot says (index into Trace::frames)
  std::uint32_t lib_frame = 0;
  std::uint32_t scope = 0;
};

// Where the file's history begins. A snapshot's history is a ring of the last N events (gmem's
// tracking history, PyTorch's _record_memory_history(max_entries=N)); once it wraps, the file
// begins mid-run, with blocks already live that no event in it allocated. Those are rebuilt
// (rebuild_history_window) as allocs put at the front of Trace::events, flagged before_history:
// - a block freed in the history but never allocated in it before: live at the start; its size
//   is the free's;
// - a block live in the snapshot's segments that the history never touched: live since before the
//   history, to the end.
struct HistoryWindow {
  bool mid_run = false;            // the history began after the program had allocated
  std::size_t events = 0;          // events in the file (the rebuilt allocs not counted)
  std::int64_t start_us = 0;       // the first of them
  std::int64_t end_us = 0;         // the last
  std::size_t blocks_at_start = 0;   // rebuilt allocs at the front of Trace::events
  std::uint64_t bytes_at_start = 0;  // their bytes
  std::size_t freed_in_history = 0;  // of those, freed by an event of the history
  // The file's segments were read: blocks live before the history and never freed in it are
  // known. Without them (CSV traces, pickles without 'segments') they are not, and are missing.
  bool has_segments = false;
  // Events the file says its ring dropped (gmem's snapshots: 'gmem_history'); -1 when it says nothing.
  std::int64_t dropped_events = -1;

  // One line for people: "history began mid-run: 16384 events from 2026-11-23 10:01:02.345 UTC
  // over 3.210 s; 1.20 GiB in 34 blocks already live at its start (...)" ("" when not mid_run).
  std::string describe() const;
};

// Trace::steps_source of a snapshot whose step markers are gmem's own (gmem.step(), or
// gmem.torch watching the optimizer).
inline constexpr std::string_view kGmemStepMarkers = "gmem.step() markers";

struct Trace {
  std::string path;                 // as given
  std::string name;                 // file name without directories and extensions
  std::vector<Event> events;
  std::vector<std::string> frames;  // interned frame strings; frames[0] == ""
  // Step markers, when the file has them (snapshot pickles: gmem's gmem.step() markers, or the
  // START of a recurring PyTorch annotation), as times; ascending.
  std::vector<std::int64_t> steps_us;
  std::string steps_source;  // where they came from (kGmemStepMarkers, ...); "" when none
  // Graph tracking, from gmem's snapshots ('gmem_graphs'): the blocks live at the end that hold
  // tensors saved for a backward pass not yet run, and whether the program ran backward at all.
  std::vector<std::uint64_t> saved_for_backward;
  bool backward_runs = false;
  // Snapshot pickles: the live blocks of the segments at dump time (read_trace consumes them into
  // `window`, then clears them).
  std::vector<DumpedBlock> dumped_blocks;
  bool has_segments = false;
  HistoryWindow window;
};

// Rebuilds the blocks live when `trace`'s history began (HistoryWindow), from frees of blocks the
// history never allocated and from `trace.dumped_blocks`, and puts them at the front of its
// events; fills trace.window. read_trace calls it; call it on a Trace made by other means before
// replaying one that may begin mid-run. Throws BadInputError naming file and line for a history
// that no earlier state explains: a double free inside it, a free of unknown size of a block it
// never allocated, or a block whose size (or liveness) contradicts the segments.
void rebuild_history_window(Trace& trace);

// Bounds on what reading one trace may cost, so that a hostile or broken file (a gzip bomb, a
// line of a billion commas, a pickle that refers to one object a billion times) stops with an
// error in bounded time and memory instead of exhausting the machine. The defaults fit the
// largest real traces (~200k events, tens of MB inflated) with room to spare. Going over one
// throws BadInputError "FILE: exceeds LIMIT (set with --max-...)"; the CLI option is named.
struct ReadLimits {
  // Bytes of the file, and of its content once gunzipped (inflation stops at the limit).
  std::uint64_t max_bytes = std::uint64_t{1} << 30;  // 1 GiB (--max-bytes)
  // Bytes in one CSV record (a quoted field may span lines) and the header line.
  std::size_t max_line = std::size_t{1} << 20;       // 1 MiB (--max-line)
  // Fields in one CSV record: traces have 6 or 7.
  std::size_t max_fields = 1024;                     // (--max-fields)
  // Events in the trace (48 bytes each in memory).
  std::size_t max_events = 10'000'000;               // (--max-events)
  // Frames in one stack of a snapshot pickle (Python's recursion limit is 1000).
  std::size_t max_frames = 10'000;                   // (--max-frames)
  // Times a snapshot pickle's events reach an object they reached already (the same event dict,
  // event list or frames list again, through the pickle's memo): real snapshots share frames,
  // never events, so this bounds how far a small pickle can be multiplied.
  std::size_t max_memo_refs = 1'000'000;             // (--max-memo-refs)
  // Values a pickle builds (strings, numbers, containers, references pushed on its stack).
  std::size_t max_objects = 100'000'000;             // (--max-objects)
};

// Reads a trace, detecting its format from its content: PyTorch trace CSV (gzip or plain),
// PyTorch snapshot pickle, or RMM CSV log, and rebuilds what was live when its history began
// (rebuild_history_window). Throws BadInputError naming file and line, also when the file goes
// over one of `limits`.
Trace read_trace(const std::string& path, const ReadLimits& limits = {});

// Reads a whole file, gunzipping when it is gzip, up to limits.max_bytes. Throws BadInputError
// (truncated gzip, I/O, too large).
std::string read_file_maybe_gzip(const std::string& path, const ReadLimits& limits = {});

// read_trace on an open stream, read to its end: standard input for `gmem replay -`. There is no
// file name, so the format is detected from the content alone (gzip magic, pickle protocol, CSV
// header); `name` (e.g. "<stdin>") names it in errors and in Trace::path. Reading stops with
// BadInputError once the stream passes limits.max_bytes, so an endless stream costs bounded
// memory; the stream is not closed.
Trace read_trace_stream(std::FILE* stream, const std::string& name, const ReadLimits& limits = {});

// read_trace on a file's bytes already in memory (gzip or not); `path` names it in errors.
Trace read_trace_bytes(std::string_view bytes, const std::string& path, const ReadLimits& limits = {});

}  // namespace gmem::trace
