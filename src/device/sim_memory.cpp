// SimMemory: every misuse that the real driver would reject (or that would corrupt memory on a
// real GPU) throws a DeviceError here, so engine bugs surface in tests instead of on the GPU.
#include "gmem/sim_memory.hpp"

#include <algorithm>
#include <string>

#include "device/sim_results.hpp"
#include "gmem/device_calls.hpp"
#include "gmem/error.hpp"

namespace gmem {

using sim::hex;
using sim::kInvalidHandle;
using sim::kInvalidValue;
using sim::kOutOfMemory;
using sim::kUnknown;

namespace {

// Fake addresses start high, like real device pointers, so 0 is never a valid one.
constexpr DevicePtr kFirstAddress = 0x7f0000000000;

}  // namespace

SimMemory::SimMemory(std::size_t capacity, std::size_t granularity, std::size_t used_by_others)
    : capacity_(capacity),
      granularity_(granularity),
      used_by_others_(used_by_others),
      next_address_(kFirstAddress) {}

std::size_t SimMemory::chunk_granules(ChunkHandle chunk) const {
  std::lock_guard lock(mutex_);
  auto it = chunks_.find(chunk);
  return it == chunks_.end() ? 0 : granules_in(it->second);
}

std::size_t SimMemory::mappings_in(DevicePtr va, std::size_t size) const {
  std::lock_guard lock(mutex_);
  const std::size_t granules_in_range = granules_in(size);
  std::size_t mappings = 0;
  if (granules_.size() < granules_in_range) {  // a huge (or hostile) range: walk what is mapped
    for (const auto& [address, granule] : granules_)
      mappings += address >= va && address - va < size && granule.offset == 0;
    return mappings;
  }
  for (std::size_t g = 0; g < granules_in_range; ++g) {
    const auto it = granules_.find(va + g * granularity_);
    mappings += it != granules_.end() && it->second.offset == 0;
  }
  return mappings;
}

void SimMemory::check_granular(std::size_t value, const char* what, const char* call) const {
  if (value % granularity_ != 0) {
    throw DeviceError(call, kInvalidValue, std::string(what) + " " + std::to_string(value) +
                                               " is not a multiple of the granularity " +
                                               std::to_string(granularity_));
  }
}

void SimMemory::check_reserved(DevicePtr va, std::size_t size, const char* call) const {
  auto it = reservations_.upper_bound(va);
  if (it != reservations_.begin()) {
    --it;
    const DevicePtr base = it->first;
    if (va >= base && size <= it->second && va - base <= it->second - size) return;
  }
  throw DeviceError(call, kInvalidValue, "range [" + hex(va) + ", +" + std::to_string(size) +
                                             ") is not inside a reserved address range");
}

DeviceMemInfo SimMemory::mem_info() const {
  std::lock_guard lock(mutex_);
  const std::size_t used = used_by_others_ + chunk_bytes_;
  return {capacity_ > used ? capacity_ - used : 0, capacity_};
}

DevicePtr SimMemory::reserve_address(std::size_t size, std::size_t alignment) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::reserve_address);
  if (size == 0) throw DeviceError(call, kInvalidValue, "size 0");
  check_granular(size, "size", call);
  if (alignment != 0 && !sim::is_power_of_two(alignment)) {
    throw DeviceError(call, kInvalidValue, "alignment " + std::to_string(alignment) +
                                               " is not a power of two");
  }
  const std::size_t align = std::max(alignment, granularity_);
  const DevicePtr base = (next_address_ + align - 1) & ~static_cast<DevicePtr>(align - 1);
  if (base < next_address_ || size > ~DevicePtr{0} - base - granularity_) {
    throw DeviceError::out_of_memory(call, kOutOfMemory, "virtual address space exhausted");
  }
  // Leave a granule-sized hole after each range so that neighbouring reservations never look
  // contiguous: an engine that walks past its range hits unreserved space.
  next_address_ = base + size + granularity_;
  reservations_.emplace(base, size);
  return base;
}

