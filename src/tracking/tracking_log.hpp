// What tracking records on the engine's hot path, kept inside the engine: each live block's tag
// sits in the engine's own record and each event goes into a ring, all under the engine's lock.
// A tracked malloc+free thus pays no second lock, no second map and, most of the time, no clock
// read: a few stores. A Tracker (include/gmem/tracker.hpp) owns the log and reads it under that
// lock; the engine holds a pointer to it while the tracker is attached.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include "engine/observer.hpp"
#include "gmem/tracker.hpp"
#include "tracking/clock.hpp"
#include "tracking/history_ring.hpp"
#include "tracking/interval_set.hpp"
#include "tracking/thread_context.hpp"

namespace gmem::detail {

// Who allocated a live block and when, kept in the engine's record of the block: id (1, 2, ...
// per tracker; 0: allocated while no tracker was attached), tick (ticks(), sampled: kTickEvery),
// step, scope and frames, and flags (kSavedForBackward).
using AllocTag = BlockTag;
// PyTorch saved the block's tensor for a backward pass that has not run yet (graph tracking,
// Tracker::mark_saved).
inline constexpr std::uint32_t kSavedForBackward = 1;
static_assert(sizeof(ScopeId) == sizeof(BlockTag::scope) && sizeof(FramesId) == sizeof(BlockTag::frames));

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

static_assert(sizeof(RawEvent) == TrackerOptions::kEventBytes);

// Everything here is guarded by the lock of the engine the log is attached to.
class TrackingLog final : public EngineObserver {
 public:
  using Backtrace = FramesId (*)(int skip, int depth);

  // `capture`: how to take a call stack when options.capture_backtrace or capture_python is set
  // (passed in so that the engine's library does not link the symboliser). A Python stack is
  // taken for mallocs only (frees would each take the GIL), and a thread without one (0) keeps
  // its current frames.
  TrackingLog(const TrackerOptions& options, Backtrace capture)
      : ring_(options.history_capacity),
        backtrace_(options.capture_backtrace || options.capture_python ? capture : nullptr),
        backtrace_depth_(options.backtrace_depth + (options.capture_backtrace ? 4 : 0)),  // gmem's
                                                                  // own C++ frames are dropped later
        frees_too_(options.capture_backtrace),
        tick_(ticks()) {}

  // A C++ backtrace for the malloc about to be made, when the options ask for one (else 0). Taken
  // before the engine changes anything: it may throw.
  FramesId backtrace() const { return backtrace_ ? backtrace_(0, backtrace_depth_) : 0; }

  ContextCapture context_capture() const override {
    return {backtrace_, backtrace_depth_, frees_too_ && logs_frees()};
  }

  // A malloc succeeded at `addr`: fills in its tag and logs it. `trace`: from backtrace().
  void on_malloc(std::uintptr_t addr, std::size_t size, StreamId stream, std::uint32_t trace,
                 AllocTag& tag) noexcept override {
    const ThreadContext& thread = thread_context();
    tag.id = ++next_id_;
    if ((tag.id & (kTickEvery - 1)) == 0) tick_ = ticks();
    tag.tick = tick_;
    tag.step = step_;
    tag.scope = thread.scope;
    tag.frames = trace != 0 ? trace : thread.frames;
    tag.flags = 0;
    ring_.push(RawEvent{tag.tick, addr, size, stream, tag.id, step_, tag.scope, tag.frames,
                        EventKind::alloc});
  }

  // A block is freed; `trace`: a backtrace of the free when they are taken.
  void on_free(std::uintptr_t addr, std::size_t size, StreamId stream, const AllocTag& tag,
               std::uint32_t trace) noexcept override {
    if (tag.id == 0) {
      ++untracked_frees_;
      return;
    }
    if (!logs_frees()) return;
    const FramesId site = trace != 0 ? trace : thread_context().frames;
    ring_.push(RawEvent{tick_, addr, size, stream, tag.id, step_, tag.scope, site,
                        EventKind::free});
  }
  bool logs_frees() const noexcept { return ring_.capacity() != 0; }

  // The slow path's events, with a fresh clock reading each.
  void on_map(std::uintptr_t va, std::size_t bytes) override {
    mapped_.add(va, va + bytes);
    ring_.push(RawEvent{fresh_tick(), va, bytes, 0, 0, step_, 0, 0, EventKind::map});
  }
  void on_unmap(std::uintptr_t va, std::size_t bytes) override {
    mapped_.remove(va, va + bytes);
    ring_.push(RawEvent{fresh_tick(), va, bytes, 0, 0, step_, 0, 0, EventKind::unmap});
  }
  void on_oom(const OomInfo& info) override {
    last_oom_ = info;
    note(EventKind::oom, info.reason, info.device_free, info.requested, info.stream);
  }
  // An annotation or an OOM: its text is kept apart from the ring (the last kMaxNotes).
  void note(EventKind kind, std::string text, std::uintptr_t addr, std::size_t size,
            StreamId stream) {
    const ThreadContext& thread = thread_context();
    notes_.push_back(std::move(text));
    if (notes_.size() > kMaxNotes) {
      notes_.pop_front();
      ++first_note_;
    }
    const std::uint64_t number = first_note_ + notes_.size() - 1;
    ring_.push(RawEvent{fresh_tick(), addr, size, stream, number, step_, thread.scope,
                        thread.frames, kind});
  }
  // A step ends: returns the new step's number.
  std::uint32_t step() noexcept {
    ++step_;
    ring_.push(RawEvent{fresh_tick(), 0, 0, 0, 0, step_, thread_context().scope, 0,
                        EventKind::step});
    return step_;
  }

  // Times: the time-stamp counter costs ~10 ns, a third of an untracked malloc+free, so the hot
  // path reads it once every kTickEvery allocations and stamps other mallocs and frees with the
  // last reading; the slow path (steps, maps, notes) always reads it. A malloc's or free's time is
  // thus exact to within the time the program takes to make kTickEvery allocations.
  static constexpr std::uint64_t kTickEvery = 64;
  std::uint64_t fresh_tick() noexcept { return tick_ = ticks(); }

  static constexpr std::size_t kMaxNotes = 4096;  // annotation texts and OOM reasons kept

  HistoryRing<RawEvent> ring_;
  Backtrace backtrace_;
  int backtrace_depth_;
  bool frees_too_;
  std::uint64_t tick_;
  std::uint64_t next_id_ = 0;
  std::uint32_t step_ = 0;
  std::uint64_t untracked_frees_ = 0;
  IntervalSet mapped_;  // what the engine has mapped
  std::optional<OomInfo> last_oom_;
  std::deque<std::string> notes_;
  std::uint64_t first_note_ = 0;
};

}  // namespace gmem::detail
