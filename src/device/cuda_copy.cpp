#include "device/cuda_copy.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "device/cuda_driver.hpp"

namespace gmem::cuda {

#if GMEM_COPY_KERNEL_PTX
extern const char kCopyKernelPtx[];  // copy_kernel_ptx.cpp, generated from copy_kernel.cu
#endif

namespace {

// The kernel as loaded into one context, and how wide to launch it there.
struct Loaded {
  CUcontext context = nullptr;
  CUfunction function = nullptr;  // nullptr: it could not be loaded here
  unsigned max_blocks = 0;        // blocks that fill the device: 8 per multiprocessor
};

bool kernel_wanted() {
  const char* value = std::getenv("GMEM_COPY_KERNEL");
  return !(value && (std::strcmp(value, "0") == 0 || std::strcmp(value, "off") == 0));
}

// The kernel in the current context, loaded at its first copy. A program has a context or two,
// so a short list under a mutex costs less than the copy's own launch.
Loaded kernel_here() {
  [[maybe_unused]] static const bool wanted = kernel_wanted();
  static std::mutex mutex;
  static std::vector<Loaded> loaded;
  CUcontext context = nullptr;
  check(driver().cuCtxGetCurrent(&context), "cuCtxGetCurrent");
  std::lock_guard lock(mutex);
  for (const Loaded& l : loaded)
    if (l.context == context) return l;
  Loaded here{context};
#if GMEM_COPY_KERNEL_PTX
  // The first copy may come inside a graph's capture (a static input copied in): loading a
  // module is no stream work, but in global capture mode it would invalidate the capture.
  RelaxedCapture relaxed;
  CUmodule module = nullptr;
  CUdevice device = 0;
  int processors = 0;
  if (wanted && context != nullptr && driver().cuModuleLoadData(&module, kCopyKernelPtx) == CUDA_SUCCESS &&
      driver().cuModuleGetFunction(&here.function, module, "gmem_copy_bytes") == CUDA_SUCCESS &&
      driver().cuCtxGetDevice(&device) == CUDA_SUCCESS &&
      driver().cuDeviceGetAttribute(&processors, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device) ==
          CUDA_SUCCESS) {
    here.max_blocks = 8 * static_cast<unsigned>(std::max(processors, 1));
  } else {
    here.function = nullptr;  // the module stays loaded: contexts are few, and it is small
  }
#endif
  loaded.push_back(here);
  return here;
}

}  // namespace

void copy_device_to_device(std::uintptr_t dst_address, std::uintptr_t src_address, std::size_t bytes,
                           std::uintptr_t stream_handle) {
  if (bytes == 0) return;
  CUdeviceptr dst = dst_address, src = src_address;
  const auto stream = reinterpret_cast<CUstream>(stream_handle);
  const Loaded kernel = kernel_here();
  if (kernel.function == nullptr) {
    check(driver().cuMemcpyDtoDAsync(dst, src, bytes, stream), "cuMemcpyDtoDAsync");
    return;
  }
  constexpr unsigned kThreads = 256;
  constexpr std::size_t kBytesPerThread = 64;  // four 16-byte words in flight
  const std::size_t wanted = (bytes + kThreads * kBytesPerThread - 1) / (kThreads * kBytesPerThread);
  const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>(wanted, kernel.max_blocks));
  void* args[] = {&dst, &src, &bytes};
  check(driver().cuLaunchKernel(kernel.function, blocks, 1, 1, kThreads, 1, 1, 0, stream, args, nullptr),
        "cuLaunchKernel");
}

bool copy_kernel_loaded() { return kernel_here().function != nullptr; }

}  // namespace gmem::cuda
