// The tracker: live allocations in an open-addressing map, events in a ring, both under one spin
// lock held for a few nanoseconds. Everything that formats strings (reading state, leak
// detection) copies what it needs under the lock and works outside it.
#include "gmem/tracker.hpp"

#include <algorithm>
#include <deque>
#include <mutex>
#include <unordered_map>

#include "common/pointer_map.hpp"
#include "common/python_frames.hpp"
#include "tracking/clock.hpp"
#include "tracking/history_ring.hpp"
#include "tracking/interval_set.hpp"
#include "tracking/spin_lock.hpp"
#include "tracking/thread_context.hpp"

namespace gmem {
namespace {

// One cache line with its key in the map.
struct Record {
  std::uint64_t id;
  std::uint64_t size;
  std::uint64_t requested;
  StreamId stream;
  std::uint64_t tick;
  std::uint32_t step;
  ScopeId scope;
  FramesId frames;
};

struct RawEvent {
  std::uint64_t tick;
  std::uintptr_t addr;  // oom: the device's free memory
  std::uint64_t size;
  StreamId stream;
  std::uint64_t id;     // alloc, free: allocation id; annotation, oom: note number
  std::uint32_t step;
  ScopeId scope;
  FramesId frames;
  EventKind kind;
};

constexpr std::size_t kMaxNotes = 4096;  // annotation texts and OOM reasons kept

}  // namespace

const char* event_kind_name(EventKind kind) noexcept {
  switch (kind) {
    case EventKind::alloc: return "alloc";
    case EventKind::free: return "free";
    case EventKind::map: return "map";
    case EventKind::unmap: return "unmap";
    case EventKind::oom: return "oom";
    case EventKind::step: return "step";
    case EventKind::annotation: return "annotation";
  }
  return "?";
}

namespace {

std::string frame_text(const Frame& f) {
  return f.filename.empty() && f.line == 0 ? f.name
                                           : f.filename + ':' + std::to_string(f.line) + ':' + f.name;
}

}  // namespace

std::string site_of(ScopeId scope, FramesId frames_id) {
  if (frames_id != 0) {
    const std::vector<Frame> stack = frames::get(frames_id);
    for (const Frame& f : stack)
      if (detail::is_user_python_file(f.filename)) return frame_text(f);
    if (!stack.empty()) return frame_text(stack.front());
  }
  if (scope != 0) return scopes::path(scope);
  return "<unknown>";
}

class Tracker::Impl {
 public:
  explicit Impl(TrackerOptions options) : options_(options), ring_(options.history_capacity) {
    detail::tick_origin();
  }

  FramesId call_site(const detail::ThreadContext& thread) const {
    // Skip nothing here: how many of gmem's own frames sit on top depends on inlining, and
    // symbolising drops them by name anyway (frames.cpp).
    return options_.capture_backtrace ? frames::capture_backtrace(0, options_.backtrace_depth + 4)
                                      : thread.frames;
  }

  void on_malloc(std::uintptr_t key, std::size_t size, std::size_t requested, StreamId stream) {
    const detail::ThreadContext thread = detail::thread_context();
    const ScopeId scope = thread.scope;
    const FramesId site = call_site(thread);
    const std::uint64_t tick = detail::ticks();
    std::lock_guard lock(lock_);
    const Record record{++next_id_, size, requested, stream, tick, step_, scope, site};
    Record old;
    if (live_.put(key, record, old)) live_bytes_ -= old.size;  // its free was missed
    live_bytes_ += size;
    ring_.push(RawEvent{tick, key, size, stream, record.id, step_, scope, site, EventKind::alloc});
  }

  void on_free(std::uintptr_t key) {
    const bool logged = ring_.capacity() != 0;  // only the history needs the free's time and site
    const FramesId site = logged ? call_site(detail::thread_context()) : 0;
    const std::uint64_t tick = logged ? detail::ticks() : 0;
    std::lock_guard lock(lock_);
    Record record;
    if (!live_.take(key, record)) {
      ++untracked_frees_;
      return;
    }
    live_bytes_ -= record.size;
    if (record.id <= fed_watermark_) fed_frees_.push_back(key);
    ring_.push(RawEvent{tick, key, record.size, record.stream, record.id, step_, record.scope, site,
                        EventKind::free});
  }

