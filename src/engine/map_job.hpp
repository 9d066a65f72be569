// MapJob: the device calls of one malloc's slow path (Backing::map_missing), decided and booked
// under the engine's lock and made without it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <vector>

#include "gmem/device.hpp"

namespace gmem::detail {

// The maps of one malloc's slow path and set_access over each contiguous run of them, booked
// first and made at its end with the engine's lock released. map_missing decides everything
// under the lock (which chunk goes where; the books say so at once) and lands the job under it
// again: a failure is rolled back from the books. Until then a page is mapped in the books but
// not on the device, and its chunk busy through the malloc's reference.
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

}  // namespace gmem::detail
