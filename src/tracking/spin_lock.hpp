// A lock for critical sections of a few nanoseconds (the tracker's hot path): one atomic
// exchange to take it and a plain store to release it, where std::mutex costs two atomics. A
// waiter spins briefly, then yields, so that a preempted holder is not starved of its core.
#pragma once

#include <atomic>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace gmem::detail {

class SpinLock {
 public:
  void lock() noexcept {
    while (locked_.exchange(true, std::memory_order_acquire)) wait();
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  void wait() noexcept {
    for (int spins = 0; locked_.load(std::memory_order_relaxed); ++spins) {
      if (spins < 64) {
#if defined(__x86_64__) || defined(__i386__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

  std::atomic<bool> locked_{false};
};

}  // namespace gmem::detail