  void step() {
    struct Survivor {
      std::uintptr_t addr;
      std::uint64_t size;
      std::uint64_t tick;
      ScopeId scope;
      FramesId frames;
    };
    std::lock_guard detector_lock(detector_mutex_);
    std::vector<Survivor> survivors;
    std::vector<std::uintptr_t> frees;
    const std::uint64_t tick = detail::ticks();
    {
      std::lock_guard lock(lock_);
      // Allocations made since the last step and still live cross this boundary: the leak
      // detector learns of them now (it samples only at boundaries), and of frees of those it knew.
      live_.for_each([&](std::uintptr_t key, const Record& r) {
        if (r.id > fed_watermark_) survivors.push_back({key, r.size, r.tick, r.scope, r.frames});
      });
      frees.swap(fed_frees_);
      fed_watermark_ = next_id_;
      ++step_;
      ring_.push(RawEvent{tick, 0, 0, 0, 0, step_, detail::thread_context().scope, 0,
                          EventKind::step});
    }
    const detail::TickClock clock = detail::TickClock::make();
    for (std::uintptr_t addr : frees) leaks_.on_free(addr);
    std::unordered_map<std::uint64_t, std::pair<std::string, std::string>> sites;
    for (const Survivor& s : survivors) {
      const std::uint64_t key = (std::uint64_t{s.scope} << 32) | s.frames;
      auto it = sites.find(key);
      if (it == sites.end())
        it = sites.emplace(key, std::pair{site_of(s.scope, s.frames), frames::to_text(s.frames)})
                 .first;
      leaks_.on_alloc(s.addr, s.size, it->second.first, clock.wall_ns(s.tick) / 1000,
                      it->second.second);
    }
    leaks_.on_step(clock.wall_ns(tick) / 1000);
  }

  void note(EventKind kind, std::string text, std::uintptr_t addr, std::size_t size,
            StreamId stream) {
    const ScopeId scope = detail::thread_context().scope;
    const FramesId site = detail::thread_context().frames;
    const std::uint64_t tick = detail::ticks();
    std::lock_guard lock(lock_);
    notes_.push_back(std::move(text));
    if (notes_.size() > kMaxNotes) {
      notes_.pop_front();
      ++first_note_;
    }
    const std::uint64_t number = first_note_ + notes_.size() - 1;
    ring_.push(RawEvent{tick, addr, size, stream, number, step_, scope, site, kind});
  }

  void on_map(std::uintptr_t va, std::size_t bytes) {
    const std::uint64_t tick = detail::ticks();
    std::lock_guard lock(lock_);
    mapped_.add(va, va + bytes);
    ring_.push(RawEvent{tick, va, bytes, 0, 0, step_, 0, 0, EventKind::map});
  }

  void on_unmap(std::uintptr_t va, std::size_t bytes) {
    const std::uint64_t tick = detail::ticks();
    std::lock_guard lock(lock_);
    mapped_.remove(va, va + bytes);
    ring_.push(RawEvent{tick, va, bytes, 0, 0, step_, 0, 0, EventKind::unmap});
  }

  void on_oom(const OomInfo& info) {
    {
      std::lock_guard lock(lock_);
      last_oom_ = info;
    }
    note(EventKind::oom, info.reason, info.device_free, info.requested, info.stream);
  }

