// SimulatedDevice: each Device call counts itself in the ledger (which may fail it as told),
// then acts on the memory or stream model, under mutex_ (see the header for the lock order).
#include "gmem/sim_device.hpp"

#include <cmath>
#include <string>
#include <utility>

#include "device/sim_results.hpp"
#include "gmem/error.hpp"

namespace gmem {

SimDeviceOptions SimulatedDevice::checked(SimDeviceOptions options) {
  if (!sim::is_power_of_two(options.granularity)) {
    throw Error(Errc::invalid_argument, "SimulatedDevice: granularity " +
                                            std::to_string(options.granularity) +
                                            " is not a power of two");
  }
  if (!(options.lag_us >= 0) || !std::isfinite(options.lag_us)) {
    throw Error(Errc::invalid_argument, "SimulatedDevice: lag_us " + std::to_string(options.lag_us) +
                                            " is not a finite number >= 0");
  }
  if (options.used_by_others > options.capacity) {
    throw Error(Errc::invalid_argument, "SimulatedDevice: used_by_others " +
                                            format_bytes(options.used_by_others) +
                                            " exceeds capacity " + format_bytes(options.capacity));
  }
  return options;
}

SimulatedDevice::SimulatedDevice(SimDeviceOptions options)
    : options_(checked(std::move(options))),
      memory_(options_.capacity, options_.granularity, options_.used_by_others),
      streams_(options_.streams_complete_immediately, options_.lag_us) {}

SimulatedDevice::~SimulatedDevice() = default;

DeviceMemInfo SimulatedDevice::mem_info() {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::mem_info);
  return memory_.mem_info();
}

DevicePtr SimulatedDevice::reserve_address(std::size_t size, std::size_t alignment) {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::reserve_address);
  return memory_.reserve_address(size, alignment);
}

void SimulatedDevice::release_address(DevicePtr base, std::size_t size) {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::release_address);
  memory_.release_address(base, size);
}

ChunkHandle SimulatedDevice::create_chunk(std::size_t size) {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::create_chunk, 1, memory_.granules_in(size));
  return memory_.create_chunk(size);
}

void SimulatedDevice::release_chunk(ChunkHandle chunk) {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::release_chunk, 1, memory_.chunk_granules(chunk));
  memory_.release_chunk(chunk);
}

void SimulatedDevice::map(DevicePtr va, std::size_t size, ChunkHandle chunk) {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::map, 1, memory_.granules_in(size));
  memory_.map(va, size, chunk);
}

void SimulatedDevice::unmap(DevicePtr va, std::size_t size) {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::unmap, memory_.mappings_in(va, size), memory_.granules_in(size));
  memory_.unmap(va, size);
}

void SimulatedDevice::set_access(DevicePtr va, std::size_t size) {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::set_access, memory_.mappings_in(va, size), memory_.granules_in(size));
  memory_.set_access(va, size);
}

EventHandle SimulatedDevice::create_event() {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::create_event);
  return streams_.create_event();
}

void SimulatedDevice::destroy_event(EventHandle event) {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::destroy_event);
  streams_.destroy_event(event);
}

void SimulatedDevice::record_event(EventHandle event, StreamId stream) {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::record_event);
  streams_.record_event(event, stream, ledger_.host_time());
}

bool SimulatedDevice::query_event(EventHandle event) {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::query_event);
  return streams_.query_event(event, ledger_.host_time());
}

void SimulatedDevice::synchronize_event(EventHandle event) {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::synchronize_event);
  // The stream runs up to the event, and the host's clock runs on meanwhile.
  ledger_.wait_until(streams_.synchronize_event(event));
}

void SimulatedDevice::wait_event(StreamId stream, EventHandle event) {
  std::lock_guard lock(mutex_);
  ledger_.count(DeviceCall::wait_event);
  streams_.wait_event(stream, event);
}

bool SimulatedDevice::stream_capturing(StreamId stream) { return streams_.capturing(stream); }

double SimulatedDevice::host_time() const { return ledger_.host_time(); }

Device::CallTimes SimulatedDevice::call_times() const { return ledger_.call_times(); }

}  // namespace gmem
