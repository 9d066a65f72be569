// The one hook the engine offers to the layers above it (tracking): an observer is told of every
// malloc, free, mapping and OOM, under the engine's lock, and keeps a tag in each live block's
// own record. Keeping both under the one lock the engine already takes is what makes tracking
// cheap (no second lock, no second map). The engine knows nothing of what the tag means.
#pragma once

#include <atomic>
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
  std::uint32_t flags = 0;  // the observer's own bits (tracking: saved for a backward pass)
};

// Context for each malloc and free (a call stack: microseconds), gathered before the engine takes
// its lock so that other threads are not held up meanwhile. A plain function, not a method: the
// observer may be detached, and destroyed, between the capture and the lock. It may throw; the
// call then fails with no effect.
struct ContextCapture {
  std::uint32_t (*capture)(int skip, int depth) = nullptr;  // nullptr: no context to gather
  int depth = 0;
  bool on_free = true;  // frees too, not only mallocs
};

// The attached observer's ContextCapture as the engine reads it: before taking its lock, so the
// fields are atomic and a detach between the capture and the lock is harmless.
class CaptureHook {
 public:
  void set(const ContextCapture& capture) {
    depth_.store(capture.depth, std::memory_order_relaxed);
    on_free_.store(capture.on_free, std::memory_order_relaxed);
    capture_.store(capture.capture, std::memory_order_release);
  }
  // The context for a malloc (or a free), or 0 when none is wanted.
  std::uint32_t gather(bool for_free) const {
    const auto capture = capture_.load(std::memory_order_acquire);
    if (capture == nullptr || (for_free && !on_free_.load(std::memory_order_relaxed))) return 0;
    return capture(0, depth_.load(std::memory_order_relaxed));
  }

 private:
  std::atomic<std::uint32_t (*)(int, int)> capture_{nullptr};
  std::atomic<int> depth_{0};
  std::atomic<bool> on_free_{false};
};

class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  // Read once, when the observer is attached.
  virtual ContextCapture context_capture() const = 0;
  // After the engine's state changed, with what context_capture() gathered (or 0); must not throw.
  virtual void on_malloc(DevicePtr ptr, std::size_t size, StreamId stream, std::uint32_t context,
                         BlockTag& tag) noexcept = 0;
  virtual void on_free(DevicePtr ptr, std::size_t size, StreamId stream, const BlockTag& tag,
                       std::uint32_t context) noexcept = 0;
  virtual void on_map(DevicePtr va, std::size_t bytes) = 0;
  virtual void on_unmap(DevicePtr va, std::size_t bytes) = 0;
  virtual void on_oom(const OomInfo& info) = 0;
};

}  // namespace gmem::detail
