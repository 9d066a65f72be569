#include "engine/stream_tracker.hpp"

#include <algorithm>

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

void StreamTracker::record(std::uint32_t index) {
  Stream& s = streams_[index];
  if (!s.pending.empty() && s.pending.back().seq >= s.seq) return;
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

void StreamTracker::mark(std::uint32_t index) noexcept {
  if (capturing_) return;
  if (++streams_[index].marks_since_wait >= kMarksWithoutWait) streams_[index].marking = false;
  record_mark(index);
}

void StreamTracker::record_mark(std::uint32_t index) noexcept {
  if (capturing_) return;  // an event recorded into a capture is no progress of its stream
  try {
    // Marks nobody waits on are polled here, so that at most kMaxMarks stay pending.
    while (!streams_[index].pending.empty()) {
      const Pending p = streams_[index].pending.front();
      if (!device_.query_event(p.event)) break;
      complete_through(index, p.seq);
    }
    if (streams_[index].pending.size() < kMaxMarks) record(index);
  } catch (...) {  // a mark only shortens waits: without it, a wait runs to a later event
  }
}

void StreamTracker::complete_through(std::uint32_t index, std::uint64_t seq) {
  // Work up to `seq` is done, whatever other threads did while a wait had the lock released:
  // had they completed the event waited on and recorded it again (a later seq), the wait ran to
  // that later record, longer than needed, never too short. So what is still pending up to
  // `seq` goes, and nothing after it.
  Stream& s = streams_[index];
  while (!s.pending.empty() && s.pending.front().seq <= seq) {
    spare_events_.push_back(s.pending.front().event);
    s.pending.pop_front();
  }
  if (seq > s.completed) s.completed = seq;
}

bool StreamTracker::wait_for(std::uint32_t index, std::uint64_t seq, const EngineLock* unlocked) {
  if (done(index, seq)) return true;
  if (untouchable(index)) return false;
  streams_[index].marking = true;
  streams_[index].marks_since_wait = 0;
  const Pending p = covering(index, seq);
  if (!device_.query_event(p.event)) synchronize(p.event, unlocked);
  complete_through(index, p.seq);
  return done(index, seq);
}

const StreamTracker::Pending& StreamTracker::covering(std::uint32_t index, std::uint64_t seq) {
  // The first pending event at or after the free (the oldest that covers it), else a new one.
  for (const Pending& p : streams_[index].pending)
    if (p.seq >= seq) return p;
  record(index);
  return streams_[index].pending.back();
}

bool StreamTracker::order_after(std::uint32_t waiter, std::uint32_t index, std::uint64_t seq) {
  if (ordered(waiter, index, seq)) return true;
  if (untouchable(index) || untouchable(waiter)) return false;
  // Marks from now on keep the next handover's event close to its free (stamp).
  streams_[index].marking = true;
  streams_[index].marks_since_wait = 0;
  const Pending p = covering(index, seq);
  device_.wait_event(streams_[waiter].stream, p.event);
  Stream& w = streams_[waiter];
  for (Ordering& o : w.after) {
    if (o.index == index) {
      o.seq = std::max(o.seq, p.seq);
      return true;
    }
  }
  w.after[w.next_after] = Ordering{index, p.seq};
  w.next_after = (w.next_after + 1) % kOrderings;
  return true;
}

void StreamTracker::synchronize(EventHandle event, const EngineLock* unlocked) {
  if (unlocked != nullptr) unlocked->unlocked([&] { device_.synchronize_event(event); });
  else device_.synchronize_event(event);
}

bool StreamTracker::catch_up(std::uint32_t index, bool wait, const EngineLock* unlocked) {
  Stream& s = streams_[index];
  if (s.completed >= s.seq) return true;
  if (untouchable(index)) return false;
  record(index);
  // Read again at each step: while a wait has the lock released, other threads may add streams
  // (streams_ grows) and complete events.
  while (!streams_[index].pending.empty()) {
    const Pending p = streams_[index].pending.front();
    if (!device_.query_event(p.event)) {
      if (!wait) break;
      synchronize(p.event, unlocked);
    }
    complete_through(index, p.seq);
  }
  return streams_[index].completed >= streams_[index].seq;
}

}  // namespace gmem::detail
