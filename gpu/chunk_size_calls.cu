// A measurement of the CUDA driver alone (no gmem): what do cuMemCreate, cuMemMap, cuMemSetAccess,
// cuMemUnmap and cuMemRelease cost per 2 MiB of memory as the physical chunk grows from 2 MiB to
// 1 GiB? And can one cuMemUnmap / cuMemSetAccess span many 2 MiB mappings for less? Maps `total`
// MiB (default 4096) in chunks of each size, twice, and prints the second round in us per 2 MiB.
// Build and run on a GPU machine:
//   nvcc -O2 -o chunk_size_calls gpu/chunk_size_calls.cu -lcuda && ./chunk_size_calls 4096
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* n; cuGetErrorName(r_, &n); std::printf("%s -> %s (line %d)\n", #x, n, __LINE__); return 1; } } while (0)
static double now_us() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  const size_t total_mib = argc > 1 ? std::atoi(argv[1]) : 4096;
  cudaSetDevice(0); cudaFree(nullptr);
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  CUmemAccessDesc acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const size_t page = 2 << 20, total = total_mib << 20, pages = total / page;
  CUdeviceptr base; CK(cuMemAddressReserve(&base, total, 1 << 30, 0, 0));
  std::printf("%zu MiB; us per 2 MiB page: create map set_access(per chunk) unmap release | set_access(one call) unmap(one call)\n", total_mib);
  for (size_t chunk_mib : {2, 8, 32, 128, 512, 1024}) {
    const size_t chunk = chunk_mib << 20, n = total / chunk;
    for (int round = 0; round < 2; ++round) {
      std::vector<CUmemGenericAllocationHandle> h(n);
      double t = now_us();
      for (auto& x : h) CK(cuMemCreate(&x, chunk, &prop, 0));
      const double create = now_us() - t; t = now_us();
      for (size_t i = 0; i < n; ++i) CK(cuMemMap(base + i * chunk, chunk, 0, h[i], 0));
      const double map = now_us() - t; t = now_us();
      for (size_t i = 0; i < n; ++i) CK(cuMemSetAccess(base + i * chunk, chunk, &acc, 1));
      const double access = now_us() - t; t = now_us();
      for (size_t i = 0; i < n; ++i) CK(cuMemUnmap(base + i * chunk, chunk));
      const double unmap = now_us() - t;
      // Again, with one set-access call and one unmap call over the whole range.
      for (size_t i = 0; i < n; ++i) CK(cuMemMap(base + i * chunk, chunk, 0, h[i], 0));
      t = now_us();
      CK(cuMemSetAccess(base, total, &acc, 1));
      const double access1 = now_us() - t; t = now_us();
      CUresult r = cuMemUnmap(base, total);
      const double unmap1 = now_us() - t;
      if (r != CUDA_SUCCESS) for (size_t i = 0; i < n; ++i) CK(cuMemUnmap(base + i * chunk, chunk));
      t = now_us();
      for (auto x : h) CK(cuMemRelease(x));
      const double release = now_us() - t;
      if (round == 1)
        std::printf("chunk %4zu MiB: %7.2f %6.2f %7.2f %6.2f %6.2f | %7.2f %6.2f%s\n", chunk_mib, create / pages,
                    map / pages, access / pages, unmap / pages, release / pages, access1 / pages, unmap1 / pages,
                    r == CUDA_SUCCESS ? "" : " (one unmap refused)");
    }
  }
  // Memory already in use by kernels: does set-access cost more when the GPU is busy? (a memset
  // over 1 GiB elsewhere queued before each call)
  return 0;
}
