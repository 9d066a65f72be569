// CudaSegmentDevice: gmem::Device for GPUs without virtual memory management. See
// include/gmem/cuda_device.hpp for the model (segments committed at reservation, chunks as
// accounting, mapping as bookkeeping) and its limits.
#include <iterator>
#include <string>

#include "device/cuda_driver.hpp"
#include "gmem/cuda_device.hpp"
#include "gmem/error.hpp"

namespace gmem {
namespace {

CUcontext as_context(void* context) { return static_cast<CUcontext>(context); }

[[noreturn]] void misuse(const char* call, const std::string& problem) {
  throw DeviceError(call, CUDA_ERROR_INVALID_VALUE, "segment device: " + problem);
}

}  // namespace

CudaSegmentDevice::CudaSegmentDevice(int device)
    : device_(device), context_(cuda::retain_primary_context(device)) {
  try {
    name_ = cuda::device_name(device) + " (segments, no VMM)";
  } catch (...) {
    cuda::release_primary_context(device);
    throw;
  }
}

CudaSegmentDevice::~CudaSegmentDevice() {
  try {
    cuda::ContextGuard guard(as_context(context_));
    for (const auto& [base, segment] : segments_) cuda::driver().cuMemFree(segment.allocation);
  } catch (...) {  // the driver may be shutting down
  }
  cuda::release_primary_context(device_);
}

DeviceMemInfo CudaSegmentDevice::mem_info() {
  cuda::ContextGuard guard(as_context(context_));
  DeviceMemInfo info;
  cuda::check(cuda::driver().cuMemGetInfo(&info.free, &info.total), "cuMemGetInfo");
  return info;
}

std::size_t CudaSegmentDevice::committed_bytes() const {
  std::lock_guard lock(mutex_);
  return committed_;
}

DevicePtr CudaSegmentDevice::reserve_address(std::size_t size, std::size_t alignment) {
  if (size == 0 || size % kGranularity != 0) misuse("cuMemAlloc", "size not a multiple of 2 MiB");
  cuda::ContextGuard guard(as_context(context_));
  // A pool's first malloc in a CUDA graph capture reserves its arena here (PyTorch's allocator
  // makes its cudaMalloc in relaxed mode for the same reason).
  cuda::RelaxedCapture relaxed;
  CUdeviceptr allocation = 0;
  cuda::check(cuda::driver().cuMemAlloc(&allocation, size), "cuMemAlloc");
  DevicePtr base = static_cast<DevicePtr>(allocation);
  // The driver puts large allocations on 2 MiB boundaries; should it not, pad and align up.
  if (alignment > 1 && base % alignment != 0) {
    cuda::check(cuda::driver().cuMemFree(allocation), "cuMemFree");
    cuda::check(cuda::driver().cuMemAlloc(&allocation, size + alignment), "cuMemAlloc");
    base = (static_cast<DevicePtr>(allocation) + alignment - 1) / alignment * alignment;
  }
  std::lock_guard lock(mutex_);
  segments_.emplace(base, Segment{size, static_cast<std::uintptr_t>(allocation)});
  committed_ += size;
  return base;
}

void CudaSegmentDevice::release_address(DevicePtr base, std::size_t size) {
  std::uintptr_t allocation = 0;
  {
    std::lock_guard lock(mutex_);
    const auto segment = segments_.find(base);
    if (segment == segments_.end() || segment->second.size != size) {
      misuse("cuMemFree", "release of a range that is not a whole segment");
    }
    const auto mapped = mappings_.lower_bound(base);
    if (mapped != mappings_.end() && mapped->first < base + size) {
      misuse("cuMemFree", "release of a segment that still has mappings");
    }
    allocation = segment->second.allocation;
    segments_.erase(segment);
    committed_ -= size;
  }
  cuda::ContextGuard guard(as_context(context_));
  cuda::check(cuda::driver().cuMemFree(static_cast<CUdeviceptr>(allocation)), "cuMemFree");
}

ChunkHandle CudaSegmentDevice::create_chunk(std::size_t size) {
  std::lock_guard lock(mutex_);
  if (size == 0 || size % kGranularity != 0) misuse("cuMemCreate", "size not a multiple of 2 MiB");
  if (chunk_bytes_ + size > committed_) {
    throw DeviceError::out_of_memory(
        "cuMemCreate", CUDA_ERROR_OUT_OF_MEMORY,
        "segment device: chunks would exceed the " + format_bytes(committed_) +
            " committed by reserved segments");
  }
  const ChunkHandle handle = next_chunk_++;
  chunks_.emplace(handle, size);
  chunk_bytes_ += size;
  return handle;
}

void CudaSegmentDevice::release_chunk(ChunkHandle chunk) {
  std::lock_guard lock(mutex_);
  const auto found = chunks_.find(chunk);
  if (found == chunks_.end()) misuse("cuMemRelease", "unknown chunk");
  chunk_bytes_ -= found->second;
  chunks_.erase(found);
}

void CudaSegmentDevice::check_in_segment(DevicePtr va, std::size_t size, const char* call) const {
  auto segment = segments_.upper_bound(va);
  if (segment == segments_.begin()) misuse(call, "address outside every segment");
  --segment;
  if (va + size > segment->first + segment->second.size) {
    misuse(call, "range crosses a segment end");
  }
  if ((va - segment->first) % kGranularity != 0 || size % kGranularity != 0) {
    misuse(call, "range not aligned to 2 MiB");
  }
}

void CudaSegmentDevice::map(DevicePtr va, std::size_t size, ChunkHandle chunk) {
  std::lock_guard lock(mutex_);
  const auto found = chunks_.find(chunk);
  if (found == chunks_.end()) misuse("cuMemMap", "unknown chunk");
  if (found->second != size) misuse("cuMemMap", "size differs from the chunk's");
  check_in_segment(va, size, "cuMemMap");
  const auto next = mappings_.lower_bound(va);
  if (next != mappings_.end() && next->first < va + size) misuse("cuMemMap", "range already mapped");
  if (next != mappings_.begin() && std::prev(next)->first + std::prev(next)->second > va) {
    misuse("cuMemMap", "range already mapped");
  }
  mappings_.emplace(va, size);
}

void CudaSegmentDevice::unmap(DevicePtr va, std::size_t size) {
  std::lock_guard lock(mutex_);
  // The range must be tiled exactly by whole mappings, as cuMemUnmap requires.
  DevicePtr cursor = va;
  auto mapping = mappings_.find(va);
  while (cursor < va + size) {
    if (mapping == mappings_.end() || mapping->first != cursor) {
      misuse("cuMemUnmap", "range not made of whole mappings");
    }
    cursor += mapping->second;
    ++mapping;
  }
  if (cursor != va + size) misuse("cuMemUnmap", "range ends inside a mapping");
  mappings_.erase(mappings_.find(va), mapping);
}

void CudaSegmentDevice::set_access(DevicePtr va, std::size_t size) {
  std::lock_guard lock(mutex_);
  check_in_segment(va, size, "cuMemSetAccess");  // cudaMalloc'd memory is always accessible
}

EventHandle CudaSegmentDevice::create_event() {
  return reinterpret_cast<EventHandle>(cuda::create_event(as_context(context_)));
}

void CudaSegmentDevice::destroy_event(EventHandle event) {
  cuda::destroy_event(as_context(context_), reinterpret_cast<CUevent>(event));
}

void CudaSegmentDevice::record_event(EventHandle event, StreamId stream) {
  cuda::record_event(as_context(context_), reinterpret_cast<CUevent>(event),
                     reinterpret_cast<CUstream>(stream));
}

bool CudaSegmentDevice::query_event(EventHandle event) {
  return cuda::query_event(as_context(context_), reinterpret_cast<CUevent>(event));
}

void CudaSegmentDevice::synchronize_event(EventHandle event) {
  cuda::synchronize_event(as_context(context_), reinterpret_cast<CUevent>(event));
}

void CudaSegmentDevice::wait_event(StreamId stream, EventHandle event) {
  cuda::wait_event(as_context(context_), reinterpret_cast<CUstream>(stream),
                   reinterpret_cast<CUevent>(event));
}

bool CudaSegmentDevice::stream_capturing(StreamId stream) {
  return cuda::stream_capturing(as_context(context_), reinterpret_cast<CUstream>(stream));
}

}  // namespace gmem
