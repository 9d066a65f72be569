// Engines as handles (include/gmem/gmem.h): a device's own engine and private pools, each a
// gmem::Engine of its own over the device's (shared, thread-safe) Device.
#include <memory>
#include <string>

#include "capi/observe.hpp"
#include "capi/registry.hpp"
#include "gmem/error.hpp"
#include "gmem/gmem.h"

namespace {

using gmem::capi::run_guarded;

// The device's own engine as a handle, made with its context and never destroyed (as the engine).
gmem_engine* device_handle(int device) { return &gmem::capi::context(device).handle; }

gmem::Engine& engine_of(gmem_engine* handle) {
  if (handle == nullptr) throw gmem::Error(gmem::Errc::invalid_argument, "engine is NULL");
  return *handle->engine;
}

void copy_stat(const gmem::Stat& from, gmem_stat_t& to) {
  to = gmem_stat_t{from.current, from.peak, from.allocated, from.freed};
}

void copy_stats(const gmem::PoolStats& from, gmem_stat_t (&to)[3]) {
  for (std::size_t i = 0; i < 3; ++i) copy_stat(from[i], to[i]);
}

void copy_engine_stats(const gmem::MemoryStats& s, gmem_engine_stats_t& out) {
  out = gmem_engine_stats_t{};
  copy_stats(s.allocation, out.allocation);
  copy_stats(s.segment, out.segment);
  copy_stats(s.active, out.active);
  copy_stats(s.inactive_split, out.inactive_split);
  copy_stats(s.allocated_bytes, out.allocated_bytes);
  copy_stats(s.reserved_bytes, out.reserved_bytes);
  copy_stats(s.active_bytes, out.active_bytes);
  copy_stats(s.inactive_split_bytes, out.inactive_split_bytes);
  copy_stats(s.requested_bytes, out.requested_bytes);
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  out.num_sync_all_streams = s.num_sync_all_streams;
  out.num_device_alloc = s.num_device_alloc;
  out.num_device_free = s.num_device_free;
  out.memory_limit = s.memory_limit;
  out.granularity = s.granularity;
  out.largest_free_range = s.largest_free_range;
  out.free_mapped_bytes = s.free_mapped_bytes;
  out.free_unmapped_bytes = s.free_unmapped_bytes;
}

gmem_block_t block_of(const gmem::BlockInfo& info) {
  return gmem_block_t{info.ptr, info.size, info.requested, info.stream};
}

}  // namespace

