// A measurement of the CUDA driver alone (no gmem): do maps and set-access calls made on another
// thread slow the host's kernel launches on this one? The main thread launches 40,000 small
// kernels (syncing every 64) while a helper thread maps and sets access on 3,000 pages of 2 MiB
// (the size of gmem's plan region for a Llama run) -- or, with helper 0, does nothing. On an H100
// (driver 580, 2026-11-24) the launches took 3.46-4.10 us each with the helper mapping (111-123 ms
// for its 3,000 pages, 37-41 us a page) and 3.70-3.95 us without: the mapping costs the launching
// thread nothing (docs/notes/2026-11-24-timed-live-the-planned-path-is-not-it.md). Build and run on a GPU machine:
//   nvcc -O2 -o background_maps gpu/background_maps.cu -lcuda && ./background_maps 3000 0 && ./background_maps 3000 1
#include <cuda.h>
#include <cuda_runtime.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { printf("%s failed %d at %d\n", #x, r, __LINE__); exit(1); } } while (0)
__global__ void tiny(float* a) { if (threadIdx.x == 0) a[blockIdx.x] += 1.f; }
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  const int pages = argc > 1 ? atoi(argv[1]) : 3000;
  const bool helper = argc > 2 && atoi(argv[2]);
  cudaFree(0);
  CUcontext ctx; CK(cuCtxGetCurrent(&ctx));
  CUdevice dev; CK(cuCtxGetDevice(&dev));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = dev;
  const size_t page = 2 << 20;
  std::vector<CUmemGenericAllocationHandle> h(pages);
  for (auto& x : h) CK(cuMemCreate(&x, page, &prop, 0));
  CUdeviceptr va; CK(cuMemAddressReserve(&va, pages * page, 0, 0, 0));
  CUmemAccessDesc acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  float* buf; cudaMalloc(&buf, 1 << 20);
  cudaStream_t s; cudaStreamCreate(&s);
  std::atomic<bool> go{false}; double map_s = 0;
  std::thread t([&] {
    CK(cuCtxSetCurrent(ctx));
    while (!go) {}
    if (!helper) return;
    double t0 = now();
    for (int i = 0; i < pages; ++i) { CK(cuMemMap(va + i * page, page, 0, h[i], 0)); CK(cuMemSetAccess(va + i * page, page, &acc, 1)); }
    map_s = now() - t0;
  });
  const int N = 40000;
  for (int i = 0; i < 1000; ++i) tiny<<<4, 32, 0, s>>>(buf);
  cudaStreamSynchronize(s);
  go = true;
  double t0 = now();
  for (int i = 0; i < N; ++i) { tiny<<<4, 32, 0, s>>>(buf); if (i % 64 == 63) cudaStreamSynchronize(s); }
  cudaStreamSynchronize(s);
  double launch_s = now() - t0;
  t.join();
  printf("helper %d pages %d: %d launches %.1f ms (%.2f us each); helper maps %.1f ms (%.1f us a page)\n", helper, pages, N, launch_s * 1e3, launch_s / N * 1e6, map_s * 1e3, map_s / pages * 1e6);
  return 0;
}
