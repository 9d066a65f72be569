// The tracker: its log lives in the engine (tracking_log.hpp) and is read under the engine's lock,
// taken through a LockedEngine (engine/locked_engine.hpp), which is all tracking sees of it.
// Everything that formats strings (reading state, leak detection) copies what it needs under the
// lock and works outside it.
#include "gmem/tracker.hpp"

#include <algorithm>
#include <atomic>
#include <deque>
#include <mutex>
#include <unordered_map>

#include "common/python_frames.hpp"
#include "engine/locked_engine.hpp"
#include "tracking/clock.hpp"
#include "tracking/tracking_log.hpp"

namespace gmem {
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
  Impl(Engine& engine, TrackerOptions options)
      : engine_(engine), options_(options),
        log_(options, options.capture_backtrace ? &frames::capture_backtrace : &frames::capture_python) {
    detail::tick_origin();
    start_tick_ = detail::ticks();
    detail::LockedEngine locked(engine_);
    if (locked.has_observer())
      throw Error(Errc::invalid_argument, "this engine already has a tracker attached");
    // Tags left by an earlier tracker are not ours: those blocks count as untracked.
    locked.for_each_tag([](detail::BlockTag& tag) { tag = {}; });
    // The maps made before attaching are state, not history: no events for them.
    for (const auto& [begin, end] : locked.mapped_ranges()) log_.mapped_.add(begin, end);
    locked.attach(&log_);
    attached_ = true;
  }

  void detach() {
    detail::LockedEngine locked(engine_);
    if (!attached_) return;
    locked.attach(nullptr);
    attached_ = false;
  }

  // Calls visit(block) for each live block this tracker saw allocated; `locked`: its lock.
  template <class Visit>
  void for_each_tracked(const detail::LockedEngine& locked, Visit visit) const {
    if (!attached_) return;
    locked.for_each_block([&](const detail::LiveBlock& b) {
      if (b.tag.id != 0) visit(b);
    });
  }

  void step() {
    struct Tracked {
      std::uintptr_t addr;
      std::uint64_t id;
      std::uint64_t size;
      std::uint64_t tick;
      ScopeId scope;
      FramesId frames;
      bool saved;
    };
    std::lock_guard detector_lock(detector_mutex_);
    std::vector<Tracked> live;
    std::uint64_t tick = 0;
    {
      detail::LockedEngine locked(engine_);
      for_each_tracked(locked, [&](const detail::LiveBlock& b) {
        live.push_back({b.addr, b.tag.id, b.size, b.tag.tick, b.tag.scope, b.tag.frames,
                        (b.tag.flags & detail::kSavedForBackward) != 0});
      });
      log_.step();
      tick = log_.tick_;
    }
    // The leak detector samples only at boundaries: it learns now of the frees of blocks it was
    // told about (those not live any more under the same id) and of the blocks allocated since
    // the last boundary that are still live.
    std::unordered_map<std::uintptr_t, const Tracked*> still_fed;
    for (const Tracked& t : live)
      if (t.id <= fed_watermark_) still_fed.emplace(t.addr, &t);
    for (auto it = fed_.begin(); it != fed_.end();) {
      const auto live_it = still_fed.find(it->first);
      if (live_it != still_fed.end() && live_it->second->id == it->second.id) {
        if (live_it->second->saved != it->second.saved) {  // saved, or used by a backward, since
          it->second.saved = live_it->second->saved;
          leaks_.on_saved(it->first, it->second.saved);
        }
        ++it;
        continue;
      }
      leaks_.on_free(it->first);
      it = fed_.erase(it);
    }
    const detail::TickClock clock = detail::TickClock::make();
    std::unordered_map<std::uint64_t, std::pair<std::string, std::string>> sites;
    std::uint64_t newest = fed_watermark_;
    for (const Tracked& t : live) {
      newest = std::max(newest, t.id);
      if (t.id <= fed_watermark_) continue;
      const std::uint64_t key = (std::uint64_t{t.scope} << 32) | t.frames;
      auto it = sites.find(key);
      if (it == sites.end())
        it = sites.emplace(key, std::pair{site_of(t.scope, t.frames), frames::to_text(t.frames)})
                 .first;
      fed_[t.addr] = Fed{t.id, t.saved};
      leaks_.on_alloc(t.addr, t.size, it->second.first, clock.wall_ns(t.tick) / 1000,
                      it->second.second);
      if (t.saved) leaks_.on_saved(t.addr, true);
    }
    fed_watermark_ = newest;
    leaks_.on_step(clock.wall_ns(tick) / 1000);
  }