  TrackerState state() const {
    std::vector<std::pair<std::uintptr_t, Record>> live;
    std::vector<RawEvent> events;
    std::deque<std::string> notes;
    TrackerState out;
    std::uint64_t first_note = 0;
    {
      std::lock_guard lock(lock_);
      live.reserve(live_.size());
      live_.for_each([&](std::uintptr_t key, const Record& r) { live.emplace_back(key, r); });
      events.reserve(ring_.size());
      ring_.for_each([&](const RawEvent& e) { events.push_back(e); });
      notes = notes_;
      first_note = first_note_;
      for (const auto& [begin, end] : mapped_.ranges()) out.mapped.emplace_back(begin, end - begin);
      out.step = step_;
      out.allocations = next_id_;
      out.dropped_events = ring_.dropped();
      out.untracked_frees = untracked_frees_;
      out.last_oom = last_oom_;
    }
    const detail::TickClock clock = detail::TickClock::make();
    std::sort(live.begin(), live.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    out.live.reserve(live.size());
    for (const auto& [key, r] : live)
      out.live.push_back(LiveAllocation{key, r.id, r.size, r.requested, r.stream,
                                        clock.wall_ns(r.tick), r.step, r.scope, r.frames});
    out.history.reserve(events.size());
    for (const RawEvent& e : events) {
      HistoryEvent h;
      h.kind = e.kind;
      h.addr = e.addr;
      h.size = e.size;
      h.stream = e.stream;
      h.time_ns = clock.wall_ns(e.tick);
      h.step = e.step;
      h.scope = e.scope;
      h.frames = e.frames;
      h.id = e.id;
      if (e.kind == EventKind::annotation || e.kind == EventKind::oom) {
        h.id = 0;
        h.text = e.id >= first_note && e.id - first_note < notes.size()
                     ? notes[static_cast<std::size_t>(e.id - first_note)]
                     : std::string("(dropped)");
      }
      if (e.kind == EventKind::oom) {
        h.device_free = e.addr;
        h.addr = 0;
      }
      out.history.push_back(std::move(h));
    }
    return out;
  }

  // (scope, frames, size) of every live allocation, for grouping outside the lock.
  std::vector<LiveAllocation> live_sites() const {
    std::vector<LiveAllocation> out;
    std::lock_guard lock(lock_);
    out.reserve(live_.size());
    live_.for_each([&](std::uintptr_t key, const Record& r) {
      LiveAllocation a;
      a.addr = key;
      a.size = r.size;
      a.scope = r.scope;
      a.frames = r.frames;
      out.push_back(a);
    });
    return out;
  }

  TrackerOptions options_;
  mutable detail::SpinLock lock_;
  // --- under lock_ ---
  detail::PointerMap<Record> live_;
  detail::HistoryRing<RawEvent> ring_;
  std::uint64_t next_id_ = 0;
  std::uint32_t step_ = 0;
  std::size_t live_bytes_ = 0;
  std::uint64_t untracked_frees_ = 0;
  detail::IntervalSet mapped_;  // what the engine has mapped, as far as it told us
  std::optional<OomInfo> last_oom_;
  std::deque<std::string> notes_;
  std::uint64_t first_note_ = 0;
  std::uint64_t fed_watermark_ = 0;       // ids up to this were live at the last step: fed
  std::vector<std::uintptr_t> fed_frees_;  // frees of fed allocations since the last step
  // --- under detector_mutex_ (taken before lock_ when both are needed) ---
  mutable std::mutex detector_mutex_;
  LeakDetector leaks_;

};

Tracker::Tracker(TrackerOptions options) : impl_(std::make_unique<Impl>(options)) {}
Tracker::~Tracker() = default;

void Tracker::on_malloc(void* ptr, std::size_t size, std::size_t requested, StreamId stream) {
  if (ptr != nullptr) impl_->on_malloc(reinterpret_cast<std::uintptr_t>(ptr), size, requested, stream);
}
void Tracker::on_free(void* ptr) {
  if (ptr != nullptr) impl_->on_free(reinterpret_cast<std::uintptr_t>(ptr));
}
void Tracker::step() { impl_->step(); }
void Tracker::annotate(std::string_view text) {
  impl_->note(EventKind::annotation, std::string(text), 0, 0, 0);
}
void Tracker::on_map(DevicePtr va, std::size_t bytes) { impl_->on_map(va, bytes); }
void Tracker::on_unmap(DevicePtr va, std::size_t bytes) { impl_->on_unmap(va, bytes); }
void Tracker::on_oom(const OomInfo& info) { impl_->on_oom(info); }

const TrackerOptions& Tracker::options() const noexcept { return impl_->options_; }

std::uint64_t Tracker::current_step() const {
  std::lock_guard lock(impl_->lock_);
  return impl_->step_;
}
std::size_t Tracker::live_count() const {
  std::lock_guard lock(impl_->lock_);
  return impl_->live_.size();
}
std::size_t Tracker::live_bytes() const {
  std::lock_guard lock(impl_->lock_);
  return impl_->live_bytes_;
}
TrackerState Tracker::state() const { return impl_->state(); }
std::optional<OomInfo> Tracker::last_oom() const {
  std::lock_guard lock(impl_->lock_);
  return impl_->last_oom_;
}

namespace {

template <class KeyOf>
std::vector<UsageGroup> group(const std::vector<LiveAllocation>& live, std::size_t limit,
                              KeyOf key_of) {
  // Group by the interned ids first: one string per distinct (scope, frames), not per block.
  std::unordered_map<std::uint64_t, UsageGroup> by_ids;
  for (const LiveAllocation& a : live) {
    UsageGroup& g = by_ids[(std::uint64_t{a.scope} << 32) | a.frames];
    if (g.count == 0) g.key = key_of(a);
    g.bytes += a.size;
    ++g.count;
  }
  std::unordered_map<std::string, UsageGroup> by_key;
  for (auto& [ids, g] : by_ids) {
    UsageGroup& merged = by_key[g.key];
    merged.key = g.key;
    merged.bytes += g.bytes;
    merged.count += g.count;
  }
  std::vector<UsageGroup> out;
  out.reserve(by_key.size());
  for (auto& [key, g] : by_key) out.push_back(std::move(g));
  std::sort(out.begin(), out.end(), [](const UsageGroup& a, const UsageGroup& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.key < b.key;
  });
  if (out.size() > limit) out.resize(limit);
  return out;
}

}  // namespace

std::vector<UsageGroup> Tracker::usage_by_scope(std::size_t limit) const {
  return group(impl_->live_sites(), limit, [](const LiveAllocation& a) {
    return a.scope != 0 ? scopes::path(a.scope) : std::string("<no scope>");
  });
}

std::vector<UsageGroup> Tracker::usage_by_site(std::size_t limit) const {
  return group(impl_->live_sites(), limit,
               [](const LiveAllocation& a) { return site_of(0, a.frames); });
}

std::vector<LeakFinding> Tracker::leak_suspects() const {
  std::lock_guard lock(impl_->detector_mutex_);
  return impl_->leaks_.findings();
}

}  // namespace gmem
