// SimulatedDevice: CUDA's virtual memory API as bookkeeping only. Every misuse that the real
// driver would reject (or that would corrupt memory on a real GPU) throws a DeviceError here, so
// engine bugs surface in tests instead of on the GPU.
#include "gmem/sim_device.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>

#include "gmem/error.hpp"

namespace gmem {

namespace {

// CUDA driver result codes used for the errors we raise.
constexpr int kInvalidValue = 1;      // CUDA_ERROR_INVALID_VALUE
constexpr int kOutOfMemory = 2;       // CUDA_ERROR_OUT_OF_MEMORY
constexpr int kInvalidHandle = 400;   // CUDA_ERROR_INVALID_HANDLE
constexpr int kUnknown = 999;         // CUDA_ERROR_UNKNOWN

// Fake addresses start high, like real device pointers, so 0 is never a valid one.
constexpr DevicePtr kFirstAddress = 0x7f0000000000;

std::string hex(std::uintptr_t value) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "0x%jx", static_cast<std::uintmax_t>(value));
  return buffer;
}

bool is_power_of_two(std::size_t value) { return value != 0 && (value & (value - 1)) == 0; }

int index_of(DeviceCall call) { return static_cast<int>(call); }

}  // namespace

const char* device_call_name(DeviceCall call) noexcept {
  switch (call) {
    case DeviceCall::reserve_address: return "cuMemAddressReserve";
    case DeviceCall::release_address: return "cuMemAddressFree";
    case DeviceCall::create_chunk: return "cuMemCreate";
    case DeviceCall::release_chunk: return "cuMemRelease";
    case DeviceCall::map: return "cuMemMap";
    case DeviceCall::unmap: return "cuMemUnmap";
    case DeviceCall::set_access: return "cuMemSetAccess";
    case DeviceCall::create_event: return "cuEventCreate";
    case DeviceCall::destroy_event: return "cuEventDestroy";
    case DeviceCall::record_event: return "cuEventRecord";
    case DeviceCall::query_event: return "cuEventQuery";
    case DeviceCall::synchronize_event: return "cuEventSynchronize";
    case DeviceCall::mem_info: return "cuMemGetInfo";
    case DeviceCall::wait_event: return "cuStreamWaitEvent";
    case DeviceCall::count_: break;
  }
  return "unknown";
}

SimulatedDevice::SimulatedDevice(SimDeviceOptions options)
    : options_(std::move(options)),
      lag_us_(options_.lag_us),
      next_address_(kFirstAddress) {
  if (!is_power_of_two(options_.granularity)) {
    throw Error(Errc::invalid_argument, "SimulatedDevice: granularity " +
                                            std::to_string(options_.granularity) +
                                            " is not a power of two");
  }
  if (!(options_.lag_us >= 0) || !std::isfinite(options_.lag_us)) {
    throw Error(Errc::invalid_argument, "SimulatedDevice: lag_us " + std::to_string(options_.lag_us) +
                                            " is not a finite number >= 0");
  }
  if (options_.used_by_others > options_.capacity) {
    throw Error(Errc::invalid_argument, "SimulatedDevice: used_by_others " +
                                            format_bytes(options_.used_by_others) +
                                            " exceeds capacity " + format_bytes(options_.capacity));
  }
}

SimulatedDevice::~SimulatedDevice() = default;

void SimulatedDevice::count(DeviceCall call, std::size_t units, std::size_t granules) {
  const int i = index_of(call);
  const std::uint64_t number = ++calls_[i];
  const DeviceCallPrice& price = kDeviceCallPrices[i];
  units = std::max<std::size_t>(units, 1);  // a call that does nothing costs as one
  call_us_ += price.us * static_cast<double>(units) +
              price.further_us * static_cast<double>(granules > units ? granules - units : 0);
  if (failures_[i].at != 0 && failures_[i].at == number) {
    const bool oom = failures_[i].out_of_memory;
    failures_[i] = {};
    if (oom) throw DeviceError::out_of_memory(device_call_name(call), kOutOfMemory, "injected failure");
    throw DeviceError(device_call_name(call), kUnknown, "injected failure");
  }
}

