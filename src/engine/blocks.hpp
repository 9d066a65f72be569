// What the engine keeps about blocks apart from their memory: each live block's Record (stored
// in a PointerMap that tracking reads and tags too, under the engine's lock), the frees that must
// wait for other streams (record_stream), and the last frees, so that a second free reads as a
// double free. Bookkeeping only: where a block's memory comes from is Backing's and the slabs'.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/observer.hpp"
#include "gmem/device.hpp"

namespace gmem::detail {

// A live allocation.
struct Record {
  std::size_t size = 0;       // rounded to 512 B
  std::size_t requested = 0;
  StreamId stream = 0;
  std::uint32_t arena = 0;
  std::uint32_t id = 0;       // SlabId when in_slab, else the RangeAllocator node
  bool small = false;         // the small pool (<= 1 MiB), as PyTorch counts it
  bool in_slab = false;
  bool shared = false;        // record_stream() added streams
  // Its range's address may be in a CUDA graph (live when a capture began, or made in a place
  // kept for that reason): when freed, Backing keeps the place for its size (kept_places.hpp).
  bool keep_place = false;
  std::uint32_t birth = 0;    // range blocks made up to it (wraps): the order they were made in
  BlockTag tag{};            // the observer's, while one is attached
};

// record_stream(): the other streams each live block is used on, and the freed blocks whose
// memory is reused only once those streams have caught up (an event recorded on each).
class CrossStreamFrees {
 public:
  explicit CrossStreamFrees(Device& device) : device_(device) {}
  ~CrossStreamFrees() {  // the engine goes: its events go with it
    for (PendingFree& p : pending_)
      for (EventHandle e : p.events) {
        try { device_.destroy_event(e); } catch (...) {}
      }
  }
  CrossStreamFrees(const CrossStreamFrees&) = delete;
  CrossStreamFrees& operator=(const CrossStreamFrees&) = delete;

  // Notes that the live block at `ptr` is used on `stream` too; false when already noted.
  bool add_user(DevicePtr ptr, StreamId stream) {
    std::vector<StreamId>& streams = users_[ptr];
    for (StreamId s : streams)
      if (s == stream) return false;
    streams.push_back(stream);
    return true;
  }

  // The shared block at `ptr` is freed: records an event on each of its other streams and keeps
  // the block until they complete; while events are held, the block waits with none recorded.
  // `freed_at`: the free's stamp on the block's own stream (Backing::free_stamp), handed back
  // with the block. On a device error nothing has changed.
  void defer(DevicePtr ptr, const Record& record, std::uint64_t freed_at) {
    auto it = users_.find(ptr);
    PendingFree pending{ptr, record, freed_at, {}, std::move(it->second)};
    users_.erase(it);
    try {
      if (!holding_) record_events(pending);
    } catch (...) {
      users_.emplace(ptr, std::move(pending.streams));
      throw;
    }
    pending_.push_back(std::move(pending));
  }

  // While a CUDA graph is captured (`hold`), no event is recorded, polled or waited for: an
  // event query invalidates a capture, and an event recorded on a capturing stream becomes a
  // node of the graph, done at once, not the stream's progress. Blocks freed meanwhile wait
  // unreused, and get their events once the capture is over (PyTorch's allocator does the same).
  void hold_events(bool hold) { holding_ = hold; }

  bool empty() const { return pending_.empty(); }

  // Calls release(ptr, record, freed_at) for each pending free whose streams have all caught up
  // (with `wait`, after waiting for them), and forgets it. Frees held through a capture get their
  // events here. Does nothing while events are held.
  template <class Release>
  void process(bool wait, Release&& release) {
    if (holding_) return;
    for (std::size_t i = 0; i < pending_.size();) {
      PendingFree& p = pending_[i];
      if (!p.streams.empty()) record_events(p);  // freed during a capture
      bool done = true;
      for (EventHandle e : p.events) {
        if (wait) device_.synchronize_event(e);
        else if (!device_.query_event(e)) done = false;
      }
      if (done) finish(i, release);
      else ++i;
    }
  }

  // The pending frees of blocks of `stream` whose events are recorded: makes `stream` wait for
  // each event on the GPU (Device::wait_event), then calls release(ptr, record, freed_at) and
  // forgets it. Returns how many went; none while events are held. On a device error the frees
  // not yet released stay pending (the waits made do no harm).
  template <class Release>
  std::size_t hand_over(StreamId stream, Release&& release) {
    if (holding_) return 0;
    std::size_t released = 0;
    for (std::size_t i = 0; i < pending_.size();) {
      PendingFree& p = pending_[i];
      if (p.record.stream != stream || !p.streams.empty()) {
        ++i;
        continue;
      }
      for (EventHandle e : p.events) device_.wait_event(stream, e);
      finish(i, release);
      ++released;
    }
    return released;
  }

  // Calls visit(record) for each pending free.
  template <class Visit>
  void for_each_pending(Visit&& visit) const {
    for (const PendingFree& p : pending_) visit(p.record);
  }

 private:
  struct PendingFree {
    DevicePtr ptr;
    Record record;
    std::uint64_t freed_at;  // its stamp on the block's own stream
    std::vector<EventHandle> events;
    std::vector<StreamId> streams;  // its other streams, until their events are recorded
  };
  // Pending free `i` is over: its events go, release(ptr, record, freed_at) is called, and the
  // free is forgotten (the last one takes its place). Each event leaves the list once
  // destroyed: should a destroy fail, the list keeps only live events, and the next call polls
  // and destroys those (a destroyed one would fail forever).
  template <class Release>
  void finish(std::size_t i, Release& release) {
    PendingFree& p = pending_[i];
    while (!p.events.empty()) {
      device_.destroy_event(p.events.back());
      p.events.pop_back();
    }
    release(p.ptr, p.record, p.freed_at);
    pending_[i] = std::move(pending_.back());
    pending_.pop_back();
  }
  // An event on each of the free's streams; on a device error none is left recorded.
  void record_events(PendingFree& p) {
    std::vector<EventHandle> events;
    try {
      for (StreamId s : p.streams) {
        events.push_back(device_.create_event());
        device_.record_event(events.back(), s);
      }
    } catch (...) {
      for (EventHandle e : events) {
        try { device_.destroy_event(e); } catch (...) {}
      }
      throw;
    }
    p.events = std::move(events);
    p.streams.clear();
  }
  Device& device_;
  std::unordered_map<DevicePtr, std::vector<StreamId>> users_;
  std::vector<PendingFree> pending_;
  bool holding_ = false;  // a capture is under way: no event calls
};

// The last frees, so that a second free of one of them reads as a double free and not as an
// interior pointer: one store per free, read only when a free fails.
class RecentFrees {
 public:
  static constexpr std::size_t kRemembered = 1024;
  void note(DevicePtr ptr) { ptrs_[count_++ % kRemembered] = ptr; }
  bool contains(DevicePtr ptr) const {
    if (ptr == 0) return false;
    for (const DevicePtr freed : ptrs_)
      if (freed == ptr) return true;
    return false;
  }

 private:
  std::array<DevicePtr, kRemembered> ptrs_{};
  std::size_t count_ = 0;
};

}  // namespace gmem::detail
