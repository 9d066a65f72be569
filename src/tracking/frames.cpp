// Call sites: one process-wide table of interned stacks, given as text by the Python layer or
// captured as C++ return addresses (symbolised only when someone reads them).
#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>

#include "gmem/tracker.hpp"
#include "tracking/string_hash.hpp"
#include "tracking/thread_context.hpp"

namespace gmem::frames {
namespace {

// "file:line:function": the line number is the first ":<digits>:" from the left, so that
// function names with "::" in them survive.
Frame parse_line(std::string_view line) {
  for (std::size_t colon = line.find(':'); colon != std::string_view::npos;
       colon = line.find(':', colon + 1)) {
    std::size_t end = colon + 1;
    while (end < line.size() && line[end] >= '0' && line[end] <= '9') ++end;
    if (end > colon + 1 && end < line.size() && line[end] == ':') {
      Frame frame;
      frame.filename = std::string(line.substr(0, colon));
      frame.line = std::atoi(std::string(line.substr(colon + 1, end - colon - 1)).c_str());
      frame.name = std::string(line.substr(end + 1));
      return frame;
    }
  }
  return Frame{"", 0, std::string(line)};
}

std::vector<Frame> parse(std::string_view text) {
  std::vector<Frame> out;
  while (!text.empty()) {
    const std::size_t newline = text.find('\n');
    std::string_view line = text.substr(0, newline);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (!line.empty()) out.push_back(parse_line(line));
    if (newline == std::string_view::npos) break;
    text.remove_prefix(newline + 1);
  }
  return out;
}

std::string demangle(const char* symbol) {
  int status = 0;
  char* readable = abi::__cxa_demangle(symbol, nullptr, nullptr, &status);
  std::string out = status == 0 && readable != nullptr ? readable : symbol;
  std::free(readable);
  return out;
}

Frame symbolise(void* pc) {
  Dl_info info{};
  Frame frame;
  char hex[32];
  std::snprintf(hex, sizeof hex, "%p", pc);
  if (dladdr(pc, &info) == 0) {
    frame.name = hex;
    return frame;
  }
  frame.filename = info.dli_fname != nullptr ? info.dli_fname : "";
  frame.name = info.dli_sname != nullptr ? demangle(info.dli_sname) : std::string(hex);
  return frame;
}

// The innermost frames of a backtrace are gmem's own (the tracker, the C API): people want the
// caller's.
void drop_gmem_frames(std::vector<Frame>& stack) {
  std::size_t first = 0;
  while (first + 1 < stack.size() &&
         (stack[first].name.rfind("gmem::", 0) == 0 || stack[first].name.rfind("gmem_", 0) == 0))
    ++first;
  stack.erase(stack.begin(), stack.begin() + static_cast<std::ptrdiff_t>(first));
}

class FramesTable {
 public:
  FramesId intern_text(std::string_view text) {
    if (text.empty()) return 0;
    std::lock_guard lock(mutex_);
    if (auto it = by_key_.find(text); it != by_key_.end()) return it->second;
    return add(std::string(text), Entry{std::string(text), {}, false, {}});
  }

  FramesId intern_pcs(void* const* pcs, int count) {
    if (count <= 0) return 0;
    // Keyed by the raw addresses, prefixed so that they never equal a text key.
    std::string key(1, '\0');
    key.append(reinterpret_cast<const char*>(pcs), static_cast<std::size_t>(count) * sizeof(void*));
    std::lock_guard lock(mutex_);
    if (auto it = by_key_.find(key); it != by_key_.end()) return it->second;
    return add(std::move(key), Entry{{}, std::vector<void*>(pcs, pcs + count), false, {}});
  }

  std::vector<Frame> get(FramesId id) {
    std::lock_guard lock(mutex_);
    if (id == 0 || id > entries_.size()) return {};
    Entry& entry = entries_[id - 1];
    if (!entry.parsed) {
      if (entry.pcs.empty()) {
        entry.frames = parse(entry.text);
      } else {
        for (void* pc : entry.pcs) entry.frames.push_back(symbolise(pc));
        drop_gmem_frames(entry.frames);
      }
      entry.parsed = true;
    }
    return entry.frames;
  }

 private:
  struct Entry {
    std::string text;
    std::vector<void*> pcs;
    bool parsed;
    std::vector<Frame> frames;
  };

  FramesId add(std::string key, Entry entry) {
    entries_.push_back(std::move(entry));
    const auto id = static_cast<FramesId>(entries_.size());
    by_key_.emplace(std::move(key), id);
    return id;
  }

  std::mutex mutex_;
  std::deque<Entry> entries_;  // id - 1
  std::unordered_map<std::string, FramesId, detail::StringHash, std::equal_to<>> by_key_;
};

FramesTable& table() {
  static FramesTable* const instance = new FramesTable;  // used until the very end
  return *instance;
}

}  // namespace

FramesId intern(std::string_view text) { return table().intern_text(text); }

void set_current(std::string_view text) { detail::thread_context().frames = intern(text); }
void set_current(FramesId id) noexcept { detail::thread_context().frames = id; }
FramesId current() noexcept { return detail::thread_context().frames; }

FramesId capture_backtrace(int skip, int depth) {
  constexpr int kMax = 128;
  void* pcs[kMax];
  const int wanted = std::min(kMax, std::max(0, skip) + 1 + std::max(1, depth));
  const int got = ::backtrace(pcs, wanted);
  const int first = std::min(got, std::max(0, skip) + 1);  // +1: this function
  return table().intern_pcs(pcs + first, got - first);
}

std::vector<Frame> get(FramesId id) { return table().get(id); }

std::string to_text(FramesId id) {
  std::string out;
  for (const Frame& f : get(id)) {
    if (!out.empty()) out += '\n';
    out += f.filename + ':' + std::to_string(f.line) + ':' + f.name;
  }
  return out;
}

}  // namespace gmem::frames