  TrackerState state() const {
    std::vector<detail::LiveBlock> live;
    std::vector<detail::RawEvent> events;
    std::deque<std::string> notes;
    TrackerState out;
    std::uint64_t first_note = 0;
    {
      detail::LockedEngine locked(engine_);
      for_each_tracked(locked, [&](const detail::LiveBlock& b) { live.push_back(b); });
      events.reserve(log_.ring_.size());
      log_.ring_.for_each([&](const detail::RawEvent& e) { events.push_back(e); });
      notes = log_.notes_;
      first_note = log_.first_note_;
      for (const auto& [begin, end] : log_.mapped_.ranges())
        out.mapped.emplace_back(begin, end - begin);
      out.step = log_.step_;
      out.allocations = log_.next_id_;
      out.dropped_events = log_.ring_.dropped();
      out.history_capacity = log_.ring_.capacity();
      out.untracked_frees = log_.untracked_frees_;
      out.backward_runs = backward_runs_.load(std::memory_order_relaxed);
      out.last_oom = log_.last_oom_;
    }
    const detail::TickClock clock = detail::TickClock::make();
    std::sort(live.begin(), live.end(),
              [](const auto& a, const auto& b) { return a.addr < b.addr; });
    out.live.reserve(live.size());
    for (const detail::LiveBlock& b : live)
      out.live.push_back(LiveAllocation{b.addr, b.tag.id, b.size, b.requested, b.stream,
                                        clock.wall_ns(b.tag.tick), b.tag.step, b.tag.scope,
                                        b.tag.frames,
                                        (b.tag.flags & detail::kSavedForBackward) != 0});
    out.history.reserve(events.size());
    for (const detail::RawEvent& e : events) {
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
    detail::LockedEngine locked(engine_);
    for_each_tracked(locked, [&](const detail::LiveBlock& b) {
      LiveAllocation a;
      a.addr = b.addr;
      a.size = b.size;
      a.scope = b.tag.scope;
      a.frames = b.tag.frames;
      out.push_back(a);
    });
    return out;
  }

  Engine& engine_;
  TrackerOptions options_;
  std::uint64_t start_tick_ = 0;  // when tracking began
  // --- under the engine's lock (a LockedEngine) ---
  detail::TrackingLog log_;
  bool attached_ = false;
  // --- under detector_mutex_ (taken before the engine's when both are needed) ---
  mutable std::mutex detector_mutex_;
  LeakDetector leaks_;
  struct Fed {
    std::uint64_t id;
    bool saved;  // as leaks_ was last told
  };
  std::unordered_map<std::uintptr_t, Fed> fed_;  // what leaks_ holds, by address
  std::uint64_t fed_watermark_ = 0;  // ids up to this were looked at by the last step
  std::atomic<bool> backward_runs_{false};  // note_backward() was called
};

Tracker::Tracker(Engine& engine, TrackerOptions options)
    : impl_(std::make_unique<Impl>(engine, options)) {}
Tracker::~Tracker() { impl_->detach(); }

void Tracker::detach() { impl_->detach(); }
void Tracker::step() { impl_->step(); }
void Tracker::annotate(std::string_view text) {
  std::string note(text);
  detail::LockedEngine locked(impl_->engine_);
  impl_->log_.note(EventKind::annotation, std::move(note), 0, 0, 0);
}

bool Tracker::mark_saved(std::uintptr_t addr, bool saved) {
  detail::LockedEngine locked(impl_->engine_);
  if (!impl_->attached_) return false;
  detail::BlockTag* tag = locked.find_tag(addr);
  if (tag == nullptr || tag->id == 0) return false;
  if (saved) tag->flags |= detail::kSavedForBackward;
  else tag->flags &= ~detail::kSavedForBackward;
  return true;
}

void Tracker::note_backward() {
  impl_->backward_runs_.store(true, std::memory_order_relaxed);
  std::lock_guard lock(impl_->detector_mutex_);
  impl_->leaks_.on_backward();
}

Engine& Tracker::engine() const noexcept { return impl_->engine_; }
const TrackerOptions& Tracker::options() const noexcept { return impl_->options_; }

std::uint64_t Tracker::current_step() const {
  detail::LockedEngine locked(impl_->engine_);
  return impl_->log_.step_;
}
std::size_t Tracker::live_count() const {
  std::size_t count = 0;
  detail::LockedEngine locked(impl_->engine_);
  impl_->for_each_tracked(locked, [&](const detail::LiveBlock&) { ++count; });
  return count;
}
std::size_t Tracker::live_bytes() const {
  std::size_t bytes = 0;
  detail::LockedEngine locked(impl_->engine_);
  impl_->for_each_tracked(locked, [&](const detail::LiveBlock& b) { bytes += b.size; });
  return bytes;
}
TrackerState Tracker::state() const { return impl_->state(); }
std::optional<OomInfo> Tracker::last_oom() const {
  detail::LockedEngine locked(impl_->engine_);
  return impl_->log_.last_oom_;
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

std::int64_t Tracker::started_us() const {
  return detail::TickClock::make().wall_ns(impl_->start_tick_) / 1000;
}

std::vector<LeakFinding> Tracker::leak_suspects() const {
  std::lock_guard lock(impl_->detector_mutex_);
  return impl_->leaks_.findings();
}

}  // namespace gmem
