#include "engine/stream_tracker.hpp"

namespace gmem::detail {

StreamTracker::~StreamTracker() {
  for (Stream& s : streams_)
    for (const Pending& p : s.pending) spare_events_.push_back(p.event);
  for (EventHandle e : spare_events_) {
    try {
      device_.destroy_event(e);
    } catch (...) {  // a destructor cannot report; the device is going away with us
    }
  }
}

std::uint32_t StreamTracker::add(StreamId stream) {
  streams_.push_back(Stream{stream, 0, 0, {}});
  return static_cast<std::uint32_t>(streams_.size() - 1);
}

bool StreamTracker::catch_up(std::uint32_t index, bool wait, const Unlocked* unlocked) {
  Stream& s = streams_[index];
  if (s.completed >= s.seq) return true;
  if (s.pending.empty() || s.pending.back().seq < s.seq) {
    EventHandle event;
    if (spare_events_.empty()) {
      event = device_.create_event();
    } else {
      event = spare_events_.back();
      spare_events_.pop_back();
    }
    try {
      device_.record_event(event, s.stream);
    } catch (...) {
      spare_events_.push_back(event);
      throw;
    }
    s.pending.push_back(Pending{event, s.seq});
  }
  // Read again at each step: while a wait has the lock released, other threads may add streams
  // (streams_ grows) and complete events.
  while (!streams_[index].pending.empty()) {
    const Pending p = streams_[index].pending.front();
    if (!device_.query_event(p.event)) {
      if (!wait) break;
      if (unlocked != nullptr) (*unlocked)([&] { device_.synchronize_event(p.event); });
      else device_.synchronize_event(p.event);
    }
    complete(index, p);
  }
  return streams_[index].completed >= streams_[index].seq;
}

void StreamTracker::complete(std::uint32_t index, const Pending& p) {
  Stream& s = streams_[index];
  // An event recycled and recorded again has a later seq: it is not the one waited on. (Its
  // waiter then waited for that later record: longer than needed, never too short.)
  if (s.pending.empty() || s.pending.front().event != p.event || s.pending.front().seq != p.seq)
    return;
  s.completed = p.seq;
  spare_events_.push_back(p.event);
  s.pending.pop_front();
}

}  // namespace gmem::detail
