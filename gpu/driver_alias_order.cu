// A check of the CUDA driver alone (no gmem): one thread maps a chunk at X (a kernel writes it),
// maps it at Y, unmaps X before setting access on Y, then maps it at a third address Z. On an
// H100 (driver 580, 2026-11-24) this never failed in 600 runs, in any variant (kernels busy on
// another stream, the second map made while the first kernel ran), while the same order made by two
// threads broke the chunk (its map at Z failed with CUDA_ERROR_UNKNOWN; docs/design.md#a-driver-rule). Build and run on a GPU machine:
//   nvcc -arch=sm_90 -o driver_alias_order gpu/driver_alias_order.cu -lcuda && ./driver_alias_order
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstring>
#include <thread>
#include <atomic>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* n; cuGetErrorName(r_, &n); std::printf("  %s -> %s\n", #x, n); return 1; } } while (0)
static CUmemAccessDesc access;
static size_t g;
static CUmemAllocationProp prop;
__global__ void write(unsigned* p, size_t n, unsigned v) { for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = v; }
__global__ void spin(long long cycles) { long long t = clock64(); while (clock64() - t < cycles) {} }
int sequence(int variant, CUdeviceptr base, cudaStream_t s) {
  CUmemGenericAllocationHandle h;
  CK(cuMemCreate(&h, g, &prop, 0));
  CUdeviceptr X = base, Y = base + 4 * g, Z = base + 8 * g;
  CK(cuMemMap(X, g, 0, h, 0));
  CK(cuMemSetAccess(X, g, &access, 1));
  write<<<64, 256, 0, s>>>((unsigned*)X, g / 4, 1);
  if (variant != 2) cudaStreamSynchronize(s);
  CK(cuMemMap(Y, g, 0, h, 0));
  if (variant == 2) cudaStreamSynchronize(s);
  CK(cuMemUnmap(X, g));
  CK(cuMemSetAccess(Y, g, &access, 1));
  write<<<64, 256, 0, s>>>((unsigned*)Y, g / 4, 2);
  CUresult r = cuMemMap(Z, g, 0, h, 0);
  const char* n; cuGetErrorName(r, &n);
  if (r != CUDA_SUCCESS) std::printf("variant %d: map at a third address -> %s\n", variant, n);
  cudaStreamSynchronize(s);
  if (r == CUDA_SUCCESS) { CK(cuMemSetAccess(Z, g, &access, 1)); CK(cuMemUnmap(Z, g)); }
  CK(cuMemUnmap(Y, g));
  CK(cuMemRelease(h));
  return r != CUDA_SUCCESS;
}
int main() {
  cudaSetDevice(0); cudaFree(nullptr);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr base;
  CK(cuMemAddressReserve(&base, 16 * g, g, 0, 0));
  cudaStream_t s, busy;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking);
  for (int variant = 0; variant < 3; ++variant) {
    int bad = 0;
    std::atomic<bool> stop{false};
    std::thread noise;
    if (variant >= 1) noise = std::thread([&] { cudaSetDevice(0); while (!stop) { spin<<<1, 1, 0, busy>>>(100000); cudaStreamSynchronize(busy); } });
    for (int i = 0; i < 200; ++i) bad += sequence(variant, base, s);
    stop = true;
    if (noise.joinable()) noise.join();
    std::printf("variant %d: %d of 200 failed\n", variant, bad);
  }
}
