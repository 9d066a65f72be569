// rebuild_history_window: the state a history that began mid-run started from, rebuilt from the
// frees of blocks it never allocated and from the snapshot's segments (what memory_viz does).
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <string>
#include <unordered_map>
#include <vector>

#include "gmem/error.hpp"
#include "gmem/trace.hpp"

namespace gmem::trace {

namespace {

std::string hex(std::uint64_t value) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(value));
  return buf;
}

// A trace time for people: snapshots' clocks are wall clocks (microseconds since the Unix epoch),
// shown as UTC; other clocks as seconds.
std::string when(std::int64_t us) {
  char buf[64];
  constexpr std::int64_t kYear2000Us = 946'684'800'000'000;
  if (us >= kYear2000Us) {
    const std::time_t t = static_cast<std::time_t>(us / 1'000'000);
    std::tm utc{};
    gmtime_r(&t, &utc);
    const std::size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &utc);
    std::snprintf(buf + n, sizeof buf - n, ".%03d UTC", static_cast<int>(us % 1'000'000 / 1000));
  } else {
    std::snprintf(buf, sizeof buf, "%.3f s", static_cast<double>(us) / 1e6);
  }
  return buf;
}

std::string duration(std::int64_t us) {
  char buf[48];
  if (us >= 1'000'000) std::snprintf(buf, sizeof buf, "%.3f s", static_cast<double>(us) / 1e6);
  else std::snprintf(buf, sizeof buf, "%.3f ms", static_cast<double>(us) / 1e3);
  return buf;
}

// What the history has shown of an address so far.
struct Seen {
  enum State : std::uint8_t { live, free_requested, freed } state = live;
  std::uint64_t size = 0;
  std::size_t line = 0;  // the alloc's (live) or the free's (freed)
};

// The frame string that names where a rebuilt block came from when nothing better is known.
constexpr const char* kBeforeHistory = "<allocated before the history>";

std::uint32_t intern(Trace& trace, const std::string& frame) {
  for (std::size_t i = trace.frames.size(); i-- > 1;)  // it was added last, if at all
    if (trace.frames[i] == frame) return static_cast<std::uint32_t>(i);
  trace.frames.push_back(frame);
  return static_cast<std::uint32_t>(trace.frames.size() - 1);
}

}  // namespace

std::string HistoryWindow::describe() const {
  if (!mid_run) return {};
  std::string line = "history began mid-run: " + std::to_string(events) + " events from " + when(start_us) +
                     " over " + duration(std::max<std::int64_t>(end_us - start_us, 0));
  if (dropped_events > 0) line += ", " + std::to_string(dropped_events) + " older ones dropped";
  line += "; " + format_bytes(bytes_at_start) + " in " + std::to_string(blocks_at_start) +
          " blocks already live at its start (older than the history, never counted as its leaks)";
  if (!has_segments)
    line += "; the file has no segments, so blocks live before it and never freed in it are missing";
  return line;
}

