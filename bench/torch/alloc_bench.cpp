// Allocation speed of gmem, PyTorch's caching allocator and cudaMallocAsync, each driven by the
// same C++ loop in one process, so the ratios hold whatever the machine. Built and called (via
// ctypes) by alloc_bench.py, after `import torch` and torch.cuda.init().
//
//   pair:  malloc + free of one size, repeated (the steady state of a training loop)
//   churn: `slots` live blocks; each op frees a random slot and refills it with a new size drawn
//          log-uniformly from [min, max] (fragmentation pressure, cache misses)
//   trace: a real program's mallocs and frees, in its order and sizes, replayed pass after pass
//          (each pass frees what the trace left alive): the first warms the allocator up (its
//          steps' layouts, PyTorch's cached segments), the last is timed; gmem is told where the
//          trace's training steps end, as gmem.torch tells it after each optimizer step
// Results are nanoseconds per pair / per op (one free + one malloc); negative on failure.
#ifndef GMEM_BENCH_NO_TORCH
#include <c10/cuda/CUDACachingAllocator.h>
#endif
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <vector>

namespace {

using GmemMalloc = int (*)(void** ptr, std::size_t size, int device, std::uintptr_t stream);
using GmemFree = int (*)(void* ptr);
using GmemMarkStep = int (*)(int device);
GmemMalloc g_gmem_malloc = nullptr;
GmemFree g_gmem_free = nullptr;
GmemMarkStep g_gmem_mark_step = nullptr;

enum Backend : int { kTorch = 0, kGmem = 1, kMallocAsync = 2 };

#ifndef GMEM_BENCH_NO_TORCH
struct Torch {
  void* alloc(std::size_t n) {
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(n, nullptr);
  }
  void release(void* p) { c10::cuda::CUDACachingAllocator::raw_delete(p); }
  void mark_step() {}  // PyTorch's allocator has no notion of steps
};
#endif

struct Gmem {
  void* alloc(std::size_t n) {
    void* p = nullptr;
    return g_gmem_malloc(&p, n, -1, 0) == 0 ? p : nullptr;
  }
  void release(void* p) { g_gmem_free(p); }
  void mark_step() {
    if (g_gmem_mark_step != nullptr) g_gmem_mark_step(-1);
  }
};

struct MallocAsync {
  void* alloc(std::size_t n) {
    void* p = nullptr;
    return cudaMallocAsync(&p, n, nullptr) == cudaSuccess ? p : nullptr;
  }
  void release(void* p) { cudaFreeAsync(p, nullptr); }
  void mark_step() {}
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

template <class A>
double pair(A a, std::size_t size, int iterations) {
  for (int i = 0; i < 100; ++i) a.release(a.alloc(size));  // warm the cache
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) {
    void* p = a.alloc(size);
    if (p == nullptr) return -1.0;
    a.release(p);
  }
  cudaDeviceSynchronize();
  return seconds_since(start) * 1e9 / iterations;
}

template <class A>
double churn(A a, int slots, int ops, std::size_t min_size, std::size_t max_size, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_size(std::log(double(min_size)),
                                                  std::log(double(max_size)));
  std::uniform_int_distribution<int> pick(0, slots - 1);
  auto draw = [&] { return (std::size_t(std::exp(log_size(rng))) + 511) / 512 * 512; };
  std::vector<std::size_t> sizes(std::size_t(ops) * 2);
  std::vector<int> victims(std::size_t(ops) * 2);
  for (auto& s : sizes) s = draw();
  for (auto& v : victims) v = pick(rng);
  std::vector<void*> live(std::size_t(slots), nullptr);
  for (auto& p : live) {
    p = a.alloc(draw());
    if (p == nullptr) return -1.0;
  }
  double result = -1.0;
  // First half warms the allocator up; the second half, a different sequence, is timed.
  for (int half = 0; half < 2; ++half) {
    const auto start = std::chrono::steady_clock::now();
    bool ok = true;
    for (int i = half * ops; i < (half + 1) * ops && ok; ++i) {
      void*& slot = live[std::size_t(victims[i])];
      a.release(slot);
      slot = a.alloc(sizes[i]);
      ok = slot != nullptr;
    }
    cudaDeviceSynchronize();
    result = ok ? seconds_since(start) * 1e9 / ops : -1.0;
    if (!ok) break;
  }
  for (void* p : live)
    if (p != nullptr) a.release(p);
  cudaDeviceSynchronize();
  return result;
}

// ops[i] >= 0: malloc sizes[i] bytes into slot ops[i]; ops[i] < 0: free slot -ops[i] - 1. A step
// ends before op i where marks[i] != 0. Writes ns per op of each pass into `out`; returns the
// timed (last) pass's, or -1 where a malloc failed.
template <class A>
double trace(A a, const int* ops, const std::size_t* sizes, const unsigned char* marks, int n,
             int slots, int passes, double* out) {
  std::vector<void*> live(std::size_t(slots), nullptr);
  const auto release_all = [&] {
    for (void*& p : live)
      if (p != nullptr) a.release(p), p = nullptr;
  };
  double result = -1.0;
  for (int pass = 0; pass < passes; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) {
      if (marks[i]) a.mark_step();
      if (ops[i] >= 0) {
        void*& slot = live[std::size_t(ops[i])];
        slot = a.alloc(sizes[i]);
        if (slot == nullptr) {
          release_all();
          return -1.0;
        }
      } else {
        void*& slot = live[std::size_t(-ops[i] - 1)];
        if (slot != nullptr) a.release(slot);
        slot = nullptr;
      }
    }
    cudaDeviceSynchronize();
    result = out[pass] = seconds_since(start) * 1e9 / n;
    release_all();  // what the trace left alive: the next pass starts where this one did
    cudaDeviceSynchronize();
  }
  return result;
}

// `loop(allocator)` with the backend's allocator: -2 where it threw, -3 for a backend not here
// (PyTorch's, built without torch; gmem's, before gmem_bench_bind).
template <class Loop>
double on_backend(int backend, Loop&& loop) {
  try {
    switch (backend) {
#ifndef GMEM_BENCH_NO_TORCH
      case kTorch: return loop(Torch{});
#endif
      case kGmem: return g_gmem_malloc ? loop(Gmem{}) : -3.0;
      case kMallocAsync: return loop(MallocAsync{});
      default: return -3.0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "alloc_bench: %s\n", e.what());
    return -2.0;
  }
}

}  // namespace

extern "C" {

void gmem_bench_bind(void* gmem_malloc, void* gmem_free) {
  g_gmem_malloc = reinterpret_cast<GmemMalloc>(gmem_malloc);
  g_gmem_free = reinterpret_cast<GmemFree>(gmem_free);
}

double gmem_bench_pair(int backend, std::size_t size, int iterations) {
  return on_backend(backend, [&](auto a) { return pair(a, size, iterations); });
}

void gmem_bench_bind_mark_step(void* gmem_mark_step) {
  g_gmem_mark_step = reinterpret_cast<GmemMarkStep>(gmem_mark_step);
}

double gmem_bench_trace(int backend, const int* ops, const std::size_t* sizes,
                        const unsigned char* marks, int n, int slots, int passes, double* out) {
  return on_backend(backend,
                    [&](auto a) { return trace(a, ops, sizes, marks, n, slots, passes, out); });
}

double gmem_bench_churn(int backend, int slots, int ops, std::size_t min_size,
                        std::size_t max_size, unsigned seed) {
  return on_backend(backend,
                    [&](auto a) { return churn(a, slots, ops, min_size, max_size, seed); });
}

}  // extern "C"
