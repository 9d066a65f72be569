// SimStreams: the simulated device's streams and events, so that stream ordering can be tested.
// A stream is a count of work items submitted (a kernel launch, say) and completed; an event
// recorded on a stream waits for the work submitted before it, and for what that stream was made
// to wait for (wait_event), transitively. Work completes at once, or (when told to) only through
// complete_stream, complete_all_streams or a synchronize on an event.
//
// The host-ahead model: the GPU runs lag() behind the host on every stream. An event recorded at
// host time t completes at t + lag (never before an event recorded earlier on its stream), as
// seen by the host clock, which belongs to the caller (SimCallLedger): the calls that read it
// take it as `now_us`. An event is complete when its work is done and its time has come.
//
// It neither counts nor prices its calls (SimCallLedger does). Thread-safe: one mutex, held by
// each member function and by nothing else, so it is a leaf (no other lock is taken while it is
// held).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "gmem/device.hpp"
#include "gmem/device_calls.hpp"

namespace gmem {

class SimStreams {
 public:
  // `complete_immediately`: work completes when submitted. Precondition (SimulatedDevice checks
  // it): lag_us is finite and >= 0.
  SimStreams(bool complete_immediately, double lag_us);

  // --- the calls, as Device's (device.hpp); an unknown event throws DeviceError ---
  EventHandle create_event();
  void destroy_event(EventHandle event);
  void record_event(EventHandle event, StreamId stream, double now_us);
  // Whether `event` is complete at host time `now_us` (one never recorded is).
  bool query_event(EventHandle event, double now_us);
  // The host waits for `event`: its stream runs up to it (not past it), with the work it waits
  // for. Returns the host time at which it completes, for the host clock to move on to (0 for an
  // event never recorded).
  double synchronize_event(EventHandle event);
  // The stream's later events complete no earlier than `event`, and (streams completing only
  // when told) only once the work it waits for is done; complete_stream and synchronize_event
  // finish that work too, as the GPU would have.
  void wait_event(StreamId stream, EventHandle event);
  bool capturing(StreamId stream) const;  // Device::stream_capturing
  // A capture begins (true) or ends on `stream`, as capturing() will say.
  void set_capturing(StreamId stream, bool capturing);

  // --- work, for tests ---
  // Work submitted to `stream` (a kernel launch, say): events recorded after it wait for it.
  void submit_work(StreamId stream);
  // All work submitted to `stream` so far has finished.
  void complete_stream(StreamId stream);
  void complete_all_streams();
  // Work items submitted to `stream` so far (submit_work).
  std::uint64_t submitted(StreamId stream) const;
  // Whether work submitted to `waiter` from now on runs after work item `work` of `stream`: the
  // same stream, that work done, or `waiter` made to wait for it (wait_event, directly or through
  // the events it waited for). What a block handed from one stream to another must satisfy.
  bool ordered_after(StreamId waiter, StreamId stream, std::uint64_t work) const;

  // The GPU's lag behind the host for events recorded from now on: a busier phase, say. Throws
  // Error (invalid_argument) unless `us` is finite and >= 0.
  void set_lag(double us);
  double lag() const;
  std::size_t live_events() const;  // created and not destroyed

 private:
  // Work items of other streams that a stream's work (or an event) comes after: stream -> the
  // last such item. Never names the stream it belongs to.
  using After = std::map<StreamId, std::uint64_t>;
  struct Event {
    StreamId stream = 0;
    std::uint64_t target = 0;    // work item on `stream` this event waits for
    double completes_at_us = 0;  // host time at which the lagging GPU reaches it
    bool recorded = false;       // false: the fields above mean nothing, and it is complete
    After after;                 // its stream's waits when it was recorded
  };
  struct Stream {
    // Work items (submit_work, complete_stream and the rest). Invariant: completed <= submitted.
    std::uint64_t submitted = 0, completed = 0;
    double last_completion_us = 0;  // of the latest event recorded on it, or waited for by it
    After after;                    // what its work from now on waits for (wait_event)
  };
  // These three run with mutex_ held.
  void finish(StreamId stream, std::uint64_t work, const After& after);  // work done, and its waits
  bool event_complete(const Event& event, double now_us);
  Event& event_of(EventHandle event, DeviceCall call);  // throws DeviceError for an unknown one

  const bool complete_immediately_;

  mutable std::mutex mutex_;  // guards everything below
  double lag_us_;             // finite, >= 0
  EventHandle next_event_ = 1;  // handles are never reused; 0 is none
  std::unordered_map<EventHandle, Event> events_;  // the live events
  std::unordered_map<StreamId, Stream> streams_;   // every stream named so far
  std::unordered_set<StreamId> capturing_;         // set_capturing(stream, true), not yet ended
};

}  // namespace gmem
