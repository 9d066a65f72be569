// Counts global operator new in a process it is preloaded into (LD_PRELOAD): test_torch_gpu.py's
// host-allocation test compiles it at test time and starts a Python child with it, so that the
// calls libtorch, libc10, libgmem.so and gmem's allocator extension make to operator new (through
// their PLT, to the first definition in the process: this one) are counted.
//
// Every form is replaced (plain, array, nothrow, aligned, aligned nothrow), as in
// tests/unit/capi_host_alloc_test.cpp, and each delete frees what its new allocated. Counting is
// off until count_new_start(): per thread (only the calling thread's calls, so that torch's other
// threads do not count) and, for the record, over all threads.
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

namespace {

std::atomic<long> g_this_thread{0};  // calls by threads between their start and stop
std::atomic<long> g_all_threads{0};  // calls by any thread while some window is open
std::atomic<int> g_open{0};
// initial-exec: a preloaded library's TLS is in the static block, reached without a call.
__attribute__((tls_model("initial-exec"))) thread_local bool t_counting = false;

inline void count() {
  if (t_counting) g_this_thread.fetch_add(1, std::memory_order_relaxed);
  if (g_open.load(std::memory_order_relaxed) != 0) g_all_threads.fetch_add(1, std::memory_order_relaxed);
}

void* allocate(std::size_t size) {
  count();
  return std::malloc(size == 0 ? 1 : size);
}

void* allocate_aligned(std::size_t size, std::align_val_t align) {
  count();
  const auto a = static_cast<std::size_t>(align);
  return std::aligned_alloc(a, (size + a - 1) / a * a + (size == 0 ? a : 0));
}

}  // namespace

extern "C" {

// Zeroes both counts and starts counting on the calling thread.
void count_new_start() {
  g_this_thread.store(0);
  g_all_threads.store(0);
  t_counting = true;
  g_open.store(1);
}

// Stops counting; returns the calls the calling thread made since its start.
long count_new_stop() {
  g_open.store(0);
  t_counting = false;
  return g_this_thread.load();
}

// The calls all threads made in the last window (start to stop).
long count_new_all_threads() { return g_all_threads.load(); }

}  // extern "C"

void* operator new(std::size_t size) {
  if (void* p = allocate(size)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) {
  if (void* p = allocate(size)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t size, const std::nothrow_t&) noexcept { return allocate(size); }
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept { return allocate(size); }
void* operator new(std::size_t size, std::align_val_t align) {
  if (void* p = allocate_aligned(size, align)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size, std::align_val_t align) {
  if (void* p = allocate_aligned(size, align)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t size, std::align_val_t align, const std::nothrow_t&) noexcept {
  return allocate_aligned(size, align);
}
void* operator new[](std::size_t size, std::align_val_t align, const std::nothrow_t&) noexcept {
  return allocate_aligned(size, align);
}

void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
