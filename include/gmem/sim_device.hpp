// A simulated GPU: no memory behind it (an 80 GiB device costs nothing), strict about misuse
// (mapping outside a reservation, double maps, releasing a mapped chunk all throw), counts every
// call, can fail the Nth call of a kind, and models streams so that stream ordering can be tested.
// It also keeps modelled time: a host clock, the GPU lagging behind it (lag_us), and what the
// host spends in device calls (kDeviceCallPrices) and waiting for streams.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

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
  wait_event,
  count_  // number of kinds
};
const char* device_call_name(DeviceCall call) noexcept;

// What each device call costs the host, in modelled microseconds. The driver prices a memory call
// per chunk it creates or releases and per mapping it maps, sets access on or unmaps, almost
// whatever the chunk's size (gpu/chunk_size_calls.cu, H100, driver 580: cuMemSetAccess took
// 28 us for a 2 MiB chunk and 31 us for a 128 MiB one; one call over 2,048 mappings of 2 MiB
// took as long as 2,048 calls). So a call costs `us` per unit (a chunk created or released, a
// map call, each mapping a set-access or unmap covers), as measured for 2 MiB, plus `further_us`
// for each further granule of those chunks or mappings: cuMemRelease of a 1 GiB chunk 16 + 511 x
// 0.76 = 404 us (measured 399), cuMemCreate 35 (36). The event calls were not measured alone:
// 1 us for record, create, destroy and synchronize (the call; the wait is counted apart) and
// 0.5 us for a query are estimates of a driver call that does no memory management. Address
// reservations and cuMemGetInfo are made a few times a run and are not priced.
struct DeviceCallPrice {
  DeviceCall call;
  double us;          // per chunk, map call or mapping covered (one per call for the others)
  double further_us;  // per granule of those beyond each one's first
};
inline constexpr DeviceCallPrice kDeviceCallPrices[] = {
    {DeviceCall::reserve_address, 0.0, 0.0},    // cuMemAddressReserve: not priced
    {DeviceCall::release_address, 0.0, 0.0},    // cuMemAddressFree: not priced
    {DeviceCall::create_chunk, 15.0, 0.04},     // cuMemCreate, per chunk
    {DeviceCall::release_chunk, 16.0, 0.76},    // cuMemRelease, per chunk
    {DeviceCall::map, 2.0, 0.0},                // cuMemMap, per call (one chunk)
    {DeviceCall::unmap, 22.0, 0.01},            // cuMemUnmap, per mapping in the range
    {DeviceCall::set_access, 38.0, 0.04},       // cuMemSetAccess, per mapping in the range
    {DeviceCall::create_event, 1.0, 0.0},       // cuEventCreate: estimated
    {DeviceCall::destroy_event, 1.0, 0.0},      // cuEventDestroy: estimated
    {DeviceCall::record_event, 1.0, 0.0},       // cuEventRecord: estimated
    {DeviceCall::query_event, 0.5, 0.0},        // cuEventQuery: estimated
    {DeviceCall::synchronize_event, 1.0, 0.0},  // cuEventSynchronize, the wait apart: estimated
    {DeviceCall::mem_info, 0.0, 0.0},           // cuMemGetInfo: not priced
    {DeviceCall::wait_event, 1.0, 0.0},         // cuStreamWaitEvent: estimated
};
// The table is indexed by DeviceCall: one row per kind, in the enum's order.
constexpr bool device_call_prices_in_order() {
  constexpr auto kinds = static_cast<std::size_t>(DeviceCall::count_);
  if (std::size(kDeviceCallPrices) != kinds) return false;
  for (std::size_t i = 0; i < kinds; ++i)
    if (static_cast<std::size_t>(kDeviceCallPrices[i].call) != i) return false;
  return true;
}
static_assert(device_call_prices_in_order(), "kDeviceCallPrices: one row per DeviceCall, in order");

struct SimDeviceOptions {
  std::size_t capacity = std::size_t{80} << 30;    // total device memory
  std::size_t granularity = std::size_t{2} << 20;  // physical page size
  std::size_t used_by_others = 0;                  // memory held outside gmem (context, NCCL, ...)
  // When true, streams finish their work at once: every event is complete when recorded.
  // When false, work on a stream completes only through complete_stream() or a synchronize.
  bool streams_complete_immediately = true;
  // The host-ahead model: the GPU runs lag_us (modelled microseconds) behind the host on every
  // stream. An event recorded at host time t completes at t + lag_us (never before an event
  // recorded earlier on its stream), as seen by the host clock (set_host_time). 0: events are
  // complete when recorded. It combines with streams_complete_immediately = false: an event is
  // then complete when its work is done and its time has come.
  double lag_us = 0;
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
  // The stream's later events complete no earlier than `event`, and (streams completing only
  // when told) only once the work it waits for is done; complete_stream and synchronize_event
  // finish that work too, as the GPU would have.
  void wait_event(StreamId stream, EventHandle event) override;
  bool stream_capturing(StreamId stream) override;
  // A capture begins (true) or ends on `stream`, as stream_capturing() will say.
  void set_stream_capturing(StreamId stream, bool capturing);

  // --- for tests and replay ---
  std::uint64_t calls(DeviceCall call) const;
  void reset_call_counts();  // and modelled_call_us(), which follows the counts
  // Make the nth call of `call` from now on (1 = the next one) throw a DeviceError. When
  // `out_of_memory` is set the error reads as the device running out of memory.
  void fail_call(DeviceCall call, std::uint64_t nth = 1, bool out_of_memory = false);
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

