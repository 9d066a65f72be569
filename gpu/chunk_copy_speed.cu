// A question for the CUDA driver alone (no gmem): does a copy between two buffers built from
// small physical allocations run slower than between cudaMalloc'd ones, and does the order in
// which the allocations are created change that? (docs/notes/2026-11-29-copies-run-slower-on-2-mib-chunks.md:
// under gmem an 8 GiB copy ran 8-78% slower, reads and writes alone at full speed.) Times a
// float4 copy kernel from buffer A into buffer B, each `kBytes`, built as:
//   malloc       two cudaMalloc buffers
//   2M in order  2 MiB chunks, all of A's created, then all of B's (as gmem creates them)
//   2M paired    2 MiB chunks created A0, B0, A1, B1, ...
//   2M shuffled  2 MiB chunks created in one pool, then handed out in a shuffled order
//   32M in order 32 MiB chunks, A's then B's
// and the 2 MiB and 32 MiB cases again with the chunks GPUDirect RDMA capable (gmem's CudaDevice
// asks for that wherever the device supports it with VMM), each mapped in address order and made readable and writable, then the copy's median over 20.
// Each copy is timed as a kernel and as cudaMemcpyAsync. Also, with both ranges in one reservation as large as the device (as gmem's arenas are), B
// below A or after it; and, built with -DWITH_GMEM, two blocks from gmem_malloc.
// Build and run on a GPU machine:
//   nvcc -O2 -o chunk_copy_speed gpu/chunk_copy_speed.cu -lcuda && ./chunk_copy_speed
//   nvcc -O2 -DWITH_GMEM -Iinclude -o chunk_copy_speed gpu/chunk_copy_speed.cu -lcuda \
//     -Lbuild-gpu -lgmem && LD_LIBRARY_PATH=build-gpu ./chunk_copy_speed
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <cstdio>
#include <random>
#include <vector>

#ifdef WITH_GMEM
#include "gmem/gmem.h"
#endif

