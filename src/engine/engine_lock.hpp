// EngineLock: the engine's one lock as the parts below the engine use it: released around device
// calls that may take milliseconds, waited on until another thread's calls land, and taken by
// the map-ahead thread. The engine owns the mutex and the condition (Engine::Impl); this is a
// view of them, so that no part below the engine calls back up into it for its lock.
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>

#include "common/function_ref.hpp"

namespace gmem::detail {

class EngineLock {
 public:
  EngineLock(std::mutex& mutex, std::condition_variable& landed) : mutex_(mutex), landed_(landed) {}

  // Held by the caller: released while `calls` runs (device calls only: no engine state), then
  // taken again; what `calls` threw is rethrown with the lock held.
  void unlocked(FunctionRef<void()> calls) const {
    std::exception_ptr error;
    mutex_.unlock();
    try {
      calls();
    } catch (...) {
      error = std::current_exception();
    }
    mutex_.lock();
    if (error) std::rethrow_exception(error);
  }
  // Held by the caller: released until another thread calls landed() (or a spurious wakeup),
  // then taken again.
  void wait_for_landing() const {
    std::unique_lock lock(mutex_, std::adopt_lock);
    landed_.wait(lock);
    lock.release();  // still held: the caller's guard releases it
  }
  // Wakes every thread in wait_for_landing (and the engine's own waiters on the condition).
  void landed() const { landed_.notify_all(); }
  // Not held by the caller (the map-ahead thread): taken for `work`, released after.
  void with_lock(FunctionRef<void()> work) const {
    std::lock_guard lock(mutex_);
    work();
  }

 private:
  std::mutex& mutex_;
  std::condition_variable& landed_;
};

}  // namespace gmem::detail