  // --- modelled time (microseconds) ---
  // The host clock: starts at 0, never runs backwards (an earlier time is ignored). A replay
  // advances it by the gaps between its trace's timestamps; synchronize_event moves it on to the
  // event's completion (a wait), and the trace's later events follow from there.
  void set_host_time(double us);
  void advance_host_time(double us);  // by `us` more (negative: ignored)
  double host_time() const override;
  // The GPU's lag behind the host for events recorded from now on (SimDeviceOptions::lag_us): a
  // busier phase, say. An event never completes before one recorded earlier on its stream.
  void set_lag(double us);
  double lag() const;
  // Host time spent in device calls, priced by kDeviceCallPrices (failed calls too). It is an
  // account, not a clock: the host clock does not move, so calls and waits add up without one
  // shortening the other.
  double modelled_call_us() const;
  // Host time spent in synchronize_event waiting for a stream to reach the event.
  double modelled_wait_us() const;
  CallTimes call_times() const override;  // the two above

  std::size_t chunk_bytes() const;     // physical memory created and not released
  std::size_t mapped_bytes() const;    // bytes of virtual address space that are mapped
  std::size_t max_chunk_maps() const;  // the most addresses one chunk is mapped at now (aliases)
  std::size_t reserved_address_bytes() const;
  bool is_mapped(DevicePtr va) const;  // the granule containing va is mapped
  bool is_accessible(DevicePtr va) const;  // mapped and set_access'ed
  ChunkHandle chunk_at(DevicePtr va) const;  // 0 when unmapped
  // The chunk mapped at `va` and the offset into it that `va` reaches ({0, 0} when unmapped).
  std::pair<ChunkHandle, std::size_t> physical_at(DevicePtr va) const;
  std::size_t live_events() const;
  // Unmaps of a chunk's mapping while another mapping of it awaited set_access. On an H100 a
  // thread's cuMemUnmap landing between another thread's cuMemMap and cuMemSetAccess of the same
  // chunk left the chunk broken: its next cuMemMap failed with CUDA_ERROR_UNKNOWN. This device
  // does the same, whichever thread the calls come from: the chunk's next map throws.
  std::uint64_t unsafe_alias_unmaps() const;

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
  // Work items of other streams that a stream's work (or an event) comes after: stream ->
  // the last such item.
  using After = std::map<StreamId, std::uint64_t>;
  struct Event {
    StreamId stream = 0;
    std::uint64_t target = 0;  // work item on `stream` this event waits for
    double completes_at_us = 0;  // host time at which the lagging GPU reaches it
    bool recorded = false;
    After after;  // its stream's waits when it was recorded
  };
  struct Stream {
    std::uint64_t submitted = 0, completed = 0;  // work items (submit_work, complete_stream)
    double last_completion_us = 0;  // of the latest event recorded on it
    After after;                    // what its work from now on waits for (wait_event)
  };
  void finish(StreamId stream, std::uint64_t work, const After& after);  // work done, and its waits
  // Counts, prices (`units` chunks or mappings of `granules` in all), and throws if this call is
  // set to fail.
  void count(DeviceCall call, std::size_t units = 1, std::size_t granules = 1);
  std::size_t granules_in(std::size_t bytes) const { return bytes / options_.granularity; }
  // Mappings that start in [va, va + size): what cuMemSetAccess and cuMemUnmap are priced by.
  std::size_t mappings_in(DevicePtr va, std::size_t size) const;
  bool event_complete(const Event& event);
  Event& event_of(EventHandle event, DeviceCall call);  // throws DeviceError for an unknown one
  void check_reserved(DevicePtr va, std::size_t size, const char* call) const;
  void check_granular(std::size_t value, const char* what, const char* call) const;

  SimDeviceOptions options_;
  mutable std::mutex mutex_;
  std::array<std::uint64_t, static_cast<int>(DeviceCall::count_)> calls_{};
  double host_time_us_ = 0;
  double lag_us_;
  double call_us_ = 0;
  double wait_us_ = 0;
  std::array<Failure, static_cast<int>(DeviceCall::count_)> failures_{};
  DevicePtr next_address_;
  std::map<DevicePtr, std::size_t> reservations_;         // base -> size
  std::unordered_map<ChunkHandle, std::size_t> chunks_;   // handle -> size
  std::unordered_map<ChunkHandle, std::size_t> chunk_maps_;  // handle -> times mapped
  std::unordered_map<ChunkHandle, std::size_t> awaiting_access_;  // handle -> its maps not set_access'ed
  std::unordered_set<ChunkHandle> broken_chunks_;  // see unsafe_alias_unmaps()
  std::uint64_t unsafe_alias_unmaps_ = 0;
  ChunkHandle next_chunk_ = 1;
  std::size_t chunk_bytes_ = 0;
  std::unordered_map<DevicePtr, Granule> granules_;       // granule-aligned va -> mapping
  std::unordered_map<EventHandle, Event> events_;
  EventHandle next_event_ = 1;
  std::unordered_map<StreamId, Stream> streams_;
  std::unordered_set<StreamId> capturing_;  // set_stream_capturing
};

}  // namespace gmem