void SimMemory::release_address(DevicePtr base, std::size_t size) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::release_address);
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
  const std::size_t granules_in_range = size / granularity_;
  bool mapped_inside = false;
  if (granules_.size() < granules_in_range) {
    mapped_inside = std::any_of(granules_.begin(), granules_.end(), [&](const auto& entry) {
      return entry.first >= base && entry.first - base < size;
    });
  } else {
    for (std::size_t g = 0; g < granules_in_range && !mapped_inside; ++g) {
      mapped_inside = granules_.count(base + g * granularity_) != 0;
    }
  }
  if (mapped_inside) {
    throw DeviceError(call, kInvalidValue, "range at " + hex(base) + " still has mappings");
  }
  reservations_.erase(it);
}

ChunkHandle SimMemory::create_chunk(std::size_t size) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::create_chunk);
  if (size == 0) throw DeviceError(call, kInvalidValue, "size 0");
  check_granular(size, "size", call);
  const std::size_t available = capacity_ - used_by_others_;
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

void SimMemory::release_chunk(ChunkHandle chunk) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::release_chunk);
  auto it = chunks_.find(chunk);
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

void SimMemory::map(DevicePtr va, std::size_t size, ChunkHandle chunk) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::map);
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
  const std::size_t step = granularity_;
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

void SimMemory::unmap(DevicePtr va, std::size_t size) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::unmap);
  if (size == 0) throw DeviceError(call, kInvalidValue, "size 0");
  check_granular(va, "address", call);
  check_granular(size, "size", call);
  const std::size_t step = granularity_;
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

void SimMemory::set_access(DevicePtr va, std::size_t size) {
  std::lock_guard lock(mutex_);
  const char* call = device_call_name(DeviceCall::set_access);
  if (size == 0) throw DeviceError(call, kInvalidValue, "size 0");
  check_granular(va, "address", call);
  check_granular(size, "size", call);
  const std::size_t step = granularity_;
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

std::size_t SimMemory::chunk_bytes() const {
  std::lock_guard lock(mutex_);
  return chunk_bytes_;
}

std::size_t SimMemory::mapped_bytes() const {
  std::lock_guard lock(mutex_);
  return granules_.size() * granularity_;
}

std::size_t SimMemory::max_chunk_maps() const {
  std::lock_guard lock(mutex_);
  std::size_t most = 0;
  for (const auto& [chunk, maps] : chunk_maps_) most = std::max(most, maps);
  return most;
}

std::size_t SimMemory::reserved_address_bytes() const {
  std::lock_guard lock(mutex_);
  std::size_t total = 0;
  for (const auto& [base, size] : reservations_) total += size;
  return total;
}

bool SimMemory::is_mapped(DevicePtr va) const {
  std::lock_guard lock(mutex_);
  return granules_.count(va & ~static_cast<DevicePtr>(granularity_ - 1)) != 0;
}

bool SimMemory::is_accessible(DevicePtr va) const {
  std::lock_guard lock(mutex_);
  auto it = granules_.find(va & ~static_cast<DevicePtr>(granularity_ - 1));
  return it != granules_.end() && it->second.accessible;
}

ChunkHandle SimMemory::chunk_at(DevicePtr va) const {
  std::lock_guard lock(mutex_);
  auto it = granules_.find(va & ~static_cast<DevicePtr>(granularity_ - 1));
  return it == granules_.end() ? 0 : it->second.chunk;
}

std::pair<ChunkHandle, std::size_t> SimMemory::physical_at(DevicePtr va) const {
  std::lock_guard lock(mutex_);
  const DevicePtr granule = va & ~static_cast<DevicePtr>(granularity_ - 1);
  auto it = granules_.find(granule);
  if (it == granules_.end()) return {0, 0};
  return {it->second.chunk, it->second.offset + (va - granule)};
}

std::uint64_t SimMemory::unsafe_alias_unmaps() const {
  std::lock_guard lock(mutex_);
  return unsafe_alias_unmaps_;
}

}  // namespace gmem
