// SimMemory: the simulated device's memory model, CUDA's virtual memory API as bookkeeping only.
// Address ranges are reserved, chunks of physical memory created (no memory behind them: an
// 80 GiB device costs nothing), whole chunks mapped at granule-aligned addresses inside a
// reservation, and mapped ranges made accessible (set_access). Every misuse the real driver
// would reject, or that would corrupt memory on a real GPU, throws a DeviceError named after the
// CUDA call: mapping outside a reservation, a double map, unmapping part of a mapping, releasing
// a mapped chunk or a reservation with mappings left in it.
//
// It also keeps a driver rule found on an H100 (docs/design.md#a-driver-rule): unmapping a
// mapping of a chunk while another mapping of it awaits set_access breaks the chunk, and its next
// map throws CUDA_ERROR_UNKNOWN, whichever threads the calls come from (unsafe_alias_unmaps()).
//
// It neither counts nor prices its calls (SimCallLedger does, from granules_in, chunk_granules
// and mappings_in). Thread-safe: one mutex, held by each member function and by nothing else, so
// it is a leaf (no other lock is taken while it is held).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "gmem/device.hpp"

namespace gmem {

class SimMemory {
 public:
  // Preconditions (SimulatedDevice checks them, saying which option is wrong): `granularity` is
  // a power of two and used_by_others <= capacity.
  SimMemory(std::size_t capacity, std::size_t granularity, std::size_t used_by_others);

  std::size_t granularity() const { return granularity_; }
  // Free: the capacity less what others use and the chunks created here.
  DeviceMemInfo mem_info() const;

  // --- the calls, as Device's (device.hpp) ---
  DevicePtr reserve_address(std::size_t size, std::size_t alignment);
  void release_address(DevicePtr base, std::size_t size);
  ChunkHandle create_chunk(std::size_t size);
  void release_chunk(ChunkHandle chunk);
  void map(DevicePtr va, std::size_t size, ChunkHandle chunk);
  void unmap(DevicePtr va, std::size_t size);
  void set_access(DevicePtr va, std::size_t size);

  // --- what a call is priced by (kDeviceCallPrices) ---
  std::size_t granules_in(std::size_t bytes) const { return bytes / granularity_; }
  std::size_t chunk_granules(ChunkHandle chunk) const;  // 0 for an unknown chunk
  // Mappings that start in [va, va + size): what cuMemSetAccess and cuMemUnmap are priced by.
  std::size_t mappings_in(DevicePtr va, std::size_t size) const;

  // --- inspection ---
  std::size_t chunk_bytes() const;     // physical memory created and not released
  std::size_t mapped_bytes() const;    // bytes of virtual address space that are mapped
  std::size_t max_chunk_maps() const;  // the most addresses one chunk is mapped at now (aliases)
  std::size_t reserved_address_bytes() const;
  bool is_mapped(DevicePtr va) const;      // the granule containing va is mapped
  bool is_accessible(DevicePtr va) const;  // mapped and set_access'ed
  ChunkHandle chunk_at(DevicePtr va) const;  // 0 when unmapped
  // The chunk mapped at `va` and the offset into it that `va` reaches ({0, 0} when unmapped).
  std::pair<ChunkHandle, std::size_t> physical_at(DevicePtr va) const;
  // Unmaps of a chunk's mapping while another mapping of it awaited set_access (each broke the
  // chunk: see above).
  std::uint64_t unsafe_alias_unmaps() const;

 private:
  struct Granule {
    ChunkHandle chunk = 0;
    std::size_t offset = 0;  // of this granule in its chunk: 0 where a mapping starts
    bool accessible = false;  // set_access'ed since it was mapped
  };
  // Throw DeviceError(call, CUDA_ERROR_INVALID_VALUE) unless the condition holds.
  void check_reserved(DevicePtr va, std::size_t size, const char* call) const;
  void check_granular(std::size_t value, const char* what, const char* call) const;

  const std::size_t capacity_;        // total device memory
  const std::size_t granularity_;     // physical page size: a power of two
  const std::size_t used_by_others_;  // held outside gmem; <= capacity_

  mutable std::mutex mutex_;  // guards everything below
  // Where the next reservation may start; reservations leave a granule-sized hole between them.
  DevicePtr next_address_;
  // Reserved ranges, base -> size: disjoint, granule-aligned, never 0.
  std::map<DevicePtr, std::size_t> reservations_;
  ChunkHandle next_chunk_ = 1;  // handles are never reused; 0 is none
  std::unordered_map<ChunkHandle, std::size_t> chunks_;  // handle -> size, a multiple of granularity_
  std::size_t chunk_bytes_ = 0;                          // the sizes in chunks_, summed
  // Every mapped granule, granule-aligned va -> the chunk granule behind it. Each lies inside a
  // reservation, and each mapping covers its chunk whole: granules at offsets 0, granularity_, ...
  std::unordered_map<DevicePtr, Granule> granules_;
  // Chunks mapped at least once -> mappings of them (a mapping: the granules of one map call).
  std::unordered_map<ChunkHandle, std::size_t> chunk_maps_;
  // Chunks with mappings not yet set_access'ed -> how many (never 0: an entry goes at 0).
  std::unordered_map<ChunkHandle, std::size_t> awaiting_access_;
  // Chunks an unsafe alias unmap broke: their next map throws; releasing one forgets it.
  std::unordered_set<ChunkHandle> broken_chunks_;
  std::uint64_t unsafe_alias_unmaps_ = 0;  // such unmaps so far
};

}  // namespace gmem
