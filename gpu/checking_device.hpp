// A device decorator for the GPU tests: forwards to a real device and fails the running test on
// misuse the driver might not catch at once (an address mapped twice, a chunk released while
// still mapped, an alias unmapped between another thread's map and set-access), and counts the
// maps and aliases a test expects. (A chunk mapped at several addresses is how the engine
// stitches: its aliases.) Only map, unmap, set_access and release_chunk are watched; the rest
// reach the device through ForwardingDevice.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "gmem/forwarding_device.hpp"

namespace gmem::gpu_test {

class CheckingDevice final : public ForwardingDevice {
 public:
  explicit CheckingDevice(Device& inner) : ForwardingDevice(inner) {}

  void release_chunk(ChunkHandle chunk) override {
    {
      std::lock_guard lock(mutex_);
      EXPECT_EQ(maps_of_[chunk], 0) << "chunk released while still mapped";
      maps_of_.erase(chunk);
    }
    inner().release_chunk(chunk);
  }
  void map(DevicePtr va, std::size_t size, ChunkHandle chunk) override {
    {
      std::lock_guard lock(mutex_);
      EXPECT_EQ(va_chunk_.count(va), 0u) << "address mapped twice";
      va_chunk_[va] = {chunk, size};
      unaccessed_.insert(va);
      ++maps_of_[chunk];
      ++maps_;
      aliases_ += maps_of_[chunk] > 1;
    }
    try {
      inner().map(va, size, chunk);
    } catch (...) {  // not mapped after all
      std::lock_guard lock(mutex_);
      va_chunk_.erase(va);
      unaccessed_.erase(va);
      --maps_of_[chunk];
      throw;
    }
  }
  void unmap(DevicePtr va, std::size_t size) override {
    {
      // The driver broke a chunk when an alias of it was unmapped between another thread's
      // cuMemMap and cuMemSetAccess of it (Backing::mapping_calls_).
      std::lock_guard lock(mutex_);
      for (auto it = va_chunk_.lower_bound(va); it != va_chunk_.end() && it->first < va + size; ++it)
        for (DevicePtr other : unaccessed_)
          EXPECT_FALSE(other != it->first && va_chunk_.at(other).first == it->second.first)
              << "an alias unmapped while another awaits its access";
    }
    inner().unmap(va, size);
    std::lock_guard lock(mutex_);
    for (auto it = va_chunk_.lower_bound(va); it != va_chunk_.end() && it->first < va + size;) {
      --maps_of_[it->second.first];
      unaccessed_.erase(it->first);
      it = va_chunk_.erase(it);
    }
  }
  void set_access(DevicePtr va, std::size_t size) override {
    inner().set_access(va, size);
    std::lock_guard lock(mutex_);
    unaccessed_.erase(unaccessed_.lower_bound(va), unaccessed_.lower_bound(va + size));
  }

  int maps() const {  // map calls made
    std::lock_guard lock(mutex_);
    return maps_;
  }
  int aliases() const {  // maps of a chunk already mapped elsewhere
    std::lock_guard lock(mutex_);
    return aliases_;
  }

 private:
  mutable std::mutex mutex_;
  std::map<ChunkHandle, int> maps_of_;                                 // live mappings per chunk
  std::map<DevicePtr, std::pair<ChunkHandle, std::size_t>> va_chunk_;  // mapped: chunk, size
  std::set<DevicePtr> unaccessed_;  // mapped, access not set yet (a few at a time)
  int maps_ = 0;
  int aliases_ = 0;
};

}  // namespace gmem::gpu_test
