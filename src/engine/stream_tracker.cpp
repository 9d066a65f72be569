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

bool StreamTracker::catch_up(std::uint32_t index, bool wait) {
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
  while (!s.pending.empty()) {
    Pending& p = s.pending.front();
    if (!device_.query_event(p.event)) {
      if (!wait) break;
      device_.synchronize_event(p.event);
    }
    s.completed = p.seq;
    spare_events_.push_back(p.event);
    s.pending.pop_front();
  }
  return s.completed >= s.seq;
}

}  // namespace gmem::detail
