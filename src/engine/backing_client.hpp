// What Backing asks of the engine around it, for what the engine owns (slow paths only): the
// slabs, and the frees held for other streams. Its lock is not here: EngineLock.
#pragma once

#include <cstddef>

#include "gmem/device.hpp"

namespace gmem::detail {

class BackingClient {
 public:
  // A new arena is about to be added (its index: the arenas so far); may throw, and the arena
  // is then not added.
  virtual void arena_added() = 0;
  // Memory is short: give back empty slabs and the frees that wait on other streams.
  virtual void reclaim() = 0;
  // Stream `stream`'s frees held for other streams (record_stream) whose events are recorded:
  // makes `stream` wait for those events on the GPU and gives them back as its frees from now
  // on (a handover, no host wait). Returns how many went back; none during a capture.
  virtual std::size_t hand_over_held(StreamId stream) = 0;

 protected:
  ~BackingClient() = default;
};

}  // namespace gmem::detail
