// The rebuild of a history that began mid-run (rebuild_history_window) on any sequence of allocs,
// frees and blocks live at the dump. It must either refuse with BadInputError naming the file, or
// leave a trace in which every free finds its block live, whose rebuilt allocs are what the window
// says, and whose end state holds every block of the segments with its size.
#include <unordered_map>

#include "fuzz_limits.hpp"
#include "trace/replay.hpp"

namespace {

using gmem::trace::Action;
using gmem::trace::Event;

// Three bytes a record: kind, address (32 slots of 4 KiB), size (0..7 x 512 B; 0 is bad input).
gmem::trace::Trace decode(const std::uint8_t* data, std::size_t size) {
  gmem::trace::Trace t;
  t.path = "fuzz";
  t.frames.emplace_back();
  if (size == 0) return t;
  t.has_segments = (data[0] & 1) != 0;
  for (std::size_t i = 1; i + 3 <= size && t.events.size() < 4096; i += 3) {
    const std::uint64_t addr = 4096 * (1 + data[i + 1] % 32);
    const std::uint64_t bytes = 512 * (data[i + 2] % 8);
    switch (data[i] % 4) {
      case 3:
        t.dumped_blocks.push_back({addr, bytes, 0});
        break;
      default: {
        Event e;
        e.action = data[i] % 4 == 0 ? Action::alloc : data[i] % 4 == 1 ? Action::free_requested : Action::free_completed;
        e.addr = addr;
        e.size = bytes;
        e.time_us = static_cast<std::int64_t>(i);
        e.line = t.events.size() + 1;
        t.events.push_back(e);
      }
    }
  }
  return t;
}

void check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  gmem::trace::Trace t = decode(data, size);
  const std::vector<Event> file_events = t.events;
  const std::vector<gmem::trace::DumpedBlock> dumped = t.dumped_blocks;
  try {
    gmem::trace::rebuild_history_window(t);
  } catch (const gmem::BadInputError& e) {
    check(e.file() == "fuzz");
    return 0;
  }
  // The rebuilt allocs are at the front, as the window counts them; the file's events follow, unchanged.
  const gmem::trace::HistoryWindow& w = t.window;
  check(t.events.size() == file_events.size() + w.blocks_at_start);
  std::uint64_t bytes = 0;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const Event& e = t.events[i];
    check(e.before_history == (i < w.blocks_at_start));
    if (e.before_history) {
      check(e.action == Action::alloc && e.size > 0);
      bytes += e.size;
    } else {
      const Event& f = file_events[i - w.blocks_at_start];
      check(e.action == f.action && e.addr == f.addr && e.size == f.size && e.line == f.line);
    }
  }
  check(bytes == w.bytes_at_start && w.mid_run == (w.blocks_at_start > 0));
  // What replay still refuses is an alloc over a live block; never a free of a block not live.
  try {
    gmem::trace::check_trace(t);
  } catch (const gmem::BadInputError& e) {
    check(e.file() == "fuzz" && std::string_view(e.what()).find("free of") == std::string_view::npos);
    return 0;
  }
  std::unordered_map<std::uint64_t, std::uint64_t> live;
  for (const Event& e : t.events) {
    if (e.action == Action::alloc) live[e.addr] = e.size;
    else if (e.action == Action::free_completed) check(live.erase(e.addr) == 1);
  }
  if (t.has_segments)
    for (const gmem::trace::DumpedBlock& b : dumped) {
      const auto it = live.find(b.addr);
      check(it != live.end() && it->second == b.size);
    }
  return 0;
}
