// gmem's allocation entry points for torch.cuda.memory.CUDAPluggableAllocator, raising PyTorch's
// own exception types.
//
// Why this exists: PyTorch's pluggable allocator (2.x) neither checks the pointer its alloc
// function returns nor knows gmem's exceptions, so an out-of-memory would reach Python as a
// plain RuntimeError (issue pytorch#133280) instead of torch.OutOfMemoryError, which training
// code catches to retry with a smaller batch. Throwing c10::OutOfMemoryError from here makes
// PyTorch translate it. Built by gmem/_shim.py against the installed torch's headers and
// libc10 (a few seconds, cached); libgmem itself stays free of any torch dependency.
#include <c10/util/Exception.h>

#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace {

using MallocFn = int (*)(void** ptr, std::size_t size, int device, std::uintptr_t stream);
using FreeFn = int (*)(void* ptr);
using LastErrorFn = const char* (*)();

constexpr int kStatusOutOfMemory = 2;  // GMEM_ERROR_OUT_OF_MEMORY in gmem.h

MallocFn g_malloc = nullptr;
FreeFn g_free = nullptr;
LastErrorFn g_last_error = nullptr;

}  // namespace

extern "C" {

// Hands over libgmem's gmem_malloc, gmem_free and gmem_last_error, so that this library calls
// the very engine the Python package already loaded.
void gmem_torch_shim_bind(void* malloc_fn, void* free_fn, void* last_error_fn) {
  g_malloc = reinterpret_cast<MallocFn>(malloc_fn);
  g_free = reinterpret_cast<FreeFn>(free_fn);
  g_last_error = reinterpret_cast<LastErrorFn>(last_error_fn);
}

// PyTorch's alloc signature: void*(size_t size, int device, cudaStream_t stream).
void* gmem_torch_shim_malloc(ssize_t size, int device, void* stream) {
  // Empty tensors ask for 0 bytes; PyTorch never frees a null pointer, so none is needed.
  if (size <= 0) return nullptr;
  if (g_malloc == nullptr) {
    C10_THROW_ERROR(Error, "gmem: the torch shim is not bound; call gmem.torch.enable()");
  }
  void* ptr = nullptr;
  const int status = g_malloc(&ptr, static_cast<std::size_t>(size), device,
                              reinterpret_cast<std::uintptr_t>(stream));
  if (status == 0) return ptr;
  std::string message = std::string("gmem: ") + g_last_error();
  if (status == kStatusOutOfMemory) C10_THROW_ERROR(OutOfMemoryError, message);
  C10_THROW_ERROR(Error, message);
}

// PyTorch's free signature: void(void* ptr, size_t size, int device, cudaStream_t stream).
// Runs inside destructors, where throwing would terminate the process: report and go on.
void gmem_torch_shim_free(void* ptr, ssize_t /*size*/, int /*device*/, void* /*stream*/) {
  if (ptr == nullptr || g_free == nullptr) return;
  if (g_free(ptr) != 0) std::fprintf(stderr, "gmem: free(%p) failed: %s\n", ptr, g_last_error());
}

}  // extern "C"
