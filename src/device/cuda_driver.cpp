#include "device/cuda_driver.hpp"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "gmem/error.hpp"

namespace gmem::cuda {
namespace {

#define GMEM_CUDA_STR2(x) #x
#define GMEM_CUDA_STR(x) GMEM_CUDA_STR2(x)  // expands cuda.h's renames: "cuMemGetInfo_v2"

struct Loaded {
  DriverApi api;
  const char* call = "dlopen";  // what failed
  int result = CUDA_ERROR_NOT_INITIALIZED;
  std::string error;  // empty when usable
};

Loaded load() {
  Loaded loaded;
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    loaded.error = std::string("cannot load the CUDA driver (libcuda.so.1): ") +
                   (why != nullptr ? why : "unknown reason") +
                   " (without a GPU, use the simulated device: GMEM_DEVICE=sim for libgmem.so)";
    return loaded;
  }
  // The library stays open for the life of the process: engines may outlive any scope here.
#define GMEM_CUDA_LOAD(fn)                                                                 \
  loaded.api.fn = reinterpret_cast<decltype(loaded.api.fn)>(dlsym(library, GMEM_CUDA_STR(fn))); \
  if (loaded.api.fn == nullptr && loaded.error.empty()) {                                  \
    loaded.call = "dlsym";                                                                 \
    loaded.error = "libcuda.so.1 lacks " GMEM_CUDA_STR(fn) ": the driver is too old for gmem"; \
  }
  GMEM_CUDA_DRIVER_FUNCTIONS(GMEM_CUDA_LOAD)
#undef GMEM_CUDA_LOAD
  if (!loaded.error.empty()) return loaded;
  const CUresult result = loaded.api.cuInit(0);
  if (result != CUDA_SUCCESS) {
    loaded.call = "cuInit";
    loaded.result = result;
    const char* name = nullptr;
    loaded.api.cuGetErrorName(result, &name);
    loaded.error = std::string(name != nullptr ? name : "unknown error") + " (no usable GPU?)";
  }
  return loaded;
}

}  // namespace

const DriverApi& driver() {
  static const Loaded loaded = load();  // thread-safe, once
  if (!loaded.error.empty()) {
    throw DeviceError(loaded.call, loaded.result, loaded.error);
  }
  return loaded.api;
}

void check(CUresult result, const char* call) {
  if (result == CUDA_SUCCESS) return;
  const char* name = nullptr;
  if (driver().cuGetErrorName(result, &name) != CUDA_SUCCESS || name == nullptr) {
    name = "unknown CUDA error";
  }
  if (result == CUDA_ERROR_OUT_OF_MEMORY) throw DeviceError::out_of_memory(call, result, name);
  throw DeviceError(call, result, name);
}

ContextGuard::ContextGuard(CUcontext context) {
  const DriverApi& api = driver();
  check(api.cuCtxGetCurrent(&previous_), "cuCtxGetCurrent");
  if (previous_ != context) {
    check(api.cuCtxSetCurrent(context), "cuCtxSetCurrent");
    switched_ = true;
  }
}

ContextGuard::~ContextGuard() {
  if (switched_) driver().cuCtxSetCurrent(previous_);  // nothing sensible to do on failure
}

int current_device() {
  const DriverApi& api = driver();
  CUcontext context = nullptr;
  check(api.cuCtxGetCurrent(&context), "cuCtxGetCurrent");
  if (context == nullptr) return 0;
  CUdevice device = 0;
  check(api.cuCtxGetDevice(&device), "cuCtxGetDevice");
  return static_cast<int>(device);
}

int device_count() {
  int count = 0;
  check(driver().cuDeviceGetCount(&count), "cuDeviceGetCount");
  return count;
}

}  // namespace gmem::cuda

namespace gmem::cuda {

CUcontext retain_primary_context(int device) {
  const DriverApi& api = driver();
  CUdevice handle = 0;
  check(api.cuDeviceGet(&handle, device), "cuDeviceGet");
  CUcontext context = nullptr;
  check(api.cuDevicePrimaryCtxRetain(&context, handle), "cuDevicePrimaryCtxRetain");
  return context;
}

void release_primary_context(int device) noexcept {
  try {
    const DriverApi& api = driver();
    CUdevice handle = 0;
    if (api.cuDeviceGet(&handle, device) == CUDA_SUCCESS) api.cuDevicePrimaryCtxRelease(handle);
  } catch (...) {  // a destructor path: the driver may already be shutting down
  }
}

std::string device_name(int device) {
  const DriverApi& api = driver();
  CUdevice handle = 0;
  check(api.cuDeviceGet(&handle, device), "cuDeviceGet");
  char name[256] = {};
  check(api.cuDeviceGetName(name, static_cast<int>(sizeof(name)) - 1, handle), "cuDeviceGetName");
  return "cuda:" + std::to_string(device) + " " + name;
}

CUevent create_event(CUcontext context) {
  ContextGuard guard(context);
  CUevent event = nullptr;
  check(driver().cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  return event;
}

void destroy_event(CUcontext context, CUevent event) {
  ContextGuard guard(context);
  check(driver().cuEventDestroy(event), "cuEventDestroy");
}

RelaxedCapture::RelaxedCapture() { driver().cuThreadExchangeStreamCaptureMode(&mode_); }
RelaxedCapture::~RelaxedCapture() { driver().cuThreadExchangeStreamCaptureMode(&mode_); }

void record_event(CUcontext context, CUevent event, CUstream stream) {
  ContextGuard guard(context);
  RelaxedCapture relaxed;
  check(driver().cuEventRecord(event, stream), "cuEventRecord");
}

bool query_event(CUcontext context, CUevent event) {
  ContextGuard guard(context);
  RelaxedCapture relaxed;
  const CUresult result = driver().cuEventQuery(event);
  if (result == CUDA_ERROR_NOT_READY) return false;
  check(result, "cuEventQuery");
  return true;
}

void synchronize_event(CUcontext context, CUevent event) {
  ContextGuard guard(context);
  RelaxedCapture relaxed;
  check(driver().cuEventSynchronize(event), "cuEventSynchronize");
}

void wait_event(CUcontext context, CUstream stream, CUevent event) {
  ContextGuard guard(context);
  RelaxedCapture relaxed;
  check(driver().cuStreamWaitEvent(stream, event, CU_EVENT_WAIT_DEFAULT), "cuStreamWaitEvent");
}

bool stream_capturing(CUcontext context, CUstream stream) {
  ContextGuard guard(context);
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUresult result = driver().cuStreamIsCapturing(stream, &status);
  // The legacy default stream while a blocking stream is captured: it would join the capture,
  // so nothing may be recorded on it either.
  if (result == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return true;
  check(result, "cuStreamIsCapturing");
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

}  // namespace gmem::cuda
