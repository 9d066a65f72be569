// The interface every gmem allocator and adaptor implements (after RMM's device_memory_resource):
// allocate/deallocate on a stream. Adaptors (tracking, logging, limits) wrap another resource.
#pragma once

#include <cstddef>

#include "gmem/device.hpp"

namespace gmem {

class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  // Returns device memory of at least `bytes`, aligned to 512 B, usable in order on `stream`.
  virtual void* allocate(std::size_t bytes, StreamId stream = 0) = 0;
  // Frees memory from allocate(); reusable on its stream at once, on others once that stream
  // has caught up.
  virtual void deallocate(void* ptr) = 0;
};

}  // namespace gmem
