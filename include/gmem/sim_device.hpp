// A simulated GPU: no memory behind it (an 80 GiB device costs nothing), strict about misuse
// (mapping outside a reservation, double maps, releasing a mapped chunk all throw), counts every
// call, can fail the Nth call of a kind, and models streams so that stream ordering can be tested.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

#include "gmem/device.hpp"

namespace gmem {

enum class DeviceCall : int {
  reserve_address,
  release_address,
  create_chunk,
  release_chunk,
  map,
  unmap,
  set_access,
  create_event,
  destroy_event,
  record_event,
  query_event,
  synchronize_event,
  mem_info,
  count_  // number of kinds
};
const char* device_call_name(DeviceCall call) noexcept;

struct SimDeviceOptions {
  std::size_t capacity = std::size_t{80} << 30;    // total device memory
  std::size_t granularity = std::size_t{2} << 20;  // physical page size
  std::size_t used_by_others = 0;                  // memory held outside gmem (context, NCCL, ...)
  // When true, streams finish their work at once: every event is complete when recorded.
  // When false, work on a stream completes only through complete_stream() or a synchronize.
  bool streams_complete_immediately = true;
  std::string name = "simulated";
};

class SimulatedDevice final : public Device {
 public:
  explicit SimulatedDevice(SimDeviceOptions options = {});
  ~SimulatedDevice() override;

  std::size_t granularity() const override { return options_.granularity; }
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
  void synchronize_event(EventHandle event) override;

  // --- for tests and replay ---
  std::uint64_t calls(DeviceCall call) const;
  void reset_call_counts();
  // Make the nth call of `call` from now on (1 = the next one) throw a DeviceError. When
  // `out_of_memory` is set the error reads as the device running out of memory.
  void fail_call(DeviceCall call, std::uint64_t nth = 1, bool out_of_memory = false);
  // Work submitted to `stream` (a kernel launch, say): events recorded after it wait for it.
  void submit_work(StreamId stream);
  // All work submitted to `stream` so far has finished.
  void complete_stream(StreamId stream);
  void complete_all_streams();

  std::size_t chunk_bytes() const;     // physical memory created and not released
  std::size_t mapped_bytes() const;    // bytes of virtual address space that are mapped
  std::size_t reserved_address_bytes() const;
  bool is_mapped(DevicePtr va) const;  // the granule containing va is mapped
  bool is_accessible(DevicePtr va) const;  // mapped and set_access'ed
  ChunkHandle chunk_at(DevicePtr va) const;  // 0 when unmapped
  std::size_t live_events() const;

 private:
  struct Failure {
    std::uint64_t at = 0;  // absolute call number that fails; 0 = none
    bool out_of_memory = false;
  };
  struct Granule {
    ChunkHandle chunk = 0;
    std::size_t offset = 0;
    bool accessible = false;
  };
  struct Event {
    StreamId stream = 0;
    std::uint64_t target = 0;  // work item on `stream` this event waits for
    bool recorded = false;
  };
  void count(DeviceCall call);  // counts, and throws if this call is set to fail
  void check_reserved(DevicePtr va, std::size_t size, const char* call) const;
  void check_granular(std::size_t value, const char* what, const char* call) const;

  SimDeviceOptions options_;
  mutable std::mutex mutex_;
  std::array<std::uint64_t, static_cast<int>(DeviceCall::count_)> calls_{};
  std::array<Failure, static_cast<int>(DeviceCall::count_)> failures_{};
  DevicePtr next_address_;
  std::map<DevicePtr, std::size_t> reservations_;         // base -> size
  std::unordered_map<ChunkHandle, std::size_t> chunks_;   // handle -> size
  std::unordered_map<ChunkHandle, std::size_t> chunk_maps_;  // handle -> times mapped
  ChunkHandle next_chunk_ = 1;
  std::size_t chunk_bytes_ = 0;
  std::unordered_map<DevicePtr, Granule> granules_;       // granule-aligned va -> mapping
  std::unordered_map<EventHandle, Event> events_;
  EventHandle next_event_ = 1;
  std::unordered_map<StreamId, std::uint64_t> submitted_, completed_;
};

}  // namespace gmem