std::size_t SimulatedDevice::mappings_in(DevicePtr va, std::size_t size) const {
  const std::size_t granules_in_range = granules_in(size);
  std::size_t mappings = 0;
  if (granules_.size() < granules_in_range) {  // a huge (or hostile) range: walk what is mapped
    for (const auto& [address, granule] : granules_)
      mappings += address >= va && address - va < size && granule.offset == 0;
    return mappings;
  }
  for (std::size_t g = 0; g < granules_in_range; ++g) {
    const auto it = granules_.find(va + g * options_.granularity);
    mappings += it != granules_.end() && it->second.offset == 0;
  }
  return mappings;
}

void SimulatedDevice::check_granular(std::size_t value, const char* what, const char* call) const {
  if (value % options_.granularity != 0) {
    throw DeviceError(call, kInvalidValue, std::string(what) + " " + std::to_string(value) +
                                               " is not a multiple of the granularity " +
                                               std::to_string(options_.granularity));
  }
}

void SimulatedDevice::check_reserved(DevicePtr va, std::size_t size, const char* call) const {
  auto it = reservations_.upper_bound(va);
  if (it != reservations_.begin()) {
    --it;
    const DevicePtr base = it->first;
    if (va >= base && size <= it->second && va - base <= it->second - size) return;
  }
  throw DeviceError(call, kInvalidValue, "range [" + hex(va) + ", +" + std::to_string(size) +
                                             ") is not inside a reserved address range");
}

DeviceMemInfo SimulatedDevice::mem_info() {
  std::lock_guard lock(mutex_);
  count(DeviceCall::mem_info);
  const std::size_t used = options_.used_by_others + chunk_bytes_;
  return {options_.capacity > used ? options_.capacity - used : 0, options_.capacity};
}

DevicePtr SimulatedDevice::reserve_address(std::size_t size, std::size_t alignment) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::reserve_address);
  count(DeviceCall::reserve_address);
  if (size == 0) throw DeviceError(call, kInvalidValue, "size 0");
  check_granular(size, "size", call);
  if (alignment != 0 && !is_power_of_two(alignment)) {
    throw DeviceError(call, kInvalidValue, "alignment " + std::to_string(alignment) +
                                               " is not a power of two");
  }
  const std::size_t align = std::max(alignment, options_.granularity);
  const DevicePtr base = (next_address_ + align - 1) & ~static_cast<DevicePtr>(align - 1);
  if (base < next_address_ || size > ~DevicePtr{0} - base - options_.granularity) {
    throw DeviceError::out_of_memory(call, kOutOfMemory, "virtual address space exhausted");
  }
  // Leave a granule-sized hole after each range so that neighbouring reservations never look
  // contiguous: an engine that walks past its range hits unreserved space.
  next_address_ = base + size + options_.granularity;
  reservations_.emplace(base, size);
  return base;
}

void SimulatedDevice::release_address(DevicePtr base, std::size_t size) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::release_address);
  count(DeviceCall::release_address);
  auto it = reservations_.find(base);
  if (it == reservations_.end()) {
    throw DeviceError(call, kInvalidValue, hex(base) + " is not the base of a reserved range");
  }
  if (it->second != size) {
    throw DeviceError(call, kInvalidValue, "size " + std::to_string(size) +
                                               " differs from the reserved " +
                                               std::to_string(it->second));
  }
  // Look for mappings inside the range: walk whichever is smaller, the range or the mappings.
  const std::size_t granules_in_range = size / options_.granularity;
  bool mapped_inside = false;
  if (granules_.size() < granules_in_range) {
    mapped_inside = std::any_of(granules_.begin(), granules_.end(), [&](const auto& entry) {
      return entry.first >= base && entry.first - base < size;
    });
  } else {
    for (std::size_t g = 0; g < granules_in_range && !mapped_inside; ++g) {
      mapped_inside = granules_.count(base + g * options_.granularity) != 0;
    }
  }
  if (mapped_inside) {
    throw DeviceError(call, kInvalidValue, "range at " + hex(base) + " still has mappings");
  }
  reservations_.erase(it);
}

