// How far each stream's work has progressed, as seen through events: memory freed on a stream
// is stamped with the stream's free sequence number, and may be handed to another stream once
// an event recorded after that free has completed, or once the other stream has been made to
// wait for such an event on the GPU (order_after). Events are recorded lazily, only when
// another stream wants the memory, so a single-stream program never touches them.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <vector>

#include "engine/engine_lock.hpp"
#include "gmem/device.hpp"

namespace gmem::detail {

class StreamTracker {
 public:

  explicit StreamTracker(Device& device) : device_(device) {}
  ~StreamTracker();  // destroys the events still pending

  // Registers a stream (once); returns its index.
  std::uint32_t add(StreamId stream);
  StreamId stream(std::uint32_t index) const { return streams_[index].stream; }
  std::size_t size() const { return streams_.size(); }

  // Stamps a free on stream `index`: the returned sequence number identifies it. Once the stream
  // has been waited for (wait_for), every kMarkEvery-th free also records an event (mark), so
  // that the next wait for one free can stop at the first event after it; kMarksWithoutWait
  // marks with no wait between them stop the marking (a program whose layout has settled makes
  // no driver call at all).
  std::uint64_t stamp(std::uint32_t index) {
    Stream& s = streams_[index];
    const std::uint64_t seq = ++s.seq;
    if (s.marking && seq % kMarkEvery == 0) [[unlikely]] mark(index);
    return seq;
  }
  // stamp() for a free whose memory other streams hold back for a while (record_stream), with an
  // event recorded right after it (none during a capture, or with kMaxMarks pending): once they
  // let the memory go, whether this stream is done with it is known from the free itself, not
  // from the first event recorded after the work queued since (a side stream's next copies).
  std::uint64_t stamp_marked(std::uint32_t index) {
    const std::uint64_t seq = ++streams_[index].seq;
    record_mark(index);
    return seq;
  }
  // Whether the work on stream `index` up to free `seq` is known to be done (no device call).
  bool done(std::uint32_t index, std::uint64_t seq) const { return seq <= streams_[index].completed; }
  // Whether the work stream `waiter` submits from now on runs after stream `index`'s work up to
  // free `seq`: the same stream, that work done, or `waiter` made to wait for it (order_after).
  // What memory needs before it moves to `waiter` (not before it is unmapped: that needs done).
  bool ordered(std::uint32_t waiter, std::uint32_t index, std::uint64_t seq) const {
    if (waiter == index || done(index, seq)) return true;
    for (const Ordering& o : streams_[waiter].after)
      if (o.index == index && o.seq >= seq) return true;
    return false;
  }
  // Makes stream `waiter` wait on the GPU for stream `index`'s work up to free `seq`: the first
  // event recorded after that free, else a new one (Device::wait_event). The host does not wait;
  // the waiter's later work does, for as long as the other stream still needs the memory. Returns
  // false, with no device call, when either stream is being captured (set_capturing).
  bool order_after(std::uint32_t waiter, std::uint32_t index, std::uint64_t seq);
  // Records an event covering every free so far (if none does yet) and polls the pending
  // events; with `wait`, blocks until the stream has caught up. Returns true when all of the
  // stream's frees so far are done. With `unlocked`, the wait is made through it: other threads
  // may use the tracker meanwhile (and complete the very event waited on).
  bool catch_up(std::uint32_t index, bool wait, const EngineLock* unlocked = nullptr);
  // Blocks until stream `index` has done its work up to free `seq`, and no further than the
  // first event recorded after it: memory freed a while ago (a page that must be unmapped before
  // a block can use it) is waited for only as long as the GPU still needs it, not until the
  // stream has run out of work. Returns true when it is done (a device error throws); false
  // only for a capturing stream (set_capturing), whose work is not known to be done.
  bool wait_for(std::uint32_t index, std::uint64_t seq, const EngineLock* unlocked = nullptr);

  // A CUDA graph is being captured (or no longer). An event recorded on a capturing stream is a
  // node of the graph, completed at once, which would read as the stream having caught up, and
  // querying it invalidates the capture. So meanwhile frees make no marks, and catch_up and
  // wait_for make no event call for a stream the device says is capturing: they say only what is
  // already known, work not known to be done taken as not done. Other streams are waited for as
  // ever (the device makes those calls in relaxed capture mode, which a global-mode capture on
  // another thread allows: gpu/unmap_in_capture.cu).
  void set_capturing(bool capturing) { capturing_ = capturing; }


  // Frees between two marks, and the most marks pending on a stream.
  static constexpr std::uint64_t kMarkEvery = 64;
  static constexpr std::size_t kMaxMarks = 64;
  static constexpr std::uint32_t kMarksWithoutWait = 16;

 private:
  struct Pending {
    EventHandle event;
    std::uint64_t seq;
  };
  // Stream `index`'s work up to free `seq` comes before this stream's (order_after).
  struct Ordering {
    std::uint32_t index = ~0u;
    std::uint64_t seq = 0;
  };
  // Orderings a stream remembers (the newest replaces the oldest): one per stream it took memory
  // from lately is what a handover needs; forgetting one costs another wait_event, never safety.
  static constexpr std::size_t kOrderings = 4;
  struct Stream {
    StreamId stream = 0;
    std::uint64_t seq = 0;        // last stamped free
    std::uint64_t completed = 0;  // frees up to here are done
    std::deque<Pending> pending;  // events in record order
    bool marking = false;         // waited for lately: its frees are marked (stamp)
    std::uint32_t marks_since_wait = 0;
    std::array<Ordering, kOrderings> after{};  // orderings made (order_after)
    std::uint32_t next_after = 0;              // the slot the next one takes
  };
  // During a capture, whether stream `index` is the one captured (no event call may touch it).
  bool untouchable(std::uint32_t index) {
    return capturing_ && device_.stream_capturing(streams_[index].stream);
  }
  // A mark of stamp(): counted towards kMarksWithoutWait, then record_mark.
  void mark(std::uint32_t index) noexcept;
  // Records an event covering the stream's frees so far, after completing the pending events
  // that are done; skipped (never throws) during a capture, when kMaxMarks are pending or when
  // the device fails.
  void record_mark(std::uint32_t index) noexcept;
  // Records an event covering every free so far, unless the newest pending one does.
  void record(std::uint32_t index);
  // The oldest pending event covering free `seq` of stream `index`, recorded if none is.
  const Pending& covering(std::uint32_t index, std::uint64_t seq);
  // Work up to free `seq` is done: the pending events up to it are done too, and go spare.
  void complete_through(std::uint32_t index, std::uint64_t seq);
  // Blocks until `event` completes, through `unlocked` when given (the caller's lock released).
  void synchronize(EventHandle event, const EngineLock* unlocked);

  Device& device_;
  std::vector<Stream> streams_;
  std::vector<EventHandle> spare_events_;
  bool capturing_ = false;
};

}  // namespace gmem::detail
