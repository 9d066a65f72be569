// Device-to-device copies for gmem_copy_async: a kernel of gmem's own (copy_kernel.cu), because
// cudaMemcpyAsync between ranges mapped from many chunks, as gmem's are, ran up to 1.8x slower
// on an H200 than between cudaMalloc'd ones, while a kernel copied both at the same speed
// (docs/notes/2026-11-29-copies-run-slower-on-2-mib-chunks.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace gmem::cuda {

// Queues a copy of `bytes` from `src` to `dst` (ranges that do not overlap, on the current
// context's device) on `stream`: by the kernel where it is loaded into the current context,
// else by cuMemcpyDtoDAsync. The kernel is loaded at a context's first copy; it is not where
// the build had no nvcc, GMEM_COPY_KERNEL=0 is set, or the driver cannot load its PTX (older
// than the toolkit that built it). Throws DeviceError when the copy cannot be queued.
// `stream` is a CUstream (cudaStream_t) as an integer, as gmem's C API takes it.
void copy_device_to_device(std::uintptr_t dst, std::uintptr_t src, std::size_t bytes,
                           std::uintptr_t stream);

// Whether copies in the current context go through the kernel (loading it if need be): for
// tests and benchmarks.
bool copy_kernel_loaded();

}  // namespace gmem::cuda
