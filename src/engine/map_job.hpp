// MapJob: the device calls of one malloc's slow path (Mapper::map_missing) or of a map-ahead
// batch, decided and booked under the engine's lock and made without it; MapCalls makes them and
// lands them in the books. Why this is safe: docs/design.md#device-calls-outside-the-lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

#include "engine/accounting.hpp"
#include "engine/observer.hpp"
#include "engine/page_backing.hpp"
#include "gmem/device.hpp"

namespace gmem::detail {

// The maps of one malloc's slow path (or a map-ahead batch) and set_access over each contiguous
// run of them, booked first and made at its end with the engine's lock released. The Mapper (or
// MapAhead) decides everything under the lock (which chunk goes where; the books say so at once)
// and lands the job under it again: a failure is rolled back from the books. Until then a page
// is mapped in the books but not on the device, and its chunk busy through the malloc's (or the
// batch's) reference.
struct MapJob {
  std::uint32_t arena = 0;
  DevicePtr base = 0;                // the arena's base: read without the lock
  std::vector<std::uint32_t> pages;  // page indices in the arena, in address order
  std::vector<ChunkHandle> chunks;   // the chunk to map at each
  std::vector<std::uint8_t> undone;  // 1: mapped, then unmapped again when the job failed
  std::size_t mapped = 0;            // how many of pages the device has mapped
  std::size_t accessible = 0;        // how many of those have their access set
  std::exception_ptr error;          // what the device threw, if it did
  // Calls visit(first, count) for each run of contiguous pages among pages[0, end).
  template <class F>
  void for_each_run(std::size_t end, F&& visit) const {
    for (std::size_t k = 0; k < end;) {
      std::size_t stop = k + 1;
      while (stop < end && pages[stop] == pages[stop - 1] + 1) ++stop;
      visit(k, stop - k);
      k = stop;
    }
  }
};

// Makes a MapJob's calls and lands them in the books. Its mutex orders the device calls made
// without the engine's lock: the CUDA driver broke a chunk (its next cuMemMap failed with
// CUDA_ERROR_UNKNOWN) when another thread unmapped one of its aliases between a job's cuMemMap
// and cuMemSetAccess of it (docs/design.md#a-driver-rule). So a job and a clash unmap made
// without the engine's lock (ChunkSource::unmap_page) hold it; the only lock besides the
// engine's, and taken after it.
class MapCalls {
 public:
  MapCalls(Device& device, PageBacking& pages, Accounting& accounting,
           EngineObserver* const& observer, int page_shift)
      : device_(device), pages_(pages), accounting_(accounting), observer_(observer),
        page_shift_(page_shift) {}

  // Makes the job's calls (without the engine's lock, holding calls_order()); a failure unmaps
  // what it mapped before returning, and is kept in job.error.
  void run(MapJob& job) noexcept;
  // Under the lock again: the observer told of the maps made, or, when the device failed, the
  // books taken back to what the device did (false then).
  bool land(const MapJob& job);
  // Takes back the books of the job's maps from pages[from] on, which the device never made.
  void forget(const MapJob& job, std::size_t from);
  std::mutex& calls_order() { return calls_order_; }

 private:
  DevicePtr address(const MapJob& job, std::size_t k) const {
    return job.base + (DevicePtr{job.pages[k]} << page_shift_);
  }
  std::size_t page_size() const { return std::size_t{1} << page_shift_; }

  Device& device_;
  PageBacking& pages_;
  Accounting& accounting_;
  EngineObserver* const& observer_;
  const int page_shift_;
  std::mutex calls_order_;
};

}  // namespace gmem::detail
