// CudaDevice: gmem::Device over the CUDA driver's virtual memory management API.
#include "gmem/cuda_device.hpp"

#include <chrono>

#include "device/cuda_driver.hpp"
#include "gmem/error.hpp"

namespace gmem {
namespace {

CUcontext as_context(void* context) { return static_cast<CUcontext>(context); }

// Adds the time from its making to its end (an exception's way out included) to `total`.
class Timed {
 public:
  explicit Timed(std::atomic<std::uint64_t>& total)
      : total_(total), began_(std::chrono::steady_clock::now()) {}
  ~Timed() {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - began_);
    total_.fetch_add(static_cast<std::uint64_t>(ns.count()), std::memory_order_relaxed);
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  std::atomic<std::uint64_t>& total_;
  std::chrono::steady_clock::time_point began_;
};

CUmemAllocationProp chunk_properties(int device, bool rdma) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  // Lets NICs (NCCL over InfiniBand) reach the memory directly, as PyTorch's own VMM segments do.
  prop.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
  return prop;
}

bool attribute(CUdevice_attribute which, int device) {
  const gmem::cuda::DriverApi& api = gmem::cuda::driver();
  CUdevice handle = 0;
  gmem::cuda::check(api.cuDeviceGet(&handle, device), "cuDeviceGet");
  int value = 0;
  gmem::cuda::check(api.cuDeviceGetAttribute(&value, which, handle), "cuDeviceGetAttribute");
  return value != 0;
}

}  // namespace

bool CudaDevice::supports_vmm(int device) {
  return attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device);
}

int CudaDevice::device_count() { return cuda::device_count(); }
int CudaDevice::current_device() { return cuda::current_device(); }

CudaDevice::CudaDevice(int device) : device_(device) {
  if (!supports_vmm(device)) {
    throw DeviceError("cuDeviceGetAttribute", CUDA_ERROR_NOT_SUPPORTED,
                      "device " + std::to_string(device) +
                          " does not support virtual memory management (use CudaSegmentDevice)");
  }
  rdma_ = attribute(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, device);
  context_ = cuda::retain_primary_context(device);
  try {
    cuda::ContextGuard guard(as_context(context_));
    // The minimum (2 MiB on current GPUs), not the recommended: smaller chunks stitch better.
    const CUmemAllocationProp prop = chunk_properties(device, rdma_);
    cuda::check(cuda::driver().cuMemGetAllocationGranularity(&granularity_, &prop,
                                                             CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                "cuMemGetAllocationGranularity");
    name_ = cuda::device_name(device);
  } catch (...) {
    cuda::release_primary_context(device);
    throw;
  }
}

CudaDevice::~CudaDevice() { cuda::release_primary_context(device_); }

DeviceMemInfo CudaDevice::mem_info() {
  cuda::ContextGuard guard(as_context(context_));
  DeviceMemInfo info;
  cuda::check(cuda::driver().cuMemGetInfo(&info.free, &info.total), "cuMemGetInfo");
  return info;
}

DevicePtr CudaDevice::reserve_address(std::size_t size, std::size_t alignment) {
  cuda::ContextGuard guard(as_context(context_));
  CUdeviceptr base = 0;
  cuda::check(cuda::driver().cuMemAddressReserve(&base, size, alignment, 0, 0),
              "cuMemAddressReserve");
  return static_cast<DevicePtr>(base);
}

void CudaDevice::release_address(DevicePtr base, std::size_t size) {
  cuda::ContextGuard guard(as_context(context_));
  cuda::check(cuda::driver().cuMemAddressFree(static_cast<CUdeviceptr>(base), size),
              "cuMemAddressFree");
}

ChunkHandle CudaDevice::create_chunk(std::size_t size) {
  const Timed timed(calls_ns_);
  cuda::ContextGuard guard(as_context(context_));
  const CUmemAllocationProp prop = chunk_properties(device_, rdma_);
  CUmemGenericAllocationHandle handle = 0;
  cuda::check(cuda::driver().cuMemCreate(&handle, size, &prop, 0), "cuMemCreate");
  return static_cast<ChunkHandle>(handle);
}

void CudaDevice::release_chunk(ChunkHandle chunk) {
  const Timed timed(calls_ns_);
  cuda::ContextGuard guard(as_context(context_));
  cuda::check(cuda::driver().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(chunk)),
              "cuMemRelease");
}

void CudaDevice::map(DevicePtr va, std::size_t size, ChunkHandle chunk) {
  const Timed timed(calls_ns_);
  cuda::ContextGuard guard(as_context(context_));
  cuda::check(cuda::driver().cuMemMap(static_cast<CUdeviceptr>(va), size, 0,
                                      static_cast<CUmemGenericAllocationHandle>(chunk), 0),
              "cuMemMap");
}

void CudaDevice::unmap(DevicePtr va, std::size_t size) {
  const Timed timed(calls_ns_);
  cuda::ContextGuard guard(as_context(context_));
  cuda::check(cuda::driver().cuMemUnmap(static_cast<CUdeviceptr>(va), size), "cuMemUnmap");
}

void CudaDevice::set_access(DevicePtr va, std::size_t size) {
  const Timed timed(calls_ns_);
  cuda::ContextGuard guard(as_context(context_));
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  cuda::check(cuda::driver().cuMemSetAccess(static_cast<CUdeviceptr>(va), size, &access, 1),
              "cuMemSetAccess");
}

EventHandle CudaDevice::create_event() {
  return reinterpret_cast<EventHandle>(cuda::create_event(as_context(context_)));
}

void CudaDevice::destroy_event(EventHandle event) {
  cuda::destroy_event(as_context(context_), reinterpret_cast<CUevent>(event));
}

void CudaDevice::record_event(EventHandle event, StreamId stream) {
  cuda::record_event(as_context(context_), reinterpret_cast<CUevent>(event),
                     reinterpret_cast<CUstream>(stream));
}

bool CudaDevice::query_event(EventHandle event) {
  return cuda::query_event(as_context(context_), reinterpret_cast<CUevent>(event));
}

void CudaDevice::synchronize_event(EventHandle event) {
  const Timed timed(waits_ns_);
  cuda::synchronize_event(as_context(context_), reinterpret_cast<CUevent>(event));
}

void CudaDevice::wait_event(StreamId stream, EventHandle event) {
  cuda::wait_event(as_context(context_), reinterpret_cast<CUstream>(stream),
                   reinterpret_cast<CUevent>(event));
}

bool CudaDevice::stream_capturing(StreamId stream) {
  return cuda::stream_capturing(as_context(context_), reinterpret_cast<CUstream>(stream));
}

Device::CallTimes CudaDevice::call_times() const {
  return {static_cast<double>(calls_ns_.load(std::memory_order_relaxed)) / 1e3,
          static_cast<double>(waits_ns_.load(std::memory_order_relaxed)) / 1e3};
}

}  // namespace gmem
