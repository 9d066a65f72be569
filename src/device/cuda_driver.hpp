// The CUDA driver API, loaded at run time. libgmem.so and gmem_cuda link no CUDA library, so they
// load on machines without a GPU driver (GMEM_DEVICE=sim, CI); libcuda.so.1 is opened the first
// time a CUDA device is used. The table holds exactly the symbols the linker would have bound
// (cuda.h maps cuMemGetInfo to cuMemGetInfo_v2 and so on), so behaviour matches a normal link.
#pragma once

#include <cuda.h>

#include <string>

namespace gmem::cuda {

#define GMEM_CUDA_DRIVER_FUNCTIONS(X)                                                        \
  X(cuInit) X(cuGetErrorName) X(cuDriverGetVersion) X(cuDeviceGet) X(cuDeviceGetCount)       \
  X(cuDeviceGetName) X(cuDeviceGetAttribute) X(cuDevicePrimaryCtxRetain)                    \
  X(cuDevicePrimaryCtxRelease) X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuCtxGetDevice)       \
  X(cuMemGetInfo) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate) X(cuMemRelease)   \
  X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuMemGetAllocationGranularity) X(cuMemAlloc) \
  X(cuMemFree) X(cuEventCreate) X(cuEventDestroy) X(cuEventRecord) X(cuEventQuery)            \
  X(cuEventSynchronize) X(cuStreamWaitEvent) X(cuStreamIsCapturing) X(cuThreadExchangeStreamCaptureMode)

struct DriverApi {
#define GMEM_CUDA_DECLARE(fn) decltype(&::fn) fn = nullptr;
  GMEM_CUDA_DRIVER_FUNCTIONS(GMEM_CUDA_DECLARE)
#undef GMEM_CUDA_DECLARE
};

// The loaded and initialised (cuInit) driver. Throws DeviceError when libcuda.so.1 cannot be
// opened, lacks a symbol, or cuInit fails; the error then repeats on every call.
const DriverApi& driver();

// Throws DeviceError(call, result, "<CUDA_ERROR_NAME>") unless result is CUDA_SUCCESS;
// CUDA_ERROR_OUT_OF_MEMORY is reported as the device running out of memory.
void check(CUresult result, const char* call);

// Makes `context` current on this thread for the scope and restores the previous one. Costs one
// thread-local read when it already is current (the usual case under PyTorch).
class ContextGuard {
 public:
  explicit ContextGuard(CUcontext context);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

// The thread in relaxed stream-capture mode for the scope, as PyTorch makes its cudaMalloc
// (CUDAStreamCaptureModeGuard). While a graph is captured in global mode (on this thread or
// another), an event query or wait, or a cuMemAlloc, would otherwise be refused
// (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) and invalidate the capture, though it concerns no
// captured stream (H100, driver 580: gpu/unmap_in_capture.cu). Events on a capturing stream are
// never made (Device::stream_capturing).
class RelaxedCapture {
 public:
  RelaxedCapture();
  ~RelaxedCapture();
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  CUstreamCaptureMode mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
};

// The device of the context current on this thread, or 0 when none is current.
int current_device();
int device_count();

// Pieces both CUDA devices share.
CUcontext retain_primary_context(int device);  // throws DeviceError for a bad ordinal
void release_primary_context(int device) noexcept;
std::string device_name(int device);           // "cuda:0 NVIDIA H100 80GB HBM3"
CUevent create_event(CUcontext context);       // CU_EVENT_DISABLE_TIMING
void destroy_event(CUcontext context, CUevent event);
void record_event(CUcontext context, CUevent event, CUstream stream);
bool query_event(CUcontext context, CUevent event);  // CUDA_ERROR_NOT_READY -> false
void synchronize_event(CUcontext context, CUevent event);
void wait_event(CUcontext context, CUstream stream, CUevent event);  // cuStreamWaitEvent
bool stream_capturing(CUcontext context, CUstream stream);  // capturing, or a capture invalidated

}  // namespace gmem::cuda