ChunkHandle SimulatedDevice::create_chunk(std::size_t size) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::create_chunk);
  count(DeviceCall::create_chunk, 1, granules_in(size));
  if (size == 0) throw DeviceError(call, kInvalidValue, "size 0");
  check_granular(size, "size", call);
  const std::size_t available = options_.capacity - options_.used_by_others;
  if (chunk_bytes_ + size > available) {
    throw DeviceError::out_of_memory(call, kOutOfMemory,
                                     "cannot create " + format_bytes(size) + ": " +
                                         format_bytes(chunk_bytes_) + " of " +
                                         format_bytes(available) + " in use");
  }
  const ChunkHandle handle = next_chunk_++;
  chunks_.emplace(handle, size);
  chunk_bytes_ += size;
  return handle;
}

void SimulatedDevice::release_chunk(ChunkHandle chunk) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::release_chunk);
  auto it = chunks_.find(chunk);
  count(DeviceCall::release_chunk, 1, it == chunks_.end() ? 1 : granules_in(it->second));
  if (it == chunks_.end()) {
    throw DeviceError(call, kInvalidHandle, "unknown chunk " + std::to_string(chunk));
  }
  if (chunk_maps_.count(chunk) != 0) {
    throw DeviceError(call, kInvalidValue, "chunk " + std::to_string(chunk) + " is still mapped");
  }
  chunk_bytes_ -= it->second;
  chunks_.erase(it);
  broken_chunks_.erase(chunk);
}

void SimulatedDevice::map(DevicePtr va, std::size_t size, ChunkHandle chunk) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::map);
  count(DeviceCall::map, 1, granules_in(size));
  auto it = chunks_.find(chunk);
  if (it == chunks_.end()) {
    throw DeviceError(call, kInvalidHandle, "unknown chunk " + std::to_string(chunk));
  }
  if (size != it->second) {
    throw DeviceError(call, kInvalidValue, "size " + std::to_string(size) +
                                               " differs from the chunk's " +
                                               std::to_string(it->second));
  }
  if (broken_chunks_.count(chunk) != 0) {
    throw DeviceError(call, kUnknown,
                      "chunk " + std::to_string(chunk) +
                          ": another alias of it was unmapped while one awaited cuMemSetAccess "
                          "(the CUDA driver failed such a chunk's next map this way)");
  }
  check_granular(va, "address", call);
  check_reserved(va, size, call);
  const std::size_t step = options_.granularity;
  for (std::size_t offset = 0; offset < size; offset += step) {
    if (granules_.count(va + offset) != 0) {
      throw DeviceError(call, kInvalidValue, hex(va + offset) + " is already mapped");
    }
  }
  for (std::size_t offset = 0; offset < size; offset += step) {
    granules_.emplace(va + offset, Granule{chunk, offset, false});
  }
  ++chunk_maps_[chunk];
  ++awaiting_access_[chunk];
}

