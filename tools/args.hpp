// Helpers for parsing command line arguments, shared by the gmem subcommands.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "common/byte_count.hpp"
#include "gmem/trace.hpp"

namespace gmem::cli {

// Wrong arguments: main prints "gmem: <message>" and exits 1.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "80G", "1.5GiB", "512M", "64k", "4096": binary units (K = 1024), case-insensitive.
inline std::uint64_t parse_bytes(std::string_view text) {
  if (const auto bytes = parse_byte_count(text)) return *bytes;
  throw UsageError("bad byte count '" + std::string(text) + "' (expected e.g. 80G, 512M or 1048576)");
}

// Takes the value of an option such as `--capacity 80G` (args[i] is the option).
inline const std::string& option_value(const std::vector<std::string>& args, std::size_t& i) {
  if (i + 1 >= args.size()) throw UsageError("option " + args[i] + " needs a value");
  return args[++i];
}

// A count such as `--max-events 1000000`: digits only, at least 1.
inline std::size_t parse_count(const std::string& option, const std::string& text) {
  std::size_t n = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc{} || end != text.data() + text.size() || text.empty() || n == 0)
    throw UsageError(option + " takes a count of 1 or more, not '" + text + "'");
  return n;
}

// The options bounding what reading a trace may cost (trace::ReadLimits), for every command
// that reads traces. Consumes args[i] (and its value) and returns true when it is one of them.
inline bool parse_read_limit(const std::vector<std::string>& args, std::size_t& i, trace::ReadLimits& limits) {
  const std::string& a = args[i];
  if (a == "--max-bytes") {
    limits.max_bytes = parse_bytes(option_value(args, i));
    if (limits.max_bytes == 0) throw UsageError("--max-bytes must be more than 0");
  } else if (a == "--max-line") {
    const std::uint64_t bytes = parse_bytes(option_value(args, i));
    if (bytes == 0) throw UsageError("--max-line must be more than 0");
    limits.max_line = static_cast<std::size_t>(bytes);
  } else if (a == "--max-fields") {
    limits.max_fields = parse_count(a, option_value(args, i));
  } else if (a == "--max-events") {
    limits.max_events = parse_count(a, option_value(args, i));
  } else if (a == "--max-frames") {
    limits.max_frames = parse_count(a, option_value(args, i));
  } else if (a == "--max-memo-refs") {
    limits.max_memo_refs = parse_count(a, option_value(args, i));
  } else if (a == "--max-objects") {
    limits.max_objects = parse_count(a, option_value(args, i));
  } else {
    return false;
  }
  return true;
}

// What standard input is called in messages and reports, for the FILE argument "-".
inline constexpr const char kStdinName[] = "<stdin>";

// A FILE argument of a command that reads traces: a path, or "-" for standard input (once: it
// holds one trace).
inline void add_trace_argument(std::vector<std::string>& files, const std::string& arg) {
  if (arg == "-" && std::find(files.begin(), files.end(), arg) != files.end())
    throw UsageError("- (standard input) given twice: it holds one trace");
  files.push_back(arg);
}

// Reads the trace a FILE argument names; "-" reads standard input to its end, named "<stdin>" in
// errors, its format found from its content, within the same `limits` as a file.
inline trace::Trace read_trace_argument(const std::string& file, const trace::ReadLimits& limits) {
  if (file == "-") return trace::read_trace_stream(stdin, kStdinName, limits);
  return trace::read_trace(file, limits);
}

// A trace with no allocation events of its own: says on stderr what was read and why there is nothing in it
// (a snapshot taken without a recorded history, most often) and how to record one, and returns
// true; the command skips it and exits 1. An empty table, "0 events" or "No leaks found" would
// read as a clean bill of health. `what`: what the command would have done ("replay").
// Whether `e` was rebuilt from a snapshot's segments rather than read from its history (blocks
// live before a wrapped history began, Event::before_history, being added to the trace reader
// alongside this; written so as to compile with or without that field).
template <class E>
bool rebuilt_from_segments(const E& e) {
  if constexpr (requires { e.before_history; }) return e.before_history;
  else return false;
}

