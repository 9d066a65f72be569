// RMM's logging_resource_adaptor CSV log:
//   Thread,Time,Action,Pointer,Size,Stream
//   140573312345856,08:07:59.123456,allocate,0x7f8a40000000,1024,0x7f8a38001020
// Time is a wall clock time of day (older RMM) or seconds since the epoch (newer); pointers and
// streams are hex. An RMM free is immediate, so it becomes a free_completed.
#include <algorithm>
#include <charconv>
#include <cstdint>
#include <string>

#include "gmem/error.hpp"
#include "trace/csv.hpp"
#include "trace/formats.hpp"

namespace gmem::trace::detail {

namespace {
std::optional<Action> rmm_action(std::string_view name) {
  if (name == "allocate") return Action::alloc;
  if (name == "free" || name == "deallocate") return Action::free_completed;
  if (name == "allocate failure") return Action::oom;
  return std::nullopt;
}

// The most seconds whose microseconds, plus a fraction below 1 s, fit in an int64_t.
constexpr std::int64_t kMaxSeconds = INT64_MAX / 1'000'000 - 1;

// "HH:MM:SS.ffffff" or "1634567890.234567" (seconds), as microseconds.
std::int64_t parse_time_us(std::string_view text, const CsvReader& csv) {
  auto bad = [&] {
    return BadInputError(csv.file(), csv.line(), "bad time in column 'Time': '" + std::string(text) + "'");
  };
  auto out_of_range = [&] {
    return BadInputError(csv.file(), csv.line(),
                         "time out of range in column 'Time': '" + std::string(text) +
                             "' (microseconds must fit in 64 bits)");
  };
  std::int64_t seconds = 0;
  std::string_view rest = text;
  for (int part = 0;; ++part) {  // up to three ':'-separated parts, base 60
    std::int64_t value = 0;
    auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), value);
    if (ec == std::errc::result_out_of_range) throw out_of_range();
    if (ec != std::errc{} || end == rest.data() || value < 0) throw bad();
    if (value > kMaxSeconds || seconds > (kMaxSeconds - value) / 60) throw out_of_range();
    seconds = seconds * 60 + value;
    rest.remove_prefix(static_cast<std::size_t>(end - rest.data()));
    if (rest.empty() || rest.front() != ':') break;
    if (part == 2) throw bad();
    rest.remove_prefix(1);
  }
  std::int64_t micros = 0;
  if (!rest.empty()) {
    if (rest.front() != '.') throw bad();
    rest.remove_prefix(1);
    int digits = 0;
    for (char c : rest) {
      if (c < '0' || c > '9') throw bad();
      if (digits++ < 6) micros = micros * 10 + (c - '0');
    }
    for (; digits < 6; ++digits) micros *= 10;
  }
  return seconds * 1'000'000 + micros;
}
}  // namespace

void read_rmm_csv(std::string_view text, Trace& trace, const ReadLimits& limits) {
  CsvReader csv(text, trace.path, limits.max_line, limits.max_fields);
  if (!csv.next()) throw BadInputError(trace.path, 1, "empty log: no header line");
  const std::size_t time = csv.column("Time");
  const std::size_t action = csv.column("Action");
  const std::size_t pointer = csv.column("Pointer");
  const std::size_t size = csv.column("Size");
  const std::size_t stream = csv.column("Stream");
  const std::size_t needed = std::max({time, action, pointer, size, stream}) + 1;

  reserve_events(trace, text.size(), limits);
  while (csv.next()) {
    check_event_count(trace, csv.line(), limits);
    csv.require_fields(needed);
    Event e;
    const std::optional<Action> a = rmm_action(csv[action]);
    if (!a)
      throw BadInputError(trace.path, csv.line(), "unknown action '" + std::string(csv[action]) + "'");
    e.action = *a;
    e.addr = parse_hex(csv[pointer], csv, "Pointer");
    e.size = parse_u64(csv[size], csv, "Size");
    e.stream = parse_hex(csv[stream], csv, "Stream");
    e.time_us = parse_time_us(csv[time], csv);
    e.line = csv.line();
    trace.events.push_back(e);
  }
}

}  // namespace gmem::trace::detail