void SimulatedDevice::unmap(DevicePtr va, std::size_t size) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::unmap);
  count(DeviceCall::unmap, mappings_in(va, size), granules_in(size));
  if (size == 0) throw DeviceError(call, kInvalidValue, "size 0");
  check_granular(va, "address", call);
  check_granular(size, "size", call);
  const std::size_t step = options_.granularity;
  // Like cuMemUnmap, only whole mappings: the range starts where a mapping starts, ends where
  // one ends, and everything in between is mapped.
  for (std::size_t offset = 0; offset < size; offset += step) {
    auto it = granules_.find(va + offset);
    if (it == granules_.end()) {
      throw DeviceError(call, kInvalidValue, hex(va + offset) + " is not mapped");
    }
    const bool starts_mapping = it->second.offset == 0;
    const bool ends_mapping = it->second.offset + step == chunks_.at(it->second.chunk);
    if ((offset == 0 && !starts_mapping) || (offset + step == size && !ends_mapping)) {
      throw DeviceError(call, kInvalidValue, "range [" + hex(va) + ", +" + std::to_string(size) +
                                                 ") cuts a mapping");
    }
  }
  for (std::size_t offset = 0; offset < size; offset += step) {
    auto it = granules_.find(va + offset);
    if (it->second.offset == 0) {
      const ChunkHandle chunk = it->second.chunk;
      auto maps = chunk_maps_.find(chunk);
      if (--maps->second == 0) chunk_maps_.erase(maps);
      auto awaiting = awaiting_access_.find(chunk);
      if (!it->second.accessible && --awaiting->second == 0) awaiting_access_.erase(awaiting);
      // Another mapping of this chunk was made and its access not yet set: the real driver
      // broke the chunk when the two calls came from different threads (docs/design.md#a-driver-rule).
      if (awaiting_access_.count(chunk) != 0) {
        broken_chunks_.insert(chunk);
        ++unsafe_alias_unmaps_;
      }
    }
    granules_.erase(it);
  }
}

void SimulatedDevice::set_access(DevicePtr va, std::size_t size) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::set_access);
  count(DeviceCall::set_access, mappings_in(va, size), granules_in(size));
  if (size == 0) throw DeviceError(call, kInvalidValue, "size 0");
  check_granular(va, "address", call);
  check_granular(size, "size", call);
  const std::size_t step = options_.granularity;
  for (std::size_t offset = 0; offset < size; offset += step) {
    if (granules_.count(va + offset) == 0) {
      throw DeviceError(call, kInvalidValue, hex(va + offset) + " is not mapped");
    }
  }
  for (std::size_t offset = 0; offset < size; offset += step) {
    Granule& g = granules_.find(va + offset)->second;
    if (!g.accessible && g.offset == 0) {
      auto awaiting = awaiting_access_.find(g.chunk);
      if (--awaiting->second == 0) awaiting_access_.erase(awaiting);
    }
    g.accessible = true;
  }
}

EventHandle SimulatedDevice::create_event() {
  std::lock_guard lock(mutex_);
  count(DeviceCall::create_event);
  const EventHandle handle = next_event_++;
  events_.emplace(handle, Event{});
  return handle;
}

void SimulatedDevice::destroy_event(EventHandle event) {
  std::lock_guard lock(mutex_);
  count(DeviceCall::destroy_event);
  if (events_.erase(event) == 0) {
    throw DeviceError(device_call_name(DeviceCall::destroy_event), kInvalidHandle,
                      "unknown event " + std::to_string(event));
  }
}

void SimulatedDevice::record_event(EventHandle event, StreamId stream) {
  std::lock_guard lock(mutex_);
  count(DeviceCall::record_event);
  Event& e = event_of(event, DeviceCall::record_event);
  Stream& s = streams_[stream];
  // The GPU reaches the event lag_us after the host recorded it, and a stream runs in order.
  const double completes_at = std::max(host_time_us_ + lag_us_, s.last_completion_us);
  s.last_completion_us = completes_at;
  e = Event{stream, s.submitted, completes_at, true, s.after};
}

