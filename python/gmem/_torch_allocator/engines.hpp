// The device engines: each device's own gmem engine (gmem_device_engine), looked up once and then
// read with one atomic load, and the engine that holds any pointer (a device's or a pool's).
//
// Private to _torch_allocator.cpp (one translation unit: gmem/_shim.py compiles that file only).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "convert.hpp"
#include "gmem/gmem.h"

namespace gmem_torch {
namespace {

// The engine whose memory holds `ptr`, a pool's or its device's; nullptr when no gmem engine's.
gmem_engine_t* engine_of_block(void* ptr) {
  gmem_engine_t* engine = nullptr;
  return gmem_engine_of(ptr, &engine) == GMEM_OK ? engine : nullptr;
}

class DeviceEngines {
 public:
  // The device's engine, looked up at its first use.
  gmem_engine_t* get(DeviceIndex device) {
    auto& slot = engines_[static_cast<std::size_t>(device)];
    if (gmem_engine_t* e = slot.load(std::memory_order_acquire)) return e;
    gmem_engine_t* e = nullptr;
    TORCH_CHECK(gmem_device_engine(device, &e) == GMEM_OK, "gmem: ", last_gmem_error());
    slot.store(e, std::memory_order_release);  // the same handle whoever wins
    return e;
  }

  // The device's engine when it was looked up already, else nullptr (nothing allocated there).
  gmem_engine_t* if_used(DeviceIndex device) const {
    return engines_[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
  }

  // The largest allocation that needs no new memory from outside gmem's reach: any free page
  // held can be mapped into one range (gmem stitches), plus what the limit and the device allow.
  size_t largest_block(DeviceIndex device) {
    gmem_engine_stats_t s{};
    TORCH_CHECK(gmem_engine_stats(get(device), 1, &s) == GMEM_OK, "gmem: ", last_gmem_error());
    size_t free_bytes = 0, total_bytes = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    }
    const int64_t reserved = s.reserved_bytes[0].current;
    const int64_t headroom =
        std::min<int64_t>(static_cast<int64_t>(free_bytes), std::max<int64_t>(0, s.memory_limit - reserved));
    const int64_t held_free = s.free_mapped_bytes + s.free_unmapped_bytes;
    return static_cast<size_t>(std::max(s.largest_free_range, held_free + headroom));
  }

 private:
  // Per device: its engine once looked up, else nullptr. Written once per device (a lookup
  // returns the same handle every time, so racing first uses store the same value).
  std::array<std::atomic<gmem_engine_t*>, kMaxDevices> engines_{};
};

}  // namespace
}  // namespace gmem_torch
