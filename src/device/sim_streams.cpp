#include "gmem/sim_streams.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "device/sim_results.hpp"
#include "gmem/error.hpp"

namespace gmem {

SimStreams::SimStreams(bool complete_immediately, double lag_us)
    : complete_immediately_(complete_immediately), lag_us_(lag_us) {}

EventHandle SimStreams::create_event() {
  std::lock_guard lock(mutex_);
  const EventHandle handle = next_event_++;
  events_.emplace(handle, Event{});
  return handle;
}

void SimStreams::destroy_event(EventHandle event) {
  std::lock_guard lock(mutex_);
  if (events_.erase(event) == 0) {
    throw DeviceError(device_call_name(DeviceCall::destroy_event), sim::kInvalidHandle,
                      "unknown event " + std::to_string(event));
  }
}

void SimStreams::record_event(EventHandle event, StreamId stream, double now_us) {
  std::lock_guard lock(mutex_);
  Event& e = event_of(event, DeviceCall::record_event);
  Stream& s = streams_[stream];
  // The GPU reaches the event lag_us after the host recorded it, and a stream runs in order.
  const double completes_at = std::max(now_us + lag_us_, s.last_completion_us);
  s.last_completion_us = completes_at;
  e = Event{stream, s.submitted, completes_at, true, s.after};
}

void SimStreams::wait_event(StreamId stream, EventHandle event) {
  std::lock_guard lock(mutex_);
  const Event& e = event_of(event, DeviceCall::wait_event);
  if (!e.recorded) return;  // as with cuStreamWaitEvent
  Stream& s = streams_[stream];
  s.last_completion_us = std::max(s.last_completion_us, e.completes_at_us);
  auto wait = [&](StreamId other, std::uint64_t work) {
    if (other == stream) return;
    std::uint64_t& last = s.after[other];
    last = std::max(last, work);
  };
  wait(e.stream, e.target);
  for (const auto& [other, work] : e.after) wait(other, work);
}

void SimStreams::finish(StreamId stream, std::uint64_t work, const After& after) {
  std::uint64_t& done = streams_[stream].completed;
  done = std::max(done, work);
  for (const auto& [other, upto] : after) {
    std::uint64_t& other_done = streams_[other].completed;
    other_done = std::max(other_done, upto);
  }
}

SimStreams::Event& SimStreams::event_of(EventHandle event, DeviceCall call) {
  auto it = events_.find(event);
  if (it == events_.end())
    throw DeviceError(device_call_name(call), sim::kInvalidHandle, "unknown event " + std::to_string(event));
  return it->second;
}

bool SimStreams::event_complete(const Event& event, double now_us) {
  if (!event.recorded) return true;  // as with cuEventQuery
  if (now_us < event.completes_at_us) return false;  // the lagging GPU is not there yet
  if (complete_immediately_) return true;
  if (streams_[event.stream].completed < event.target) return false;
  for (const auto& [other, work] : event.after)
    if (streams_[other].completed < work) return false;
  return true;
}

bool SimStreams::query_event(EventHandle event, double now_us) {
  std::lock_guard lock(mutex_);
  return event_complete(event_of(event, DeviceCall::query_event), now_us);
}

double SimStreams::synchronize_event(EventHandle event) {
  std::lock_guard lock(mutex_);
  const Event& e = event_of(event, DeviceCall::synchronize_event);
  if (!e.recorded) return 0;
  // Waiting on the host lets the stream run up to the event (not past it).
  finish(e.stream, e.target, e.after);
  return e.completes_at_us;
}

bool SimStreams::capturing(StreamId stream) const {
  std::lock_guard lock(mutex_);
  return capturing_.contains(stream);
}

void SimStreams::set_capturing(StreamId stream, bool capturing) {
  std::lock_guard lock(mutex_);
  if (capturing) capturing_.insert(stream);
  else capturing_.erase(stream);
}

void SimStreams::submit_work(StreamId stream) {
  std::lock_guard lock(mutex_);
  Stream& s = streams_[stream];
  ++s.submitted;
  if (complete_immediately_) s.completed = s.submitted;
}

void SimStreams::complete_stream(StreamId stream) {
  std::lock_guard lock(mutex_);
  Stream& s = streams_[stream];
  finish(stream, s.submitted, s.after);
}

void SimStreams::complete_all_streams() {
  std::lock_guard lock(mutex_);
  for (auto& [stream, s] : streams_) s.completed = s.submitted;
}

std::uint64_t SimStreams::submitted(StreamId stream) const {
  std::lock_guard lock(mutex_);
  auto it = streams_.find(stream);
  return it == streams_.end() ? 0 : it->second.submitted;
}

bool SimStreams::ordered_after(StreamId waiter, StreamId stream, std::uint64_t work) const {
  std::lock_guard lock(mutex_);
  if (waiter == stream || work == 0) return true;
  auto s = streams_.find(stream);
  if (s != streams_.end() && s->second.completed >= work) return true;
  auto w = streams_.find(waiter);
  if (w == streams_.end()) return false;
  auto after = w->second.after.find(stream);
  return after != w->second.after.end() && after->second >= work;
}

void SimStreams::set_lag(double us) {
  if (!(us >= 0) || !std::isfinite(us)) {
    throw Error(Errc::invalid_argument, "SimStreams::set_lag: " + std::to_string(us) +
                                            " is not a finite number >= 0");
  }
  std::lock_guard lock(mutex_);
  lag_us_ = us;
}

double SimStreams::lag() const {
  std::lock_guard lock(mutex_);
  return lag_us_;
}

std::size_t SimStreams::live_events() const {
  std::lock_guard lock(mutex_);
  return events_.size();
}

}  // namespace gmem