#define CK(x)                                                                                    \
  do {                                                                                           \
    CUresult r_ = (x);                                                                           \
    if (r_ != CUDA_SUCCESS) {                                                                    \
      const char* n;                                                                             \
      cuGetErrorName(r_, &n);                                                                    \
      std::printf("%s -> %s (line %d)\n", #x, n, __LINE__);                                     \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

constexpr size_t kBytes = size_t{8} << 30;

__global__ void copy(const float4* __restrict__ in, float4* __restrict__ out, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    out[i] = in[i];
}

// The copy as a kernel (`memcpy` false) or as cudaMemcpyAsync device to device, which
// PyTorch's copy_ of a contiguous tensor into one of the same type makes.
float time_copy(CUdeviceptr a, CUdeviceptr b, bool memcpy = false) {
  const size_t n = kBytes / sizeof(float4);
  cudaEvent_t start, end;
  cudaEventCreate(&start);
  cudaEventCreate(&end);
  std::vector<float> ms;
  for (int rep = 0; rep < 21; ++rep) {
    cudaEventRecord(start);
    if (memcpy)
      cudaMemcpyAsync(reinterpret_cast<void*>(b), reinterpret_cast<const void*>(a), kBytes,
                      cudaMemcpyDeviceToDevice);
    else
      copy<<<132 * 16, 256>>>(reinterpret_cast<const float4*>(a), reinterpret_cast<float4*>(b), n);
    cudaEventRecord(end);
    cudaEventSynchronize(end);
    float t = 0;
    cudaEventElapsedTime(&t, start, end);
    if (rep > 0) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  return ms[ms.size() / 2];
}

struct Mapped {
  CUdeviceptr a = 0, b = 0;
  CUdeviceptr base = 0;  // one reservation for both (arena), of `whole` bytes
  size_t whole = 0;
  std::vector<CUmemGenericAllocationHandle> handles;
};

// Two ranges of kBytes, each mapped from `chunk`-sized allocations; `order(i)` says which
// allocation (0 .. 2 * count - 1, in creation order) backs piece i of A (i < count) or of B.
template <class Order>
Mapped build(size_t chunk, Order order, bool rdma, int arena = 0) {
  CUmemAllocationProp prop = {};
  prop.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const size_t count = kBytes / chunk;
  Mapped m;
  m.handles.resize(2 * count);
  for (auto& h : m.handles) CK(cuMemCreate(&h, chunk, &prop, 0));
  if (arena == 0) {
    CK(cuMemAddressReserve(&m.a, kBytes, 0, 0, 0));
    CK(cuMemAddressReserve(&m.b, kBytes, 0, 0, 0));
  } else {
    size_t total = 0, free = 0;
    cuMemGetInfo(&free, &total);
    m.whole = (total + chunk - 1) / chunk * chunk;
    CK(cuMemAddressReserve(&m.base, m.whole, chunk, 0, 0));
    m.a = arena == 1 ? m.base + m.whole - kBytes : m.base;
    m.b = arena == 1 ? m.a - kBytes : m.a + kBytes;
  }
  for (size_t i = 0; i < 2 * count; ++i) {
    const CUdeviceptr at = (i < count ? m.a : m.b) + (i % count) * chunk;
    CK(cuMemMap(at, chunk, 0, m.handles[order(i)], 0));
  }
  CK(cuMemSetAccess(m.a, kBytes, &access, 1));
  CK(cuMemSetAccess(m.b, kBytes, &access, 1));
  return m;
}

void release(Mapped& m) {
  CK(cuMemUnmap(m.a, kBytes));
  CK(cuMemUnmap(m.b, kBytes));
  if (m.whole) {
    CK(cuMemAddressFree(m.base, m.whole));
  } else {
    CK(cuMemAddressFree(m.a, kBytes));
    CK(cuMemAddressFree(m.b, kBytes));
  }
  for (auto h : m.handles) CK(cuMemRelease(h));
}

int main() {
  cudaSetDevice(0);
  cudaFree(nullptr);
  {
    void *a, *b;
    cudaMalloc(&a, kBytes);
    cudaMalloc(&b, kBytes);
    cudaMemset(a, 0, kBytes);
    const CUdeviceptr da = reinterpret_cast<CUdeviceptr>(a), db = reinterpret_cast<CUdeviceptr>(b);
    std::printf("malloc        kernel %.3f ms, cudaMemcpyAsync %.3f ms\n", time_copy(da, db),
                time_copy(da, db, true));
    cudaFree(a);
    cudaFree(b);
  }
  const size_t small = size_t{2} << 20, count = kBytes / small;
  std::vector<size_t> shuffled(2 * count);
  for (size_t i = 0; i < shuffled.size(); ++i) shuffled[i] = i;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937_64(1));
  struct Case {
    const char* name;
    size_t chunk;
    std::function<size_t(size_t)> order;
    bool rdma = false;
    int arena = 0;
  };
  for (int round = 0; round < 2; ++round) {
    const Case cases[] = {
        {"2M in order ", small, [](size_t i) { return i; }},
        {"2M paired   ", small, [count](size_t i) { return i < count ? 2 * i : 2 * (i - count) + 1; }},
        {"2M shuffled ", small, [&shuffled](size_t i) { return shuffled[i]; }},
        {"32M in order", size_t{32} << 20, [](size_t i) { return i; }},
        {"2M rdma     ", small, [](size_t i) { return i; }, true},
        {"32M rdma    ", size_t{32} << 20, [](size_t i) { return i; }, true},
        {"2M arena, B below A", small, [](size_t i) { return i; }, false, 1},
        {"2M arena, B after A", small, [](size_t i) { return i; }, false, 2},
        {"32M arena, B below A", size_t{32} << 20, [](size_t i) { return i; }, false, 1},
    };
    for (const Case& c : cases) {
      Mapped m = build(c.chunk, c.order, c.rdma, c.arena);
      std::printf("%s  kernel %.3f ms, cudaMemcpyAsync %.3f ms\n", c.name, time_copy(m.a, m.b),
                  time_copy(m.a, m.b, true));
      release(m);
    }
  }
#ifdef WITH_GMEM
  for (int round = 0; round < 2; ++round) {
    void *a = nullptr, *b = nullptr;
    if (gmem_malloc(&a, kBytes, 0, 0) != 0 || gmem_malloc(&b, kBytes, 0, 0) != 0) {
      std::printf("gmem_malloc failed\n");
      return 1;
    }
    const CUdeviceptr da = reinterpret_cast<CUdeviceptr>(a), db = reinterpret_cast<CUdeviceptr>(b);
    std::printf("gmem (A %p, B %p)  kernel %.3f ms, cudaMemcpyAsync %.3f ms\n", a, b,
                time_copy(da, db), time_copy(da, db, true));
    gmem_free(a);
    gmem_free(b);
  }
#endif
  return 0;
}
