/* gmem's C API: the engine for C programs, ctypes and torch's CUDAPluggableAllocator.
 *
 * Every function is thread-safe. Functions returning gmem_status_t never throw; on failure the
 * message is kept per thread and read with gmem_last_error(). One engine per device, created on
 * first use for the current CUDA device, or over a simulated device when the environment says
 * GMEM_DEVICE=sim (tests and machines without a GPU). */
#ifndef GMEM_GMEM_H
#define GMEM_GMEM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum gmem_status {
  GMEM_OK = 0,
  GMEM_ERROR_INVALID_ARGUMENT = 1,
  GMEM_ERROR_OUT_OF_MEMORY = 2,
  GMEM_ERROR_INVALID_POINTER = 3,
  GMEM_ERROR_DOUBLE_FREE = 4,
  GMEM_ERROR_DEVICE = 5,
  GMEM_ERROR_BAD_INPUT = 6,
} gmem_status_t;

/* The message of the last failed call on this thread ("" when none). */
const char* gmem_last_error(void);

/* Allocation on `device` (-1 = current) and `stream` (a cudaStream_t, 0 = default). */
gmem_status_t gmem_malloc(void** ptr, size_t size, int device, uintptr_t stream);
gmem_status_t gmem_free(void* ptr);
gmem_status_t gmem_record_stream(void* ptr, uintptr_t stream);

gmem_status_t gmem_empty_cache(int device);
gmem_status_t gmem_set_memory_limit(int device, size_t bytes);      /* 0 = device total */
gmem_status_t gmem_set_memory_fraction(int device, double fraction);
gmem_status_t gmem_reset_peak_stats(int device);
gmem_status_t gmem_reset_accumulated_stats(int device);

/* One statistic by its PyTorch-style name, e.g. "allocated_bytes.all.current". */
gmem_status_t gmem_stat(int device, const char* name, int64_t* value);
/* All statistics as "name value\n" lines into buf (NUL-terminated); *needed gets the full size
 * including the NUL, so a caller can retry with a larger buffer. */
gmem_status_t gmem_stats_text(int device, char* buf, size_t size, size_t* needed);
/* The memory summary (torch.cuda.memory_summary()'s table, then gmem's own section) into buf,
 * filled as by gmem_stats_text. */
gmem_status_t gmem_memory_summary(int device, char* buf, size_t size, size_t* needed);

/* torch.cuda.memory.CUDAPluggableAllocator entry points, for torch only. gmem_torch_malloc returns
 * NULL for size 0 and throws a C++ exception on failure (torch turns it into a RuntimeError;
 * CUDAPluggableAllocator does not check for NULL); C and ctypes callers use gmem_malloc. The
 * others never throw: they report failures on stderr and in gmem_last_error(). */
void* gmem_torch_malloc(ssize_t size, int device, uintptr_t stream);
void gmem_torch_free(void* ptr, ssize_t size, int device, uintptr_t stream);
void gmem_torch_empty_cache(void);
void gmem_torch_memory_fraction(double fraction, int device);
void gmem_torch_record_stream(void* ptr, uintptr_t stream);
void gmem_torch_reset_peak(int device);

#ifdef __cplusplus
}
#endif

#endif /* GMEM_GMEM_H */