inline bool report_empty_trace(const trace::Trace& t, const std::string& file, const trace::ReadLimits& limits,
                               const char* what) {
  if (!std::all_of(t.events.begin(), t.events.end(), [](const auto& e) { return rebuilt_from_segments(e); }))
    return false;
  // A pickle begins with its protocol opcode (0x80); a file is read again only in this rare case,
  // standard input cannot be, and its message then names both kinds.
  bool snapshot = false;
  if (file != "-") {
    try {
      const std::string bytes = trace::read_file_maybe_gzip(file, limits);
      snapshot = !bytes.empty() && static_cast<unsigned char>(bytes[0]) == 0x80;
    } catch (const std::exception&) {
    }
  }
  if (file != "-" && !snapshot) {  // a CSV trace or RMM log with a header and no rows
    std::fprintf(stderr, "gmem: %s: no allocation events in the trace, so there is nothing to %s.\n",
                 t.path.c_str(), what);
    return true;
  }
  std::fprintf(stderr, "gmem: %s: %s, so there is nothing to %s.\n", t.path.c_str(),
               snapshot ? "the snapshot has no allocation history (its device_traces hold no alloc or "
                          "free events: it was taken without _record_memory_history)"
                        : "no allocation events in the trace (a snapshot taken without "
                          "_record_memory_history has none)",
               what);
  std::fputs("  PyTorch records the events only once asked to, before the steps to look at:\n"
             "    torch.cuda.memory._record_memory_history(max_entries=100000)\n"
             "    ...  # the steps\n"
             "    torch.cuda.memory._dump_snapshot(\"snapshot.pickle\")\n"
             "  With gmem as the allocator: gmem.enable_tracking(), the steps, then "
             "gmem.dump_snapshot(\"snapshot.pickle\").\n",
             stderr);
  return true;
}

}  // namespace gmem::cli

// The end of the synopsis of every command that reads traces (its usage's first line names the
// command and its own options): the options parse_read_limit takes, then the files. Macros so
// that they join each command's usage string literal; lines indented under "gmem".
#define GMEM_CLI_USAGE_INDENT "       "
#define GMEM_CLI_READ_LIMITS_SYNOPSIS                                                          \
  "\n" GMEM_CLI_USAGE_INDENT "[--max-bytes BYTES] [--max-line BYTES] [--max-fields N] [--max-events N]" \
  "\n" GMEM_CLI_USAGE_INDENT "[--max-frames N] [--max-memo-refs N] [--max-objects N]"               \
  "\n" GMEM_CLI_USAGE_INDENT "FILE...   (a FILE of - reads the trace from standard input)\n"

// The usage text of the options parse_read_limit takes; defaults as in trace::ReadLimits.
// A macro so that it joins each command's usage string literal.
#define GMEM_CLI_READ_LIMITS_USAGE                                                                \
  "\n"                                                                                            \
  "Bounds on reading a trace (a file over one stops with \"FILE: exceeds ... (set with OPTION)\";\n" \
  "standard input, -, is read within the same bounds and named <stdin>):\n"                     \
  "  --max-bytes BYTES  file size, and content once gunzipped (default 1G)\n"                    \
  "  --max-line BYTES   bytes in one CSV line (default 1M)\n"                                     \
  "  --max-fields N     fields in one CSV line (default 1024)\n"                                  \
  "  --max-events N     events in a trace (default 10000000)\n"                                   \
  "  --max-frames N     frames in one stack of a snapshot pickle (default 10000)\n"               \
  "  --max-memo-refs N  repeated references to one event, event list or stack in a snapshot\n"   \
  "                     pickle (default 1000000)\n"                                               \
  "  --max-objects N    values a pickle builds (default 100000000)\n"
