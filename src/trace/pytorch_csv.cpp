// PyTorch trace CSV: one event a line, columns found by their header names.
#include <algorithm>
#include <string>

#include "gmem/error.hpp"
#include "trace/csv.hpp"
#include "trace/formats.hpp"
#include "trace/frame_table.hpp"

namespace gmem::trace::detail {

void read_pytorch_csv(std::string_view text, Trace& trace, const ReadLimits& limits) {
  CsvReader csv(text, trace.path, limits.max_line, limits.max_fields);
  if (!csv.next()) throw BadInputError(trace.path, 1, "empty trace: no header line");
  const std::size_t action = csv.column("action");
  const std::size_t addr = csv.column("addr");
  const std::size_t size = csv.column("size");
  const std::size_t stream = csv.column("stream");
  const std::size_t time_us = csv.column("time_us");
  const std::size_t user_frame = csv.column("user_frame");
  const std::size_t lib_frame = csv.column("lib_frame");
  const std::size_t needed = std::max({action, addr, size, stream, time_us, user_frame, lib_frame}) + 1;

  FrameTable frames(trace.frames);
  reserve_events(trace, text.size(), limits);
  while (csv.next()) {
    check_event_count(trace, csv.line(), limits);
    csv.require_fields(needed);
    Event e;
    const std::optional<Action> a = parse_action(csv[action]);
    if (!a)
      throw BadInputError(trace.path, csv.line(), "unknown action '" + std::string(csv[action]) + "'");
    e.action = *a;
    e.addr = parse_u64(csv[addr], csv, "addr");
    e.size = parse_u64(csv[size], csv, "size");
    e.stream = parse_u64(csv[stream], csv, "stream");
    e.time_us = parse_i64(csv[time_us], csv, "time_us");
    e.user_frame = frames.intern(csv[user_frame]);
    e.lib_frame = frames.intern(csv[lib_frame]);
    e.line = csv.line();
    trace.events.push_back(e);
  }
}

}  // namespace gmem::trace::detail
