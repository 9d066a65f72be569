// What tracking may do to an engine besides observing it (observer.hpp): attach its observer,
// read what is mapped, and read and tag the live blocks' records, all while it holds the
// engine's lock through a LockedEngine. The lock and the records stay the engine's own: tracking
// reaches them only through the members below (it does not include engine_impl.hpp), so the
// engine's locking rules live in the engine alone, and no record is reached without the lock.
//
// Nothing here is on the malloc path: that one is the observer's (virtual calls made under the
// lock the malloc takes anyway). The visits and find_tag are templates and inline, as when
// tracking walked the engine's map itself: a walk of 100,000 live blocks (a step, a report) is
// not made slower by an indirect call a block, nor mark_saved (once per saved tensor) by calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "common/pointer_map.hpp"
#include "engine/blocks.hpp"
#include "engine/observer.hpp"
#include "gmem/device.hpp"
#include "gmem/engine.hpp"

namespace gmem::detail {

// A live block as tracking reads it: BlockInfo's figures and the observer's tag, copied out of
// the engine's record (which holds the engine's own bookkeeping too).
struct LiveBlock {
  DevicePtr addr = 0;          // the block's start
  std::size_t size = 0;        // rounded size handed out
  std::size_t requested = 0;   // size asked for
  StreamId stream = 0;
  BlockTag tag{};              // as the observer left it (all zero: allocated unobserved)
};

// The engine's lock, held from construction to destruction (as a std::lock_guard), and what may
// be done with the engine only while it is held. Not reentrant: a thread that holds one must
// not call the engine, nor make a second one for the same engine. (EngineLock, engine_lock.hpp,
// is the same lock as the parts below the engine use it; this is for the layer above.)
class LockedEngine {
 public:
  explicit LockedEngine(Engine& engine);  // waits for the lock
  ~LockedEngine() { mutex_.unlock(); }
  LockedEngine(const LockedEngine&) = delete;
  LockedEngine& operator=(const LockedEngine&) = delete;

  // Whether an observer is attached: an engine has at most one (one tracker).
  bool has_observer() const noexcept;
  // From now on `observer` is told of every malloc, free, map, unmap and OOM, and keeps a tag in
  // each block it is told was allocated; nullptr detaches. Reads observer->context_capture()
  // once, here.
  void attach(EngineObserver* observer);
  // What is mapped now, as [begin, end) ranges by address (adjacent pages merged): the state an
  // observer attaching starts from, since it is told only of maps and unmaps made later.
  std::vector<std::pair<DevicePtr, DevicePtr>> mapped_ranges() const;

  // Calls visit(const LiveBlock&) for each live block, in no particular order. `visit` must not
  // call the engine (the lock is held); if it throws, the walk stops there and the exception
  // propagates.
  template <class Visit>
  void for_each_block(Visit&& visit) const {
    live_.for_each([&](std::uintptr_t addr, const Record& r) {
      visit(LiveBlock{addr, r.size, r.requested, r.stream, r.tag});
    });
  }
  // Calls visit(BlockTag&) with each live block's tag, to change it (forgetting an earlier
  // observer's tags when a new one attaches). The same rules as for_each_block.
  template <class Visit>
  void for_each_tag(Visit&& visit) {
    live_.for_each_mutable([&](std::uintptr_t, Record& r) { visit(r.tag); });
  }
  // The tag of the live block that starts at `ptr`, to change; nullptr when there is none. Valid
  // only while this lock is held: records move as blocks come and go.
  BlockTag* find_tag(DevicePtr ptr) noexcept {
    Record* record = live_.find(ptr);
    return record != nullptr ? &record->tag : nullptr;
  }

 private:
  Engine::Impl& engine_;
  std::mutex& mutex_;          // engine_'s lock, held
  PointerMap<Record>& live_;   // engine_'s live blocks
};

}  // namespace gmem::detail