extern "C" {

gmem_status_t gmem_device_engine(int device, gmem_engine_t** engine) {
  return run_guarded("gmem_device_engine", [&] {
    if (engine == nullptr) throw gmem::Error(gmem::Errc::invalid_argument, "engine is NULL");
    *engine = device_handle(device);
  });
}

gmem_status_t gmem_pool_create(int device, gmem_engine_t** pool) {
  return run_guarded("gmem_pool_create", [&] {
    if (pool == nullptr) throw gmem::Error(gmem::Errc::invalid_argument, "pool is NULL");
    *pool = nullptr;
    gmem_engine* device_engine = device_handle(device);
    auto handle = std::make_unique<gmem_engine>();
    handle->context = device_engine->context;
    // The device engine's settings (GMEM_PAGE_SIZE, GMEM_EMPTY_CACHE, its memory limit now),
    // with stable pages: CUDA graphs are captured into pools.
    gmem::EngineOptions options = device_engine->engine->options();
    options.stable_pages = true;
    // The device's own Device object, through a view that records the pool's address ranges as
    // the pool's (so that gmem_free and gmem_engine_of find the pool); its chunks come from the
    // same GPU.
    handle->view = gmem::capi::pool_view(*handle->context, *handle);
    handle->owned = std::make_unique<gmem::Engine>(*handle->view, options);
    handle->engine = handle->owned.get();
    handle->context->add_pool(*handle->engine);
    *pool = handle.release();
  });
}

gmem_status_t gmem_pool_destroy(gmem_engine_t* pool) {
  return run_guarded("gmem_pool_destroy", [&] {
    gmem::Engine& engine = engine_of(pool);
    if (!pool->owned) {
      throw gmem::Error(gmem::Errc::invalid_argument,
                        "a device's own engine cannot be destroyed, only pools");
    }
    const gmem::MemoryStats stats = engine.stats();
    const std::int64_t live = stats.allocation[gmem::kAllPools].current;
    if (live != 0) {
      throw gmem::Error(gmem::Errc::invalid_argument,
                        "pool still has " + std::to_string(live) + " live block(s) of " +
                            std::to_string(stats.allocated_bytes[gmem::kAllPools].current) +
                            " bytes; free them first");
    }
    engine.empty_cache();  // waits for frees still pending on other streams
    pool->context->remove_pool(engine);
    delete pool;
  });
}

gmem_status_t gmem_engine_of(const void* ptr, gmem_engine_t** engine) {
  return run_guarded("gmem_engine_of", [&] {
    if (engine == nullptr) throw gmem::Error(gmem::Errc::invalid_argument, "engine is NULL");
    *engine = gmem::capi::owner(ptr);
    if (*engine == nullptr) throw gmem::capi::foreign_pointer(ptr);
  });
}

int gmem_engine_is_pool(const gmem_engine_t* engine) {
  return engine == nullptr ? -1 : engine->owned ? 1 : 0;
}

int gmem_engine_device(const gmem_engine_t* engine) {
  return engine == nullptr ? -1 : engine->context->index;
}

gmem_status_t gmem_engine_malloc(gmem_engine_t* engine, void** ptr, size_t size, uintptr_t stream) {
  return run_guarded("gmem_engine_malloc", [&] {
    if (ptr == nullptr) throw gmem::Error(gmem::Errc::invalid_argument, "ptr is NULL");
    *ptr = nullptr;
    gmem::Engine& e = engine_of(engine);
    *ptr = engine->owned ? e.malloc(size, stream)
                         : gmem::capi::observed_malloc(*engine->context, size, stream);
  });
}

gmem_status_t gmem_pool_malloc_at(gmem_engine_t* pool, void* ptr, size_t size) {
  return run_guarded("gmem_pool_malloc_at", [&] {
    gmem::Engine& e = engine_of(pool);
    if (!pool->owned)
      throw gmem::Error(gmem::Errc::invalid_argument, "not a pool (a device's own engine)");
    e.malloc_at(ptr, size);
  });
}

gmem_status_t gmem_engine_free(gmem_engine_t* engine, void* ptr) {
  if (ptr == nullptr) return GMEM_OK;
  return run_guarded("gmem_engine_free", [&] { engine_of(engine).free(ptr); });
}

gmem_status_t gmem_engine_record_stream(gmem_engine_t* engine, void* ptr, uintptr_t stream) {
  return run_guarded("gmem_engine_record_stream",
                     [&] { engine_of(engine).record_stream(ptr, stream); });
}

gmem_status_t gmem_engine_empty_cache(gmem_engine_t* engine) {
  return run_guarded("gmem_engine_empty_cache",
                     [&] { gmem::capi::empty_cache(engine_of(engine)); });
}

gmem_status_t gmem_engine_set_capturing(gmem_engine_t* engine, int capturing) {
  return run_guarded("gmem_engine_set_capturing",
                     [&] { engine_of(engine).set_capturing(capturing != 0); });
}

gmem_status_t gmem_engine_reset_peak_stats(gmem_engine_t* engine) {
  return run_guarded("gmem_engine_reset_peak_stats", [&] { engine_of(engine).reset_peak_stats(); });
}

gmem_status_t gmem_engine_reset_accumulated_stats(gmem_engine_t* engine) {
  return run_guarded("gmem_engine_reset_accumulated_stats",
                     [&] { engine_of(engine).reset_accumulated_stats(); });
}

gmem_status_t gmem_engine_stats(gmem_engine_t* engine, int detailed, gmem_engine_stats_t* out) {
  return run_guarded("gmem_engine_stats", [&] {
    if (out == nullptr) throw gmem::Error(gmem::Errc::invalid_argument, "stats is NULL");
    const gmem::Engine& e = engine_of(engine);
    copy_engine_stats(detailed != 0 ? e.detailed_stats() : e.stats(), *out);
  });
}

gmem_status_t gmem_device_stats(int device, int detailed, gmem_engine_stats_t* out) {
  return run_guarded("gmem_device_stats", [&] {
    if (out == nullptr) throw gmem::Error(gmem::Errc::invalid_argument, "stats is NULL");
    copy_engine_stats(gmem::capi::context(device).stats(detailed != 0), *out);
  });
}

gmem_status_t gmem_engine_block(gmem_engine_t* engine, const void* ptr, gmem_block_t* block) {
  return run_guarded("gmem_engine_block", [&] {
    if (block == nullptr) throw gmem::Error(gmem::Errc::invalid_argument, "block is NULL");
    *block = block_of(engine_of(engine).block_info(ptr));
  });
}

gmem_status_t gmem_engine_for_each_block(gmem_engine_t* engine,
                                         void (*visit)(void* user, const gmem_block_t* block),
                                         void* user) {
  return run_guarded("gmem_engine_for_each_block", [&] {
    if (visit == nullptr) throw gmem::Error(gmem::Errc::invalid_argument, "visit is NULL");
    engine_of(engine).for_each_block([&](const gmem::BlockInfo& info) {
      const gmem_block_t block = block_of(info);
      visit(user, &block);
    });
  });
}

}  // extern "C"