void rebuild_history_window(Trace& trace) {
  HistoryWindow& w = trace.window;
  w = HistoryWindow{.dropped_events = w.dropped_events};
  w.events = trace.events.size();
  w.has_segments = trace.has_segments;
  if (!trace.events.empty()) {
    w.start_us = trace.events.front().time_us;
    w.end_us = trace.events.back().time_us;
  }
  std::unordered_map<std::uint64_t, Seen> seen;
  seen.reserve(std::min<std::size_t>(trace.events.size(), std::size_t{1} << 20));
  std::vector<Event> rebuilt;
  // A block freed before the history allocated it: live when the history began.
  auto rebuild_from_free = [&](const Event& e) {
    if (e.size == 0)
      throw BadInputError(trace.path, e.line,
                          std::string(action_name(e.action)) + " of " + hex(e.addr) +
                              ", which the history never allocated, and of size 0: the size of a block "
                              "live before the history began cannot be known");
    Event alloc;
    alloc.action = Action::alloc;
    alloc.before_history = true;
    alloc.addr = e.addr;
    alloc.size = e.size;
    alloc.stream = e.stream;
    alloc.scope = e.scope;  // gmem's frees carry the allocation's scope
    alloc.line = e.line;
    rebuilt.push_back(alloc);
    ++w.freed_in_history;
  };
  for (const Event& e : trace.events) {
    switch (e.action) {
      case Action::alloc: {
        auto [it, fresh] = seen.try_emplace(e.addr, Seen{Seen::live, e.size, e.line});
        if (!fresh && it->second.state == Seen::freed) it->second = Seen{Seen::live, e.size, e.line};
        // An alloc over a live block is replay's to refuse (check_trace), with its own message.
        break;
      }
      case Action::free_requested:
      case Action::free_completed: {
        const bool completes = e.action == Action::free_completed;
        auto [it, fresh] = seen.try_emplace(e.addr);
        Seen& s = it->second;
        if (fresh) {
          rebuild_from_free(e);
          s = Seen{completes ? Seen::freed : Seen::free_requested, e.size, e.line};
        } else if (s.state == Seen::freed) {
          throw BadInputError(trace.path, e.line,
                              std::string(action_name(e.action)) + " of " + hex(e.addr) +
                                  ", which is not live: line " + std::to_string(s.line) +
                                  " freed it and nothing allocated it since (a double free)");
        } else if (completes) {
          s = Seen{Seen::freed, s.size, e.line};
        } else {
          s.state = Seen::free_requested;  // live until its free completes
        }
        break;
      }
      default:
        break;
    }
  }
  // The segments close the state: each block live at the dump is live at the history's end.
  if (trace.has_segments) {
    for (const DumpedBlock& b : trace.dumped_blocks) {
      if (b.size == 0)
        throw BadInputError(trace.path, 0, "the snapshot's segments hold a live block of 0 bytes at " + hex(b.addr));
      auto it = seen.find(b.addr);
      if (it == seen.end()) {
        Event alloc;
        alloc.action = Action::alloc;
        alloc.before_history = true;
        alloc.addr = b.addr;
        alloc.size = b.size;
        alloc.stream = b.stream;
        alloc.user_frame = b.user_frame;
        alloc.lib_frame = b.lib_frame;
        alloc.scope = b.scope;
        rebuilt.push_back(alloc);
        seen.emplace(b.addr, Seen{Seen::live, b.size, 0});
        continue;
      }
      const Seen& s = it->second;
      if (s.state == Seen::freed)
        throw BadInputError(trace.path, s.line,
                            "the snapshot's segments hold a live block of " + std::to_string(b.size) + " bytes at " +
                                hex(b.addr) + ", which this line freed and no later event allocated");
      if (s.size != b.size)
        throw BadInputError(trace.path, s.line,
                            "block at " + hex(b.addr) + " of " + std::to_string(s.size) +
                                " bytes, but the snapshot's segments hold " + std::to_string(b.size) +
                                " bytes there");
    }
  }
  trace.dumped_blocks.clear();
  trace.dumped_blocks.shrink_to_fit();
  w.mid_run = !rebuilt.empty() || w.dropped_events > 0;
  if (rebuilt.empty()) return;
  // Where a rebuilt block was allocated is unknown unless the segments said (or a free its scope).
  std::uint32_t before_frame = 0;
  for (Event& e : rebuilt) {
    if (e.user_frame != 0 || e.lib_frame != 0 || e.scope != 0) continue;
    if (before_frame == 0) before_frame = intern(trace, kBeforeHistory);
    e.user_frame = before_frame;
  }
  std::sort(rebuilt.begin(), rebuilt.end(), [](const Event& a, const Event& b) { return a.addr < b.addr; });
  for (Event& e : rebuilt) {
    e.time_us = w.start_us;
    w.bytes_at_start += e.size;
  }
  w.blocks_at_start = rebuilt.size();
  trace.events.insert(trace.events.begin(), rebuilt.begin(), rebuilt.end());
}

}  // namespace gmem::trace
