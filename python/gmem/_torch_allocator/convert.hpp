// What crosses between libgmem's C API and c10: the names both sides use, device checks, gmem's
// errors and pointers as messages print them, gmem's statistics as PyTorch's DeviceStats, and an
// engine's live blocks.
//
// Private to _torch_allocator.cpp (one translation unit: gmem/_shim.py compiles that file only).
#pragma once

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <unordered_set>
#include <vector>

#include "gmem/gmem.h"

namespace gmem_torch {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::DeviceIndex;
using c10::MempoolId_t;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::TraceEntry;

constexpr int kMaxDevices = 64;  // as libgmem

std::string last_gmem_error() { return gmem_last_error(); }

void check_device(DeviceIndex device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "gmem: device ", int(device),
              " is out of range");
}

// A pointer as error messages print it. (Not `<< ptr`: streaming a void* into c10::str's
// ostringstream from this library crashed the process on the H100's torch build, inside
// libstdc++'s num_put, where the same message with a string printed.)
std::string hex(const void* ptr) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx",
                static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(ptr)));
  return buf;
}

c10::CachingAllocator::Stat to_stat(const gmem_stat_t& s) {
  c10::CachingAllocator::Stat out;
  out.current = s.current;
  out.peak = s.peak;
  out.allocated = s.allocated;
  out.freed = s.freed;
  return out;
}

// gmem's numbers as PyTorch's DeviceStats.
DeviceStats to_device_stats(const gmem_engine_stats_t& s) {
  DeviceStats out;
  auto copy = [](c10::CachingAllocator::StatArray& to, const gmem_stat_t (&from)[3]) {
    for (std::size_t i = 0; i < 3; ++i) to[i] = to_stat(from[i]);
  };
  copy(out.allocation, s.allocation);
  copy(out.segment, s.segment);
  copy(out.active, s.active);
  copy(out.inactive_split, s.inactive_split);
  copy(out.allocated_bytes, s.allocated_bytes);
  copy(out.reserved_bytes, s.reserved_bytes);
  copy(out.active_bytes, s.active_bytes);
  copy(out.inactive_split_bytes, s.inactive_split_bytes);
  copy(out.requested_bytes, s.requested_bytes);
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  out.num_sync_all_streams = s.num_sync_all_streams;
  out.num_device_alloc = s.num_device_alloc;
  out.num_device_free = s.num_device_free;
  out.max_split_size = -1;  // gmem never refuses to split: PyTorch's "no limit"
  return out;
}

// The device's engine and its pools as one, with peaks of their sum (gmem_device_stats).
DeviceStats device_stats(DeviceIndex device) {
  check_device(device);
  gmem_engine_stats_t s{};
  // O(1) per engine (no walk): inactive_split* read 0 here; gmem.memory_summary() has them.
  TORCH_CHECK(gmem_device_stats(device, 0, &s) == GMEM_OK, "gmem: ", last_gmem_error());
  return to_device_stats(s);
}

// An engine's live blocks (under its lock; gmem_engine_for_each_block).
std::vector<gmem_block_t> live_blocks_of(gmem_engine_t* engine) {
  std::vector<gmem_block_t> blocks;
  auto collect = [](void* user, const gmem_block_t* block) {
    static_cast<std::vector<gmem_block_t>*>(user)->push_back(*block);
  };
  TORCH_CHECK(gmem_engine_for_each_block(engine, collect, &blocks) == GMEM_OK, "gmem: ",
              gmem_last_error());
  return blocks;
}

std::unordered_set<void*> pointers_of(const std::vector<gmem_block_t>& blocks) {
  std::unordered_set<void*> pointers;
  for (const gmem_block_t& block : blocks) pointers.insert(block.ptr);
  return pointers;
}

// A live block as a snapshot lists it: the block, and the device and pool ({0, 0}: the device's
// own engine) whose engine holds it.
struct LiveBlock {
  gmem_block_t block;  // where, how large (and as requested), on which stream
  DeviceIndex device;  // the engine's device
  MempoolId_t pool;    // the private pool's id; {0, 0} for the device's engine
};

}  // namespace
}  // namespace gmem_torch
