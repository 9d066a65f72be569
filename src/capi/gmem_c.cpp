// The C API (include/gmem/gmem.h) over the per-device engines of capi/registry.
#include "gmem/gmem.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>

#include "capi/observe.hpp"
#include "capi/registry.hpp"
#include "gmem/error.hpp"
#include "gmem/summary.hpp"

namespace {

using gmem::capi::DeviceContext;

thread_local std::string t_last_error;

gmem_status_t status_of(gmem::Errc code) {
  switch (code) {
    case gmem::Errc::invalid_argument: return GMEM_ERROR_INVALID_ARGUMENT;
    case gmem::Errc::out_of_memory: return GMEM_ERROR_OUT_OF_MEMORY;
    case gmem::Errc::invalid_pointer: return GMEM_ERROR_INVALID_POINTER;
    case gmem::Errc::double_free: return GMEM_ERROR_DOUBLE_FREE;
    case gmem::Errc::device_error: return GMEM_ERROR_DEVICE;
    case gmem::Errc::bad_input: return GMEM_ERROR_BAD_INPUT;
  }
  return GMEM_ERROR_DEVICE;
}

gmem_status_t fail(const char* function, gmem_status_t status, const std::string& message) {
  t_last_error = std::string(function) + ": " + message;
  return status;
}

// Runs `body`, turning every exception into a status and this thread's last error.
template <class Body>
gmem_status_t guarded(const char* function, Body&& body) noexcept {
  try {
    body();
    return GMEM_OK;
  } catch (const gmem::DeviceError& e) {
    // The driver itself out of memory (cuMemAlloc of a new segment, say) is still out of memory.
    return fail(function, e.device_out_of_memory() ? GMEM_ERROR_OUT_OF_MEMORY : GMEM_ERROR_DEVICE,
                e.what());
  } catch (const gmem::Error& e) {
    return fail(function, status_of(e.code()), e.what());
  } catch (const std::bad_alloc&) {
    return fail(function, GMEM_ERROR_OUT_OF_MEMORY, "host memory exhausted");
  } catch (const std::exception& e) {
    return fail(function, GMEM_ERROR_DEVICE, std::string("internal error: ") + e.what());
  } catch (...) {
    return fail(function, GMEM_ERROR_DEVICE, "internal error: unknown exception");
  }
}

gmem_engine& owner_of(const void* ptr) {
  gmem_engine* owner = gmem::capi::likely_owner(ptr);
  if (owner == nullptr) throw gmem::capi::foreign_pointer(ptr);
  return *owner;
}

std::string stats_text(int device) {
  std::ostringstream text;
  for (const auto& [name, value] : gmem::capi::context(device).stats(true).flatten()) {
    text << name << ' ' << value << '\n';
  }
  return text.str();
}

// snprintf-like: as much of `text` as fits, always terminated; *needed gets the full size.
void copy_text(const std::string& text, char* buf, size_t size, size_t* needed) {
  if (buf == nullptr && size != 0) {
    throw gmem::Error(gmem::Errc::invalid_argument, "buf is NULL but size is not 0");
  }
  if (needed != nullptr) *needed = text.size() + 1;
  if (size == 0) return;
  const std::size_t copied = text.size() < size ? text.size() : size - 1;
  std::memcpy(buf, text.data(), copied);
  buf[copied] = '\0';
}

// A stream argument is a cudaStream_t: 0 (the legacy default stream), 1 (cudaStreamLegacy),
// 2 (cudaStreamPerThread) or the address of a driver object, aligned and in user space. Checked
// without touching it (the driver may crash on a bad handle): what cannot be a stream is refused
// rather than taken as a new one.
void check_stream(uintptr_t stream) {
  if (stream <= 2 || (stream % 8 == 0 && stream < (uintptr_t{1} << 57))) return;
  char text[96];
  std::snprintf(text, sizeof text, "stream 0x%jx is not a CUDA stream handle",
                static_cast<std::uintmax_t>(stream));
  throw gmem::Error(gmem::Errc::invalid_argument, text);
}

// Torch calls these from deleters and destructors, where an exception would terminate the
// process: they report failures on stderr (and in gmem_last_error) instead of throwing.
void warn_on_failure(gmem_status_t status) {
  if (status != GMEM_OK) std::fprintf(stderr, "gmem: %s\n", t_last_error.c_str());
}

}  // namespace

// Shared with observe_c.cpp (declared in capi/observe.hpp).
namespace gmem::capi {
gmem_status_t run_guarded(const char* function, FunctionRef<void()> body) noexcept {
  return guarded(function, body);
}
void empty_cache(Engine& engine) {
  engine.empty_cache();
  static std::atomic<bool> said{false};
  if (said.load(std::memory_order_relaxed)) return;  // said once: the stats are not read again
  const MemoryStats s = engine.stats();
  if (s.empty_cache_kept_bytes == 0 || said.exchange(true)) return;
  std::fprintf(stderr,
               "gmem: empty_cache() is called after every step, and each call gave back memory "
               "that the next step created again (about 93 us of driver calls per 2 MiB). It now "
               "keeps what recent steps used (%.2f GiB beyond the blocks live now) and gives back "
               "the rest. GMEM_EMPTY_CACHE=strict makes every call give back everything "
               "(docs/notes/2026-11-24-empty-cache-after-every-step.md).\n",
               static_cast<double>(s.empty_cache_kept_bytes) / (1 << 30));
}

void copy_text_out(const std::string& text, char* buf, std::size_t size, std::size_t* needed) {
  copy_text(text, buf, size, needed);
}
}  // namespace gmem::capi

