// The one hook the engine offers to the layers above it (tracking): an observer is told of every
// malloc, free, mapping and OOM, under the engine's lock, and keeps a tag in each live block's
// own record. Keeping both under the one lock the engine already takes is what makes tracking
// cheap (no second lock, no second map). The engine knows nothing of what the tag means.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gmem/device.hpp"
#include "gmem/error.hpp"

namespace gmem::detail {

// Storage in each live block's record for the attached observer. All zero: allocated while no
// observer was attached.
struct BlockTag {
  std::uint64_t id = 0;
  std::uint64_t tick = 0;
  std::uint32_t step = 0;
  std::uint32_t scope = 0;
  std::uint32_t frames = 0;
};

class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  // Context for the malloc or free about to be made (a call stack, say). Called under the lock,
  // before the engine changes anything: it may throw, and the call then fails with no effect.
  virtual std::uint32_t malloc_context() = 0;
  virtual std::uint32_t free_context() = 0;
  // After the engine's state changed; must not throw.
  virtual void on_malloc(DevicePtr ptr, std::size_t size, StreamId stream, std::uint32_t context,
                         BlockTag& tag) noexcept = 0;
  virtual void on_free(DevicePtr ptr, std::size_t size, StreamId stream, const BlockTag& tag,
                       std::uint32_t context) noexcept = 0;
  virtual void on_map(DevicePtr va, std::size_t bytes) = 0;
  virtual void on_unmap(DevicePtr va, std::size_t bytes) = 0;
  virtual void on_oom(const OomInfo& info) = 0;
};

}  // namespace gmem::detail
