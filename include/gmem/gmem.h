/* gmem's C API: the engine for C programs, ctypes and torch's CUDAPluggableAllocator.
 *
 * Every function is thread-safe. Functions returning gmem_status_t never throw; on failure the
 * message is kept per thread and read with gmem_last_error(). One engine per device, created on
 * first use for the current CUDA device, or over a simulated device when the environment says
 * GMEM_DEVICE=sim (tests and machines without a GPU). GMEM_PAGE_SIZE (bytes, or 8M, 8MiB) sets
 * the engine's page and chunk size (EngineOptions::page_size; default 2 MiB); a bad value fails
 * the first call with an error naming it. */
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

/* Gives free chunks back to the device: every one, until calls after every step are seen to cost
   the program time; then what the last steps did not use (GMEM_EMPTY_CACHE=strict: every one). */
gmem_status_t gmem_empty_cache(int device);
gmem_status_t gmem_set_memory_limit(int device, size_t bytes);      /* 0 = device total */
gmem_status_t gmem_set_memory_fraction(int device, double fraction);
gmem_status_t gmem_reset_peak_stats(int device);
gmem_status_t gmem_reset_accumulated_stats(int device);

/* A training step ended on `device` (-1 = current): after the optimizer's step, or before the
 * forward. The step's record stays open until the next step's first malloc, so frees in between
 * (the gradients zero_grad frees) count as the step's own. Once steps are marked,
 * a step that comes back after other shapes ran (sequence lengths taking turns) is laid out from
 * its last occurrence, so that it needs no device call and no more memory than its peak
 * (docs/notes/2026-11-24-planned-step-layouts.md). Without marks nothing changes. gmem.torch.enable()
 * marks a step after every optimizer step. */
gmem_status_t gmem_mark_step(int device);

/* One statistic by its PyTorch-style name, e.g. "allocated_bytes.all.current". */
gmem_status_t gmem_stat(int device, const char* name, int64_t* value);
/* All statistics as "name value\n" lines into buf (NUL-terminated); *needed gets the full size
 * including the NUL, so a caller can retry with a larger buffer. */
gmem_status_t gmem_stats_text(int device, char* buf, size_t size, size_t* needed);
/* The memory summary (torch.cuda.memory_summary()'s table, then gmem's own section) into buf,
 * filled as by gmem_stats_text. */
gmem_status_t gmem_memory_summary(int device, char* buf, size_t size, size_t* needed);

/* --- Engines as handles: the device's own engine and private pools ----------------------------
 *
 * What gmem's PyTorch allocator (python/gmem/_torch_allocator.cpp) builds on. A private pool is an
 * engine of its own on the device: memory freed inside it is reused only by allocations made from
 * it, never by the device's engine or another pool (a CUDA graph replay writes into the blocks its
 * capture allocated, even after they were freed). Its physical memory goes back to the device when
 * the pool is destroyed or its cache emptied. gmem_free frees a pool's pointer too: every engine's
 * address ranges are known by engine, so a pointer finds its pool (gmem_engine_of). */
typedef struct gmem_engine gmem_engine_t;

/* The engine behind gmem_malloc for `device` (-1 = current); lives as long as the process. */
gmem_status_t gmem_device_engine(int device, gmem_engine_t** engine);
/* A new private pool on `device`, with the device engine's settings: its memory limit, page size
 * (GMEM_PAGE_SIZE) and empty_cache rule (GMEM_EMPTY_CACHE). Its pages are stable
 * (EngineOptions::stable_pages): once mapped, a page keeps its chunk and no chunk is mapped twice,
 * so that a CUDA graph captured into the pool replays against the memory it was captured with. */
gmem_status_t gmem_pool_create(int device, gmem_engine_t** pool);
/* Destroys a pool, giving its memory back to the device. Refused (GMEM_ERROR_INVALID_ARGUMENT)
 * while it has live blocks, and for a device's own engine. */
gmem_status_t gmem_pool_destroy(gmem_engine_t* pool);
/* The engine, a device's own or a pool, whose address space holds `ptr`: one lookup by address
 * range, from a pointer to its device (gmem_engine_device) and pool (gmem_engine_is_pool); the
 * block is then gmem_engine_block's. GMEM_ERROR_INVALID_POINTER when no engine's does. */