void SimulatedDevice::wait_event(StreamId stream, EventHandle event) {
  std::lock_guard lock(mutex_);
  count(DeviceCall::wait_event);
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

void SimulatedDevice::finish(StreamId stream, std::uint64_t work, const After& after) {
  std::uint64_t& done = streams_[stream].completed;
  done = std::max(done, work);
  for (const auto& [other, upto] : after) {
    std::uint64_t& other_done = streams_[other].completed;
    other_done = std::max(other_done, upto);
  }
}

SimulatedDevice::Event& SimulatedDevice::event_of(EventHandle event, DeviceCall call) {
  auto it = events_.find(event);
  if (it == events_.end())
    throw DeviceError(device_call_name(call), kInvalidHandle, "unknown event " + std::to_string(event));
  return it->second;
}

bool SimulatedDevice::event_complete(const Event& event) {
  if (!event.recorded) return true;  // as with cuEventQuery
  if (host_time_us_ < event.completes_at_us) return false;  // the lagging GPU is not there yet
  if (options_.streams_complete_immediately) return true;
  if (streams_[event.stream].completed < event.target) return false;
  for (const auto& [other, work] : event.after)
    if (streams_[other].completed < work) return false;
  return true;
}

bool SimulatedDevice::query_event(EventHandle event) {
  std::lock_guard lock(mutex_);
  count(DeviceCall::query_event);
  return event_complete(event_of(event, DeviceCall::query_event));
}

bool SimulatedDevice::stream_capturing(StreamId stream) {
  std::lock_guard lock(mutex_);
  return capturing_.contains(stream);
}

void SimulatedDevice::set_stream_capturing(StreamId stream, bool capturing) {
  std::lock_guard lock(mutex_);
  if (capturing) capturing_.insert(stream);
  else capturing_.erase(stream);
}

void SimulatedDevice::synchronize_event(EventHandle event) {
  std::lock_guard lock(mutex_);
  count(DeviceCall::synchronize_event);
  const Event& e = event_of(event, DeviceCall::synchronize_event);
  if (!e.recorded) return;
  // Waiting on the host lets the stream run up to the event (not past it), and the host's clock
  // runs on meanwhile.
  finish(e.stream, e.target, e.after);
  if (e.completes_at_us > host_time_us_) {
    wait_us_ += e.completes_at_us - host_time_us_;
    host_time_us_ = e.completes_at_us;
  }
}

std::uint64_t SimulatedDevice::calls(DeviceCall call) const {
  std::lock_guard lock(mutex_);
  return calls_[index_of(call)];
}

void SimulatedDevice::reset_call_counts() {
  std::lock_guard lock(mutex_);
  // Pending failures count from now: keep them the same number of calls away.
  for (std::size_t i = 0; i < calls_.size(); ++i) {
    if (failures_[i].at != 0) failures_[i].at -= calls_[i];
    calls_[i] = 0;
  }
  call_us_ = 0;
}

void SimulatedDevice::fail_call(DeviceCall call, std::uint64_t nth, bool out_of_memory) {
  std::lock_guard lock(mutex_);
  const int i = index_of(call);
  failures_[i] = nth == 0 ? Failure{} : Failure{calls_[i] + nth, out_of_memory};
}

void SimulatedDevice::submit_work(StreamId stream) {
  std::lock_guard lock(mutex_);
  Stream& s = streams_[stream];
  ++s.submitted;
  if (options_.streams_complete_immediately) s.completed = s.submitted;
}

void SimulatedDevice::complete_stream(StreamId stream) {
  std::lock_guard lock(mutex_);
  Stream& s = streams_[stream];
  finish(stream, s.submitted, s.after);
}

std::uint64_t SimulatedDevice::submitted(StreamId stream) const {
  std::lock_guard lock(mutex_);
  auto it = streams_.find(stream);
  return it == streams_.end() ? 0 : it->second.submitted;
}

bool SimulatedDevice::ordered_after(StreamId waiter, StreamId stream, std::uint64_t work) const {
  std::lock_guard lock(mutex_);
  if (waiter == stream || work == 0) return true;
  auto s = streams_.find(stream);
  if (s != streams_.end() && s->second.completed >= work) return true;
  auto w = streams_.find(waiter);
  if (w == streams_.end()) return false;
  auto after = w->second.after.find(stream);
  return after != w->second.after.end() && after->second >= work;
}

void SimulatedDevice::complete_all_streams() {
  std::lock_guard lock(mutex_);
  for (auto& [stream, s] : streams_) s.completed = s.submitted;
}

void SimulatedDevice::set_host_time(double us) {
  std::lock_guard lock(mutex_);
  host_time_us_ = std::max(host_time_us_, us);
}

void SimulatedDevice::advance_host_time(double us) {
  std::lock_guard lock(mutex_);
  if (us > 0) host_time_us_ += us;
}

double SimulatedDevice::host_time() const {
  std::lock_guard lock(mutex_);
  return host_time_us_;
}

void SimulatedDevice::set_lag(double us) {
  if (!(us >= 0) || !std::isfinite(us)) {
    throw Error(Errc::invalid_argument, "SimulatedDevice::set_lag: " + std::to_string(us) +
                                            " is not a finite number >= 0");
  }
  std::lock_guard lock(mutex_);
  lag_us_ = us;
}

double SimulatedDevice::lag() const {
  std::lock_guard lock(mutex_);
  return lag_us_;
}

double SimulatedDevice::modelled_call_us() const {
  std::lock_guard lock(mutex_);
  return call_us_;
}

double SimulatedDevice::modelled_wait_us() const {
  std::lock_guard lock(mutex_);
  return wait_us_;
}

Device::CallTimes SimulatedDevice::call_times() const {
  std::lock_guard lock(mutex_);
  return {call_us_, wait_us_};
}

std::size_t SimulatedDevice::chunk_bytes() const {
  std::lock_guard lock(mutex_);
  return chunk_bytes_;
}

std::size_t SimulatedDevice::mapped_bytes() const {
  std::lock_guard lock(mutex_);
  return granules_.size() * options_.granularity;
}

std::size_t SimulatedDevice::max_chunk_maps() const {
  std::lock_guard lock(mutex_);
  std::size_t most = 0;
  for (const auto& [chunk, maps] : chunk_maps_) most = std::max(most, maps);
  return most;
}

std::size_t SimulatedDevice::reserved_address_bytes() const {
  std::lock_guard lock(mutex_);
  std::size_t total = 0;
  for (const auto& [base, size] : reservations_) total += size;
  return total;
}

bool SimulatedDevice::is_mapped(DevicePtr va) const {
  std::lock_guard lock(mutex_);
  return granules_.count(va & ~static_cast<DevicePtr>(options_.granularity - 1)) != 0;
}

bool SimulatedDevice::is_accessible(DevicePtr va) const {
  std::lock_guard lock(mutex_);
  auto it = granules_.find(va & ~static_cast<DevicePtr>(options_.granularity - 1));
  return it != granules_.end() && it->second.accessible;
}

ChunkHandle SimulatedDevice::chunk_at(DevicePtr va) const {
  std::lock_guard lock(mutex_);
  auto it = granules_.find(va & ~static_cast<DevicePtr>(options_.granularity - 1));
  return it == granules_.end() ? 0 : it->second.chunk;
}

std::pair<ChunkHandle, std::size_t> SimulatedDevice::physical_at(DevicePtr va) const {
  std::lock_guard lock(mutex_);
  const DevicePtr granule = va & ~static_cast<DevicePtr>(options_.granularity - 1);
  auto it = granules_.find(granule);
  if (it == granules_.end()) return {0, 0};
  return {it->second.chunk, it->second.offset + (va - granule)};
}

std::uint64_t SimulatedDevice::unsafe_alias_unmaps() const {
  std::lock_guard lock(mutex_);
  return unsafe_alias_unmaps_;
}

std::size_t SimulatedDevice::live_events() const {
  std::lock_guard lock(mutex_);
  return events_.size();
}

}  // namespace gmem
