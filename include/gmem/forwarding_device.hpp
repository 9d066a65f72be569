// A Device that forwards every call to another Device: the base of device decorators (a device
// that records, checks, gates or fails some calls of a real or simulated one), like RMM's
// resource adaptors. A decorator derives from it and overrides only the calls it changes; the
// rest reach the inner device unchanged, so adding a call to Device means adding it here once
// rather than in every decorator.
//
// Every virtual of Device is forwarded, those with a default in Device too: a decorator must
// behave as the device it wraps, and Device's defaults are what a device that lacks the call
// does, not what the inner one does. Falling back to them would be wrong for each:
//   index             0, where the inner GPU may be another;
//   wait_event        a host wait, where the inner device waits on the GPU;
//   stream_capturing  false, so that the engine would query an event inside a capture and
//                     invalidate it;
//   host_time         the steady clock, where SimulatedDevice keeps a modelled one;
//   call_times        zero, where the inner device measures or models them.
// So a decorator that overrides synchronize_event does not see wait_event's waits: the inner
// device's wait_event is called, not Device's default that synchronizes through this object.
//
// It holds a reference: the inner device must outlive it. A decorator that owns its inner device
// constructs it before this base (a base listed first, not a member).
#pragma once

#include <cstddef>
#include <string>

#include "gmem/device.hpp"

namespace gmem {

class ForwardingDevice : public Device {
 public:
  explicit ForwardingDevice(Device& inner) noexcept : inner_(inner) {}
  // Copying would make a second decorator over the same inner device, sharing its state by
  // accident (and a decorator's own state, a book or a gate, would be copied apart from it).
  ForwardingDevice(const ForwardingDevice&) = delete;
  ForwardingDevice& operator=(const ForwardingDevice&) = delete;

  // The device the calls are forwarded to.
  Device& inner() noexcept { return inner_; }
  const Device& inner() const noexcept { return inner_; }

  // Device's calls, each forwarded as it is (device.hpp says what each does).
  std::size_t granularity() const override { return inner_.granularity(); }
  DeviceMemInfo mem_info() override { return inner_.mem_info(); }
  std::string name() const override { return inner_.name(); }
  int index() const override { return inner_.index(); }

  DevicePtr reserve_address(std::size_t size, std::size_t alignment) override {
    return inner_.reserve_address(size, alignment);
  }
  void release_address(DevicePtr base, std::size_t size) override {
    inner_.release_address(base, size);
  }

  ChunkHandle create_chunk(std::size_t size) override { return inner_.create_chunk(size); }
  void release_chunk(ChunkHandle chunk) override { inner_.release_chunk(chunk); }

  void map(DevicePtr va, std::size_t size, ChunkHandle chunk) override {
    inner_.map(va, size, chunk);
  }
  void unmap(DevicePtr va, std::size_t size) override { inner_.unmap(va, size); }
  void set_access(DevicePtr va, std::size_t size) override { inner_.set_access(va, size); }

  EventHandle create_event() override { return inner_.create_event(); }
  void destroy_event(EventHandle event) override { inner_.destroy_event(event); }
  void record_event(EventHandle event, StreamId stream) override {
    inner_.record_event(event, stream);
  }
  bool query_event(EventHandle event) override { return inner_.query_event(event); }
  void synchronize_event(EventHandle event) override { inner_.synchronize_event(event); }
  void wait_event(StreamId stream, EventHandle event) override {
    inner_.wait_event(stream, event);
  }
  bool stream_capturing(StreamId stream) override { return inner_.stream_capturing(stream); }

  double host_time() const override { return inner_.host_time(); }
  CallTimes call_times() const override { return inner_.call_times(); }

 private:
  Device& inner_;
};

}  // namespace gmem
