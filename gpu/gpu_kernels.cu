#include "gpu/gpu_kernels.cuh"

namespace gmem::gpu_test {
namespace {

__device__ std::uint32_t pattern(std::uint32_t seed, std::size_t index) {
  std::uint32_t x = seed * 0x9E3779B1u ^ static_cast<std::uint32_t>(index) * 0x85EBCA6Bu ^
                    static_cast<std::uint32_t>(index >> 32);
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  return x;
}

__device__ std::uint64_t now_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void fill_kernel(std::uint32_t* words, std::size_t count, std::uint32_t seed,
                            std::uint64_t delay_ns) {
  if (delay_ns != 0) {
    const std::uint64_t start = now_ns();
    while (now_ns() - start < delay_ns) __nanosleep(1000);
  }
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < count;
       i += std::size_t{gridDim.x} * blockDim.x) {
    words[i] = pattern(seed, i);
  }
}

__global__ void count_kernel(const std::uint32_t* words, std::size_t count, std::uint32_t seed,
                             unsigned long long* bad) {
  unsigned long long local = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < count;
       i += std::size_t{gridDim.x} * blockDim.x) {
    if (words[i] != pattern(seed, i)) ++local;
  }
  if (local != 0) atomicAdd(bad, local);
}

constexpr unsigned kThreads = 256;
unsigned blocks_for(std::size_t count) {
  const std::size_t wanted = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(wanted < 1024 ? (wanted == 0 ? 1 : wanted) : 1024);
}

}  // namespace

void delayed_fill(void* ptr, std::size_t bytes, std::uint32_t seed, cudaStream_t stream,
                  std::uint64_t delay_ns) {
  const std::size_t count = bytes / 4;
  fill_kernel<<<blocks_for(count), kThreads, 0, stream>>>(static_cast<std::uint32_t*>(ptr), count,
                                                         seed, delay_ns);
  GPU_CHECK(cudaGetLastError());
}

void fill(void* ptr, std::size_t bytes, std::uint32_t seed, cudaStream_t stream) {
  delayed_fill(ptr, bytes, seed, stream, 0);
}

unsigned long long mismatches(const void* ptr, std::size_t bytes, std::uint32_t seed) {
  const std::size_t count = bytes / 4;
  unsigned long long* bad = nullptr;
  GPU_CHECK(cudaMallocManaged(&bad, sizeof *bad));
  *bad = 0;
  count_kernel<<<blocks_for(count), kThreads>>>(static_cast<const std::uint32_t*>(ptr), count,
                                               seed, bad);
  GPU_CHECK(cudaGetLastError());
  GPU_CHECK(cudaDeviceSynchronize());
  const unsigned long long result = *bad;
  GPU_CHECK(cudaFree(bad));
  return result;
}

}  // namespace gmem::gpu_test
