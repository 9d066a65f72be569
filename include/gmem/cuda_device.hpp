// Devices over a real GPU (the gmem_cuda library; needs the CUDA driver at run time only).
//
//   CudaDevice: the driver's virtual memory API, one-to-one with gmem::Device. Every GPU since
//   Pascal supports it on Linux; CudaDevice::supports_vmm() says whether this one does.
//
//   CudaSegmentDevice: the fallback where VMM is unsupported (some vGPU / WSL setups). Without
//   VMM, virtual and physical memory cannot be separated, so each reserve_address() is one
//   cuMemAlloc'd segment committed in full at once, chunks are only accounting against the
//   committed bytes, and map / unmap / set_access are bookkeeping (every address of a segment is
//   always backed). Give the engine small arenas (EngineOptions::address_space = kArenaSize) so
//   that segments are added as it grows. It works, but honestly less well: a segment is held
//   until the engine is destroyed (empty_cache gives nothing back to the driver), reserved_bytes
//   counts chunks rather than the committed segments, each stream's arenas are separate
//   segments, and stitching cannot join memory across segments (a block lives in one segment).
//
// Both make the device's primary context current around each driver call, so they may be used
// from any thread whatever context it has current.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

#include "gmem/device.hpp"

namespace gmem {

class CudaDevice final : public Device {
 public:
  // Retains the primary context of `device` (a CUDA ordinal). Throws DeviceError when the driver
  // cannot be loaded, the ordinal is invalid or the device lacks VMM support.
  explicit CudaDevice(int device);
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED. Throws DeviceError when the driver
  // cannot be loaded or the ordinal is invalid.
  static bool supports_vmm(int device);
  // GPUs the driver sees; throws DeviceError when the driver cannot be loaded.
  static int device_count();
  // The device of the calling thread's current context (what cudaGetDevice reports once the
  // runtime is initialised), or 0 when no context is current.
  static int current_device();

  std::size_t granularity() const override { return granularity_; }
  DeviceMemInfo mem_info() override;
  std::string name() const override { return name_; }
  int index() const override { return device_; }

  DevicePtr reserve_address(std::size_t size, std::size_t alignment) override;
  void release_address(DevicePtr base, std::size_t size) override;
  ChunkHandle create_chunk(std::size_t size) override;
  void release_chunk(ChunkHandle chunk) override;
  void map(DevicePtr va, std::size_t size, ChunkHandle chunk) override;
  void unmap(DevicePtr va, std::size_t size) override;
  void set_access(DevicePtr va, std::size_t size) override;
  EventHandle create_event() override;
  void destroy_event(EventHandle event) override;
  void record_event(EventHandle event, StreamId stream) override;
  bool query_event(EventHandle event) override;
  void synchronize_event(EventHandle event) override;
  void wait_event(StreamId stream, EventHandle event) override;
  bool stream_capturing(StreamId stream) override;
  CallTimes call_times() const override;

 private:
  int device_;
  void* context_ = nullptr;  // CUcontext: the retained primary context
  // Nanoseconds spent in the memory calls and in synchronize_event (call_times()).
  std::atomic<std::uint64_t> calls_ns_{0}, waits_ns_{0};
  bool rdma_ = false;        // chunks are GPUDirect RDMA capable
  std::size_t granularity_ = 0;
  std::string name_;
};

class CudaSegmentDevice final : public Device {
 public:
  static constexpr std::size_t kGranularity = std::size_t{2} << 20;
  static constexpr std::size_t kArenaSize = std::size_t{256} << 20;  // suggested address_space

  // Retains the primary context of `device`; works on any GPU. Throws DeviceError.
  explicit CudaSegmentDevice(int device);
  ~CudaSegmentDevice() override;  // frees segments the engine did not release
  CudaSegmentDevice(const CudaSegmentDevice&) = delete;
  CudaSegmentDevice& operator=(const CudaSegmentDevice&) = delete;

  std::size_t granularity() const override { return kGranularity; }
  DeviceMemInfo mem_info() override;
  std::string name() const override { return name_; }
  int index() const override { return device_; }

  // cuMemAlloc's `size` bytes at once (padded when the driver's address is not aligned).
  DevicePtr reserve_address(std::size_t size, std::size_t alignment) override;
  void release_address(DevicePtr base, std::size_t size) override;
  // Accounting: fails as out of memory when chunks would exceed the committed segments.
  ChunkHandle create_chunk(std::size_t size) override;
  void release_chunk(ChunkHandle chunk) override;
  // Bookkeeping that enforces the Device contract (inside a segment, granular, no double map).
  void map(DevicePtr va, std::size_t size, ChunkHandle chunk) override;
  void unmap(DevicePtr va, std::size_t size) override;
  void set_access(DevicePtr va, std::size_t size) override;
  EventHandle create_event() override;
  void destroy_event(EventHandle event) override;
  void record_event(EventHandle event, StreamId stream) override;
  bool query_event(EventHandle event) override;
  void synchronize_event(EventHandle event) override;
  void wait_event(StreamId stream, EventHandle event) override;
  bool stream_capturing(StreamId stream) override;

  std::size_t committed_bytes() const;  // sum of live segments

 private:
  void check_in_segment(DevicePtr va, std::size_t size, const char* call) const;

  int device_;
  void* context_ = nullptr;
  std::string name_;
  mutable std::mutex mutex_;
  struct Segment {
    std::size_t size;
    std::uintptr_t allocation;  // what cuMemAlloc returned (base may be aligned past it)
  };
  std::map<DevicePtr, Segment> segments_;                // base -> segment
  std::unordered_map<ChunkHandle, std::size_t> chunks_;  // handle -> size
  std::map<DevicePtr, std::size_t> mappings_;            // va -> size
  ChunkHandle next_chunk_ = 1;
  std::size_t committed_ = 0;
  std::size_t chunk_bytes_ = 0;
};

}  // namespace gmem
