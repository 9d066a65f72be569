// A simulated GPU: the Device interface (device.hpp) over three parts, each in its own header:
//   SimMemory      address reservations, chunks and mappings, strict about misuse (mapping
//                  outside a reservation, double maps, releasing a mapped chunk all throw);
//   SimStreams     streams, events and the GPU lagging behind the host, so that stream ordering
//                  can be tested;
//   SimCallLedger  every call counted and priced (kDeviceCallPrices), the Nth call of a kind made
//                  to fail, and the modelled host clock with the time spent waiting for streams.
// Each Device call counts itself in the ledger, then acts on a model. Tests and replay reach the
// parts' controls and queries through memory(), streams() and ledger().
#pragma once

#include <cstddef>
#include <mutex>
#include <string>

#include "gmem/device.hpp"
#include "gmem/device_calls.hpp"
#include "gmem/sim_call_ledger.hpp"
#include "gmem/sim_memory.hpp"
#include "gmem/sim_streams.hpp"

namespace gmem {

struct SimDeviceOptions {
  std::size_t capacity = std::size_t{80} << 30;    // total device memory
  std::size_t granularity = std::size_t{2} << 20;  // physical page size
  std::size_t used_by_others = 0;                  // memory held outside gmem (context, NCCL, ...)
  // When true, streams finish their work at once: every event is complete when recorded.
  // When false, work on a stream completes only through SimStreams::complete_stream() or a
  // synchronize.
  bool streams_complete_immediately = true;
  // The host-ahead model: the GPU runs lag_us (modelled microseconds) behind the host on every
  // stream. An event recorded at host time t completes at t + lag_us (never before an event
  // recorded earlier on its stream), as seen by the host clock (SimCallLedger). 0: events are
  // complete when recorded. It combines with streams_complete_immediately = false: an event is
  // then complete when its work is done and its time has come. SimStreams::set_lag changes it.
  double lag_us = 0;
  std::string name = "simulated";
};

class SimulatedDevice final : public Device {
 public:
  // Throws Error (invalid_argument) for options no device could have.
  explicit SimulatedDevice(SimDeviceOptions options = {});
  ~SimulatedDevice() override;

  std::size_t granularity() const override { return memory_.granularity(); }
  DeviceMemInfo mem_info() override;
  std::string name() const override { return options_.name; }

  DevicePtr reserve_address(std::size_t size, std::size_t alignment) override;
  void release_address(DevicePtr base, std::size_t size) override;
  ChunkHandle create_chunk(std::size_t size) override;
  void release_chunk(ChunkHandle chunk) override;
  void map(DevicePtr va, std::size_t size, ChunkHandle chunk) override;
  void unmap(DevicePtr va, std::size_t size) override;
  void set_access(DevicePtr va, std::size_t size) override;
  EventHandle create_event() override;
  void destroy_event(EventHandle event) override;
  void record_event(EventHandle event, StreamId stream) override;
  bool query_event(EventHandle event) override;
  // Moves the host clock on to the event's completion: the host waited.
  void synchronize_event(EventHandle event) override;
  void wait_event(StreamId stream, EventHandle event) override;  // SimStreams::wait_event
  bool stream_capturing(StreamId stream) override;
  double host_time() const override;      // the ledger's modelled clock
  CallTimes call_times() const override;  // the ledger's modelled call and wait time

  // --- the parts, for tests and replay ---
  // Calls made on a part directly are neither counted nor priced: only the Device calls above
  // go through the ledger. Memory changes only through them, so memory() is for inspection.
  const SimMemory& memory() const { return memory_; }
  SimStreams& streams() { return streams_; }
  const SimStreams& streams() const { return streams_; }
  SimCallLedger& ledger() { return ledger_; }
  const SimCallLedger& ledger() const { return ledger_; }

 private:
  // Validates `options` (granularity, lag_us, used_by_others, in that order) and returns them.
  static SimDeviceOptions checked(SimDeviceOptions options);

  // As constructed, checked(): the parts are made from it, and keep what changes (the lag).
  const SimDeviceOptions options_;
  // Serializes the Device calls. Each counts itself in the ledger and then acts on a model, often
  // priced by that model's state (an unmap by the mappings it removes) or timed by the clock (a
  // record); holding it makes each call one step as the others see it. Lock order: mutex_, then
  // one part's own mutex at a time (the parts' mutexes are leaves). Tests' calls on the parts
  // take the part's mutex only.
  mutable std::mutex mutex_;
  SimCallLedger ledger_;  // counts, prices and fails every Device call; keeps the host clock
  SimMemory memory_;      // what the memory calls act on
  SimStreams streams_;    // what the event calls act on
};

}  // namespace gmem
