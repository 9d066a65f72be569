// Kernels and host helpers for the GPU tests: fill a block with a pattern unique to (seed, index),
// count words that differ from it, and fill after a delay (to keep a stream busy).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace gmem::gpu_test {

inline void check(cudaError_t result, const char* what) {
  if (result != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(result) + " (" +
                             cudaGetErrorString(result) + ")");
  }
}
#define GPU_CHECK(expr) ::gmem::gpu_test::check((expr), #expr)

// Enqueues a fill of `bytes` (a multiple of 4) at `ptr` with the pattern of `seed` on `stream`.
void fill(void* ptr, std::size_t bytes, std::uint32_t seed, cudaStream_t stream);
// Like fill, but the kernel first spins for `delay_ns` nanoseconds on the GPU.
void delayed_fill(void* ptr, std::size_t bytes, std::uint32_t seed, cudaStream_t stream,
                  std::uint64_t delay_ns);
// Synchronously counts 32-bit words at `ptr` that do not hold the pattern of `seed`.
unsigned long long mismatches(const void* ptr, std::size_t bytes, std::uint32_t seed);

}  // namespace gmem::gpu_test
