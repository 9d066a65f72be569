// Allocation traces: PyTorch's (CSV from torch.cuda.memory._snapshot(), gzip or plain; snapshot
// pickles) and RMM's CSV logs, read into one event list.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
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
  std::uint64_t addr = 0;
  std::uint64_t size = 0;
  std::uint64_t stream = 0;
  std::int64_t time_us = 0;
  std::uint32_t user_frame = 0;  // index into Trace::frames (0 = none)
  std::uint32_t lib_frame = 0;
  std::size_t line = 0;          // line (or record) in the source file, for error messages
};

struct Trace {
  std::string path;                 // as given
  std::string name;                 // file name without directories and extensions
  std::vector<Event> events;
  std::vector<std::string> frames;  // interned frame strings; frames[0] == ""
};

// Reads a trace, detecting its format from its content: PyTorch trace CSV (gzip or plain),
// PyTorch snapshot pickle, or RMM CSV log. Throws BadInputError naming file and line.
Trace read_trace(const std::string& path);

// Reads a whole file, gunzipping when it is gzip. Throws BadInputError (truncated gzip, I/O).
std::string read_file_maybe_gzip(const std::string& path);

}  // namespace gmem::trace