extern "C" {

const char* gmem_last_error(void) { return t_last_error.c_str(); }

gmem_status_t gmem_malloc(void** ptr, size_t size, int device, uintptr_t stream) {
  return guarded("gmem_malloc", [&] {
    if (ptr == nullptr) throw gmem::Error(gmem::Errc::invalid_argument, "ptr is NULL");
    *ptr = nullptr;
    check_stream(stream);
    *ptr = gmem::capi::observed_malloc(gmem::capi::context(device), size, stream);
  });
}

gmem_status_t gmem_free(void* ptr) {
  if (ptr == nullptr) return GMEM_OK;  // like free(NULL)
  return guarded("gmem_free", [&] { owner_of(ptr).engine->free(ptr); });
}

gmem_status_t gmem_record_stream(void* ptr, uintptr_t stream) {
  return guarded("gmem_record_stream", [&] {
    check_stream(stream);
    owner_of(ptr).engine->record_stream(ptr, stream);
  });
}

gmem_status_t gmem_empty_cache(int device) {
  return guarded("gmem_empty_cache", [&] {
    gmem::capi::empty_cache(*gmem::capi::context(device).engine);
  });
}

gmem_status_t gmem_mark_step(int device) {
  return guarded("gmem_mark_step", [&] { gmem::capi::context(device).engine->mark_step(); });
}

gmem_status_t gmem_set_memory_limit(int device, size_t bytes) {
  return guarded("gmem_set_memory_limit",
                 [&] { gmem::capi::context(device).engine->set_memory_limit(bytes); });
}

gmem_status_t gmem_set_memory_fraction(int device, double fraction) {
  return guarded("gmem_set_memory_fraction",
                 [&] { gmem::capi::context(device).engine->set_memory_fraction(fraction); });
}

gmem_status_t gmem_reset_peak_stats(int device) {
  return guarded("gmem_reset_peak_stats",
                 [&] { gmem::capi::context(device).reset_peak_stats(); });
}

gmem_status_t gmem_reset_accumulated_stats(int device) {
  return guarded("gmem_reset_accumulated_stats",
                 [&] { gmem::capi::context(device).reset_accumulated_stats(); });
}

gmem_status_t gmem_stat(int device, const char* name, int64_t* value) {
  return guarded("gmem_stat", [&] {
    if (name == nullptr || value == nullptr) {
      throw gmem::Error(gmem::Errc::invalid_argument, "name and value must not be NULL");
    }
    const bool derived = gmem::MemoryStats::is_derived(name);
    if (const auto v = gmem::capi::context(device).stats(derived).find(name)) {
      *value = *v;
      return;
    }
    throw gmem::Error(gmem::Errc::invalid_argument,
                      std::string("unknown statistic '") + name +
                          "' (gmem_stats_text lists them all)");
  });
}

gmem_status_t gmem_stats_text(int device, char* buf, size_t size, size_t* needed) {
  return guarded("gmem_stats_text", [&] { copy_text(stats_text(device), buf, size, needed); });
}

gmem_status_t gmem_memory_summary(int device, char* buf, size_t size, size_t* needed) {
  return guarded("gmem_memory_summary", [&] {
    DeviceContext& context = gmem::capi::context(device);
    gmem::SummaryOptions options;
    options.device = std::to_string(context.index);
    const gmem::MemoryStats stats = context.stats(true);
    options.cause = gmem::capi::tracked_cause(context, stats);
    copy_text(gmem::format_summary(stats, gmem::capi::tracked_top(context), options), buf, size, needed);
  });
}

void* gmem_torch_malloc(ssize_t size, int device, uintptr_t stream) {
  if (size == 0) return nullptr;  // empty tensors: torch accepts a null data pointer for them
  void* ptr = nullptr;
  const gmem_status_t status =
      size < 0 ? fail("gmem_torch_malloc", GMEM_ERROR_INVALID_ARGUMENT,
                      "negative size " + std::to_string(size))
               : gmem_malloc(&ptr, static_cast<size_t>(size), device, stream);
  // CUDAPluggableAllocator does not check for a null result (torch 2.11): returning one would
  // hand torch a tensor without memory. Throwing makes torch raise a RuntimeError carrying
  // this message instead. C and ctypes callers must use gmem_malloc.
  if (status != GMEM_OK) throw std::runtime_error(t_last_error);
  return ptr;
}

void gmem_torch_free(void* ptr, ssize_t /*size*/, int /*device*/, uintptr_t /*stream*/) {
  warn_on_failure(gmem_free(ptr));
}

void gmem_torch_empty_cache(void) {
  warn_on_failure(guarded("gmem_torch_empty_cache", [] {
    gmem::capi::for_each_context([](DeviceContext& context) {
      gmem::capi::empty_cache(*context.engine);
    });
  }));
}

void gmem_torch_memory_fraction(double fraction, int device) {
  warn_on_failure(gmem_set_memory_fraction(device, fraction));
}

void gmem_torch_record_stream(void* ptr, uintptr_t stream) {
  warn_on_failure(gmem_record_stream(ptr, stream));
}

void gmem_torch_reset_peak(int device) { warn_on_failure(gmem_reset_peak_stats(device)); }

}  // extern "C"
