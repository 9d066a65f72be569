// How far each stream's work has progressed, as seen through events: memory freed on a stream
// is stamped with the stream's free sequence number, and may be handed to another stream once
// an event recorded after that free has completed. Events are recorded lazily, only when
// another stream wants the memory, so a single-stream program never touches them.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "gmem/device.hpp"

namespace gmem::detail {

class StreamTracker {
 public:
  // Runs a blocking call with the caller's lock released, and takes the lock again.
  using Unlocked = std::function<void(const std::function<void()>&)>;

  explicit StreamTracker(Device& device) : device_(device) {}
  ~StreamTracker();  // destroys the events still pending

  // Registers a stream (once); returns its index.
  std::uint32_t add(StreamId stream);
  StreamId stream(std::uint32_t index) const { return streams_[index].stream; }
  std::size_t size() const { return streams_.size(); }

  // Stamps a free on stream `index`: the returned sequence number identifies it.
  std::uint64_t stamp(std::uint32_t index) { return ++streams_[index].seq; }
  // Whether the work on stream `index` up to free `seq` is known to be done (no device call).
  bool done(std::uint32_t index, std::uint64_t seq) const { return seq <= streams_[index].completed; }
  // Records an event covering every free so far (if none does yet) and polls the pending
  // events; with `wait`, blocks until the stream has caught up. Returns true when all of the
  // stream's frees so far are done. With `unlocked`, the wait is made through it: other threads
  // may use the tracker meanwhile (and complete the very event waited on).
  bool catch_up(std::uint32_t index, bool wait, const Unlocked* unlocked = nullptr);

 private:
  struct Pending {
    EventHandle event;
    std::uint64_t seq;
  };
  struct Stream {
    StreamId stream = 0;
    std::uint64_t seq = 0;        // last stamped free
    std::uint64_t completed = 0;  // frees up to here are done
    std::deque<Pending> pending;  // events in record order
  };
  // The stream's oldest pending event `p` is done: drop it, unless another thread did while the
  // lock was released.
  void complete(std::uint32_t index, const Pending& p);

  Device& device_;
  std::vector<Stream> streams_;
  std::vector<EventHandle> spare_events_;
};

}  // namespace gmem::detail
