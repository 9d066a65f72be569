// A measurement of the CUDA driver alone (no gmem): does mapping each chunk at several addresses
// (gmem's aliases) slow the host's CUDA calls? 4,000 chunks of 2 MiB, each mapped at 1, 2 or 4
// addresses; host time per kernel launch, cudaMemsetAsync and cudaMemcpyAsync on the last
// mapping. On an H100 (driver 580, 2026-11-24): launch 3.61 / 4.38 / 3.54 us, memset 2.58 / 2.52
// / 2.85, memcpy 6.55 / 5.63 / 7.08 (1 / 2 / 4 mappings): no cost that grows with aliases.
// Build and run on a GPU machine:
//   nvcc -O2 -o alias_calls gpu/alias_calls.cu -lcuda && for a in 1 2 4; do ./alias_calls $a 4000; done
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <vector>
#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { printf("%s failed %d at %d\n", #x, r, __LINE__); return 1; } } while (0)
__global__ void touch(float* a, float* b, float* c) { if (threadIdx.x == 0 && blockIdx.x == 0) c[0] = a[0] + b[0]; }
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  int aliases = argc > 1 ? atoi(argv[1]) : 1;
  size_t nchunks = argc > 2 ? atoi(argv[2]) : 4000;
  cudaFree(0);
  CUdevice dev; CK(cuCtxGetDevice(&dev));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = dev;
  const size_t page = 2 << 20;
  std::vector<CUdeviceptr> bases(aliases);
  for (auto& b : bases) CK(cuMemAddressReserve(&b, nchunks * page, 0, 0, 0));
  CUmemAccessDesc acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (size_t i = 0; i < nchunks; ++i) {
    CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, page, &prop, 0));
    for (auto b : bases) { CK(cuMemMap(b + i * page, page, 0, h, 0)); CK(cuMemSetAccess(b + i * page, page, &acc, 1)); }
    CK(cuMemRelease(h));
  }
  cudaStream_t s; cudaStreamCreate(&s);
  float* base = (float*)bases.back();
  const int N = 20000;
  for (int rep = 0; rep < 3; ++rep) {
    double t0 = now();
    for (int k = 0; k < N; ++k) {
      size_t i = (k * 7919) % nchunks;
      touch<<<1, 32, 0, s>>>(base + i * (page / 4), base + ((i + 1) % nchunks) * (page / 4), base + ((i + 2) % nchunks) * (page / 4));
    }
    double t1 = now(); cudaStreamSynchronize(s); double t2 = now();
    for (int k = 0; k < N; ++k) { size_t i = (k * 7919) % nchunks; cudaMemsetAsync(base + i * (page / 4), 0, 4096, s); }
    double t3 = now(); cudaStreamSynchronize(s); double t4 = now();
    for (int k = 0; k < N; ++k) { size_t i = (k * 7919) % nchunks; cudaMemcpyAsync(base + i * (page / 4), base + ((i + 3) % nchunks) * (page / 4), 4096, cudaMemcpyDeviceToDevice, s); }
    double t5 = now(); cudaStreamSynchronize(s); double t6 = now();
    printf("aliases %d chunks %zu: launch %.2f us  memset %.2f us  memcpy %.2f us (host per call)\n", aliases, nchunks,
           (t1 - t0) / N * 1e6, (t3 - t2) / N * 1e6, (t5 - t4) / N * 1e6);
  }
  return 0;
}