gmem_status_t gmem_engine_of(const void* ptr, gmem_engine_t** engine);
/* 1 for a pool, 0 for a device's engine, -1 for NULL. */
int gmem_engine_is_pool(const gmem_engine_t* engine);
int gmem_engine_device(const gmem_engine_t* engine);

/* As gmem_malloc / gmem_free / gmem_record_stream / gmem_empty_cache, on that engine. The device
 * engine's malloc leaves an OOM report (gmem_observe.h) as gmem_malloc does. */
gmem_status_t gmem_engine_malloc(gmem_engine_t* engine, void** ptr, size_t size, uintptr_t stream);
gmem_status_t gmem_engine_free(gmem_engine_t* engine, void* ptr);
/* A pool's block of `size` bytes at `ptr` exactly (on the stream whose memory holds `ptr`), as
 * PyTorch's cudagraph trees need to put a pool back to a checkpoint: GMEM_ERROR_INVALID_ARGUMENT
 * where [ptr, ptr + size) is not free in the pool, or for a device's engine. */
gmem_status_t gmem_pool_malloc_at(gmem_engine_t* pool, void* ptr, size_t size);
gmem_status_t gmem_engine_record_stream(gmem_engine_t* engine, void* ptr, uintptr_t stream);
gmem_status_t gmem_engine_empty_cache(gmem_engine_t* engine);
/* A CUDA graph is being captured on the engine's device (capturing != 0), or no longer: the
 * engine then makes no event call, and blocks used on other streams (record_stream) that are
 * freed meanwhile are reused only once the capture is over (Engine::set_capturing). */
gmem_status_t gmem_engine_set_capturing(gmem_engine_t* engine, int capturing);
gmem_status_t gmem_engine_reset_peak_stats(gmem_engine_t* engine);
gmem_status_t gmem_engine_reset_accumulated_stats(gmem_engine_t* engine);

/* One statistic: its value now, its peak since the last reset, and the running totals. */
typedef struct gmem_stat {
  int64_t current, peak, allocated, freed;
} gmem_stat_t;

/* An engine's statistics as numbers, PyTorch's DeviceStats field for field. Arrays are indexed
 * [0] all, [1] small pool (<= 1 MiB), [2] large pool. */
typedef struct gmem_engine_stats_s {
  gmem_stat_t allocation[3], segment[3], active[3], inactive_split[3];
  gmem_stat_t allocated_bytes[3], reserved_bytes[3], active_bytes[3], inactive_split_bytes[3],
      requested_bytes[3];
  int64_t num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free;
  int64_t memory_limit, granularity;
  /* Filled only when `detailed` is nonzero (they walk the engine; 0 otherwise, and
   * inactive_split* read 0 too): the largest free range ready to use, and the free bytes that a
   * new allocation can take without asking the device (whole pages mapped or held). */
  int64_t largest_free_range, free_mapped_bytes, free_unmapped_bytes;
} gmem_engine_stats_t;

gmem_status_t gmem_engine_stats(gmem_engine_t* engine, int detailed, gmem_engine_stats_t* stats);
/* The device's engine and its live pools as one, as PyTorch counts a device with its graph
 * pools: counts and bytes summed. Once a pool has been made on the device, every peak of the
 * pooled statistics (allocated, requested, active and reserved bytes; allocation, active and
 * segment counts) is the peak of the engines' sum, and their running totals keep what destroyed
 * pools counted; inactive_split* peaks are summed. gmem_stat, gmem_stats_text,
 * gmem_memory_summary and gmem_reset_peak_stats / gmem_reset_accumulated_stats read and reset
 * the device so too. */
gmem_status_t gmem_device_stats(int device, int detailed, gmem_engine_stats_t* stats);

/* A live allocation. */
typedef struct gmem_block {
  void* ptr;
  size_t size;      /* rounded size handed out */
  size_t requested; /* size asked for */
  uintptr_t stream;
} gmem_block_t;

/* The live block that starts at `ptr` (GMEM_ERROR_INVALID_POINTER when none does). */
gmem_status_t gmem_engine_block(gmem_engine_t* engine, const void* ptr, gmem_block_t* block);
/* Calls visit(user, block) for every live block, under the engine's lock: `visit` must not call
 * gmem. */
gmem_status_t gmem_engine_for_each_block(gmem_engine_t* engine,
                                         void (*visit)(void* user, const gmem_block_t* block),
                                         void* user);

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
