// A measurement of the CUDA driver alone (no gmem): do VMM calls made on several threads at once
// finish sooner than the same calls on one? For T = 1, 2, 4, 8 threads, each taking a contiguous
// share of `pages` pages of 2 MiB: cuMemCreate of every chunk, cuMemMap + cuMemSetAccess of each
// page (a page per call, as gmem makes them), cuMemUnmap, cuMemRelease; wall time of each phase.
// If the driver serializes them, more threads gain nothing; if not, a malloc that maps many pages
// (a plan region's first use, a model loaded onto an empty device) could spread its calls.
// Build and run on a GPU machine:
//   nvcc -O2 -o parallel_maps gpu/parallel_maps.cu -lcuda && ./parallel_maps 4096
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#define CK(x)                                                          \
  do {                                                                 \
    CUresult r = (x);                                                  \
    if (r != CUDA_SUCCESS) {                                           \
      std::printf("%s failed %d at line %d\n", #x, r, __LINE__);       \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  const int pages = argc > 1 ? std::atoi(argv[1]) : 4096;
  cudaFree(0);
  CUcontext ctx;
  CK(cuCtxGetCurrent(&ctx));
  CUdevice dev;
  CK(cuCtxGetDevice(&dev));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  const size_t page = 2 << 20;
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, pages * page, 0, 0, 0));
  std::vector<CUmemGenericAllocationHandle> h(pages);

  // Runs body(i) for every page, the pages split into `threads` contiguous shares.
  auto spread = [&](int threads, auto body) {
    const double t0 = now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        CK(cuCtxSetCurrent(ctx));
        for (int i = pages * t / threads; i < pages * (t + 1) / threads; ++i) body(i);
      });
    for (auto& th : pool) th.join();
    return (now() - t0) * 1e6 / pages;  // us a page
  };
  for (int round = 0; round < 2; ++round)
    for (int threads : {1, 2, 4, 8}) {
      const double create = spread(threads, [&](int i) { CK(cuMemCreate(&h[i], page, &prop, 0)); });
      const double map = spread(threads, [&](int i) {
        CK(cuMemMap(va + i * page, page, 0, h[i], 0));
        CK(cuMemSetAccess(va + i * page, page, &access, 1));
      });
      CK(cuMemsetD8(va, 1, pages * page));  // the pages work
      CK(cuCtxSynchronize());
      const double unmap = spread(threads, [&](int i) { CK(cuMemUnmap(va + i * page, page)); });
      const double release = spread(threads, [&](int i) { CK(cuMemRelease(h[i])); });
      std::printf("round %d threads %d pages %d: us a page: create %.1f  map+set-access %.1f  "
                  "unmap %.1f  release %.1f\n",
                  round, threads, pages, create, map, unmap, release);
    }
  return 0;
}
