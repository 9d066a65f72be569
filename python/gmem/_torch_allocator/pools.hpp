// Private pools (CUDA graphs, MemPool): each an engine of its own (gmem_pool_create), so memory
// freed inside it is never handed to allocations outside it: a graph replay writes there. A pool
// is destroyed once released by every user and empty of live blocks.
//
// Pools owns them with the allocate-to-pool routes (beginAllocateToPool: mallocs of a stream go
// to a pool), the capture state of the device's engines, checkpoints (cudagraph trees), and the
// mallocs and frees of pool blocks. One mutex guards it all; the allocator's hot path reads only
// two atomic counters (routing(), has_live_blocks()) and takes the mutex when one is nonzero.
//
// Private to _torch_allocator.cpp (one translation unit: gmem/_shim.py compiles that file only).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "convert.hpp"
#include "engines.hpp"
#include "gmem/gmem.h"

namespace gmem_torch {
namespace {

// One private pool: its engine, how many users hold it (graphs, MemPool objects, begun
// allocate-to-pool routes), and how many of its blocks are live (the blocks themselves are the
// engine's: gmem_engine_for_each_block).
struct Pool {
  MempoolId_t id{0, 0};           // PyTorch's id for it
  DeviceIndex device = 0;         // the device its engine maps memory on
  gmem_engine_t* engine = nullptr;
  int use_count = 0;              // users holding it; 0: released, destroyed once empty
  bool use_on_oom = false;        // MemPool(use_on_oom=True): the device's mallocs may use it
  std::size_t live_blocks = 0;    // blocks allocated in it and not freed yet
};

// An allocate-to-pool route begun by beginAllocateToPool: mallocs on streams `filter` accepts go
// to the pool.
struct Route {
  MempoolId_t id;                               // the pool
  std::function<bool(cudaStream_t)> filter;     // empty: every stream
};

// A pool's live blocks at getCheckpointState (cudagraph trees): where they were, how large, on
// which stream.
struct PoolCheckpoint final : cca::AllocatorState {
  MempoolId_t id{0, 0};              // the pool
  DeviceIndex device = 0;            // its device
  std::vector<gmem_block_t> blocks;  // its live blocks then
  std::unordered_set<void*> live;    // their pointers
};

class Pools {
 public:
  // What malloc_routed did: no route took the malloc, a pool served it, or the pool is out of
  // memory (the caller raises the OOM: observers and history are not the pools').
  enum class Routed { kNone, kServed, kOutOfMemory };

  explicit Pools(DeviceEngines& engines) : engines_(engines) {}

  // --- the hot path's two questions ------------------------------------------------------------

  // Whether any allocate-to-pool route is begun: only then can a malloc go to a pool.
  bool routing() const { return routes_active_.load(std::memory_order_acquire) != 0; }

  // Whether any pool block is live: only then can a free be a pool's.
  bool has_live_blocks() const { return pool_blocks_.load(std::memory_order_acquire) != 0; }

  // --- routes, users -----------------------------------------------------------------------------

  void begin_route(DeviceIndex device, MempoolId_t mempool_id,
                   std::function<bool(cudaStream_t)> filter) {
    std::lock_guard lock(mutex_);
    create_or_incref(device, mempool_id);
    auto& routes = routes_[static_cast<std::size_t>(device)];
    routes.push_back(Route{mempool_id, std::move(filter)});
    routes_active_.fetch_add(1, std::memory_order_release);
    if (routes.size() == 1) set_capturing(device, true);
  }

  void end_route(DeviceIndex device, MempoolId_t mempool_id) {
    std::lock_guard lock(mutex_);
    auto& routes = routes_[static_cast<std::size_t>(device)];
    for (auto it = routes.begin(); it != routes.end(); ++it) {
      if (it->id == mempool_id) {
        routes.erase(it);
        routes_active_.fetch_sub(1, std::memory_order_release);
        if (routes.empty()) set_capturing(device, false);
        return;
      }
    }
    TORCH_CHECK(false, "gmem: endAllocateToPool: no allocation to pool (", mempool_id.first, ", ",
                mempool_id.second, ") was begun on device ", int(device));
  }

  void hold(DeviceIndex device, MempoolId_t mempool_id) {
    std::lock_guard lock(mutex_);
    create_or_incref(device, mempool_id);
  }

  void release(DeviceIndex device, MempoolId_t mempool_id) {
    std::lock_guard lock(mutex_);
    auto it = pools_.find(mempool_id);
    TORCH_CHECK(it != pools_.end(), "gmem: releasePool: pool (", mempool_id.first, ", ",
                mempool_id.second, ") does not exist on device ", int(device));
    Pool& pool = it->second;
    TORCH_CHECK(pool.use_count > 0, "gmem: releasePool: pool released more often than held");
    if (--pool.use_count == 0) {
      // No graph replays into it any more: its cache can go, and the pool once it is empty.
      if (gmem_engine_empty_cache(pool.engine) != GMEM_OK)
        std::fprintf(stderr, "gmem: %s\n", gmem_last_error());
      destroy_if_unused(it);
    }
  }

  int use_count(MempoolId_t mempool_id) {
    std::lock_guard lock(mutex_);
    auto it = pools_.find(mempool_id);
    return it == pools_.end() ? 0 : it->second.use_count;
  }

  void set_use_on_oom(MempoolId_t mempool_id, bool use_on_oom) {
    std::lock_guard lock(mutex_);
    auto it = pools_.find(mempool_id);
    TORCH_CHECK(it != pools_.end(), "gmem: setUseOnOOM: no pool (", mempool_id.first, ", ",
                mempool_id.second, ")");
    it->second.use_on_oom = use_on_oom;
  }

  // --- mallocs and frees ---------------------------------------------------------------------

  // Serves the malloc when a begun route takes it (*ptr, *pool_id set).
  Routed malloc_routed(size_t size, DeviceIndex device, cudaStream_t stream, void** ptr,
                       MempoolId_t* pool_id) {
    gmem_engine_t* engine = nullptr;
    {
      // The pool malloc runs under the lock so that no release can destroy the pool meanwhile.
      std::lock_guard lock(mutex_);
      Pool* pool = route(device, stream);
      if (pool == nullptr) return Routed::kNone;
      engine = pool->engine;
      *pool_id = pool->id;
      const gmem_status_t status =
          gmem_engine_malloc(engine, ptr, size, reinterpret_cast<uintptr_t>(stream));
      if (status == GMEM_OK) {
        note_block(*pool);
        return Routed::kServed;
      }
      TORCH_CHECK(status == GMEM_ERROR_OUT_OF_MEMORY, "gmem: ", last_gmem_error());
    }
    // Out of memory in the pool: what the device engine and released pools cache may go back.
    release_caches(nullptr);
    {
      std::lock_guard lock(mutex_);
      Pool* pool = route(device, stream);
      if (pool != nullptr &&
          gmem_engine_malloc(pool->engine, ptr, size, reinterpret_cast<uintptr_t>(stream)) ==
              GMEM_OK) {
        note_block(*pool);
        return Routed::kServed;
      }
    }
    return Routed::kOutOfMemory;
  }

  // The device engine is out of memory: a pool marked use_on_oom (MemPool(use_on_oom=True)) of
  // the device serves the malloc when it can (*pool_id set); else nullptr.
  void* malloc_on_oom(size_t size, DeviceIndex device, cudaStream_t stream, MempoolId_t* pool_id) {
    std::lock_guard lock(mutex_);
    for (auto& [id, pool] : pools_) {
      if (pool.device != device || !pool.use_on_oom) continue;
      void* ptr = nullptr;
      if (gmem_engine_malloc(pool.engine, &ptr, size, reinterpret_cast<uintptr_t>(stream)) ==
          GMEM_OK) {
        note_block(pool);
        *pool_id = id;
        return ptr;
      }
    }
    return nullptr;
  }

  // Frees `ptr`, whichever engine holds it (when some pool block is live): one lookup names the
  // pointer's engine; a pool's block also updates the pool's count.
  gmem_status_t free(void* ptr) {
    gmem_engine_t* engine = nullptr;
    gmem_status_t status = gmem_engine_of(ptr, &engine);
    if (status == GMEM_OK)
      status = gmem_engine_is_pool(engine) == 1 ? free_in_pool(engine, ptr)
                                                : gmem_engine_free(engine, ptr);
    return status;
  }

  // --- caches ----------------------------------------------------------------------------------

  // Empties the caches of pools no user holds, and of the device engines other than `except`.
  // True when any engine was emptied.
  bool release_caches(gmem_engine_t* except) {
    bool any = false;
    std::lock_guard lock(mutex_);  // held: a pool's last free may destroy its engine
    for (auto& [id, pool] : pools_) {
      if (pool.use_count != 0) continue;
      (void)gmem_engine_empty_cache(pool.engine);
      any = true;
    }
    for (int d = 0; d < kMaxDevices; ++d) {
      gmem_engine_t* e = engines_.if_used(static_cast<DeviceIndex>(d));
      if (e == nullptr || e == except) continue;
      (void)gmem_engine_empty_cache(e);
      any = true;
    }
    return any;
  }

  // {0, 0}: every device engine, and pools no graph or MemPool holds any more (their cached
  // memory cannot be replayed into). A pool's id: that pool's cache, as asked.
  void empty_cache(MempoolId_t mempool_id) {
    std::vector<gmem_engine_t*> engines;
    {
      std::lock_guard lock(mutex_);
      for (auto& [id, pool] : pools_) {
        if (mempool_id == MempoolId_t{0, 0} ? pool.use_count == 0 : id == mempool_id)
          engines.push_back(pool.engine);
      }
      if (mempool_id == MempoolId_t{0, 0}) {
        for (int d = 0; d < kMaxDevices; ++d)
          if (gmem_engine_t* e = engines_.if_used(static_cast<DeviceIndex>(d))) engines.push_back(e);
      }
      for (gmem_engine_t* e : engines)
        TORCH_CHECK(gmem_engine_empty_cache(e) == GMEM_OK, "gmem: ", last_gmem_error());
    }
  }

  // --- checkpoints (cudagraph trees) and snapshots ---------------------------------------------

  bool check_live(MempoolId_t mempool_id, const std::unordered_set<void*>& expected) {
    std::lock_guard lock(mutex_);
    auto it = pools_.find(mempool_id);
    if (it == pools_.end()) return expected.empty();
    if (it->second.live_blocks != expected.size()) return false;
    for (const gmem_block_t& block : live_blocks_of(it->second.engine))
      if (expected.count(block.ptr) == 0) return false;
    return true;
  }

  std::shared_ptr<PoolCheckpoint> checkpoint(DeviceIndex device, MempoolId_t id) {
    std::lock_guard lock(mutex_);
    auto state = std::make_shared<PoolCheckpoint>();
    state->id = id;
    state->device = device;
    auto it = pools_.find(id);
    if (it == pools_.end()) return state;
    state->blocks = live_blocks_of(it->second.engine);
    state->live = pointers_of(state->blocks);
    return state;
  }

  // Puts the pool back to `state`: the blocks allocated since are freed (with `free_fn`, the
  // allocator's: history sees them go), and every block live at the checkpoint but freed since
  // is allocated at its address again (Engine::malloc_at). Every block live now is appended to
  // `freed` (PyTorch's delta lists one live all along as freed and allocated). Returns the blocks
  // allocated again, pointing into `state`.
  template <class Free>
  std::vector<const gmem_block_t*> restore(const PoolCheckpoint& state, std::vector<void*>* freed,
                                           Free&& free_fn) {
    std::vector<void*> to_free;
    std::vector<const gmem_block_t*> to_restore;
    gmem_engine_t* engine = nullptr;
    {
      std::lock_guard lock(mutex_);
      auto it = pools_.find(state.id);
      TORCH_CHECK(it != pools_.end(), "gmem: setCheckpointPoolState: the pool is gone");
      engine = it->second.engine;
      const std::unordered_set<void*> live = pointers_of(live_blocks_of(engine));
      for (void* ptr : live) {
        freed->push_back(ptr);
        if (state.live.count(ptr) == 0) to_free.push_back(ptr);
      }
      for (const gmem_block_t& block : state.blocks)
        if (live.count(block.ptr) == 0) to_restore.push_back(&block);
    }
    for (void* ptr : to_free) free_fn(ptr);
    for (std::size_t k = 0; k < to_restore.size(); ++k) {
      const gmem_block_t& block = *to_restore[k];
      if (gmem_pool_malloc_at(engine, block.ptr, block.requested) != GMEM_OK) {
        const std::string why = last_gmem_error();
        for (std::size_t j = 0; j < k; ++j) free_fn(to_restore[j]->ptr);  // as it was
        TORCH_CHECK(false, "gmem: putting a CUDA-graph pool back to its checkpoint "
                    "(cudagraph trees): the block at ", hex(block.ptr), " (", block.requested,
                    " bytes) cannot be allocated there again: ", why);
      }
      std::lock_guard lock(mutex_);
      auto it = pools_.find(state.id);
      note_block(it->second);
    }
    return to_restore;
  }

  // The live blocks of pool `mempool_id`, or of every engine (pools and devices) for {0, 0},
  // in address order.
  std::vector<LiveBlock> live_blocks(MempoolId_t mempool_id) {
    std::vector<LiveBlock> found;
    auto collect = [&](gmem_engine_t* engine, DeviceIndex device, MempoolId_t pool) {
      struct Sink {
        std::vector<LiveBlock>* out;
        DeviceIndex device;
        MempoolId_t pool;
      } sink{&found, device, pool};
      TORCH_CHECK(gmem_engine_for_each_block(
                      engine,
                      [](void* user, const gmem_block_t* b) {
                        auto* s = static_cast<Sink*>(user);
                        s->out->push_back(LiveBlock{*b, s->device, s->pool});
                      },
                      &sink) == GMEM_OK,
                  "gmem: ", last_gmem_error());
    };
    {
      std::lock_guard lock(mutex_);
      for (auto& [id, pool] : pools_)
        if (mempool_id == MempoolId_t{0, 0} || id == mempool_id)
          collect(pool.engine, pool.device, id);
      if (mempool_id == MempoolId_t{0, 0}) {
        for (int d = 0; d < kMaxDevices; ++d)
          if (gmem_engine_t* e = engines_.if_used(static_cast<DeviceIndex>(d)))
            collect(e, static_cast<DeviceIndex>(d), {0, 0});
      }
    }
    std::sort(found.begin(), found.end(),
              [](const LiveBlock& a, const LiveBlock& b) { return a.block.ptr < b.block.ptr; });
    return found;
  }

 private:
  // --- under mutex_ ----------------------------------------------------------------------------

  // A capture (or another allocation to a pool) begins on `device`, or the last one ends: as
  // PyTorch's allocator defers its events while captures are under way, every engine of the
  // device makes no event call meanwhile (an event query invalidates a capture).
  void set_capturing(DeviceIndex device, bool capturing) {
    auto set = [&](gmem_engine_t* e) {
      TORCH_CHECK(gmem_engine_set_capturing(e, capturing) == GMEM_OK, "gmem: ", last_gmem_error());
    };
    set(engines_.get(device));
    for (auto& [id, pool] : pools_)
      if (pool.device == device) set(pool.engine);
  }

  Pool& create_or_incref(DeviceIndex device, MempoolId_t id) {
    TORCH_CHECK(id != MempoolId_t({0, 0}), "gmem: pool id (0, 0) is the default pool");
    auto it = pools_.find(id);
    if (it == pools_.end()) {
      Pool pool;
      pool.id = id;
      pool.device = device;
      TORCH_CHECK(gmem_pool_create(device, &pool.engine) == GMEM_OK, "gmem: ", last_gmem_error());
      if (!routes_[static_cast<std::size_t>(device)].empty())  // made during a capture
        TORCH_CHECK(gmem_engine_set_capturing(pool.engine, 1) == GMEM_OK, "gmem: ",
                    last_gmem_error());
      it = pools_.emplace(id, std::move(pool)).first;
      pool_of_engine_[it->second.engine] = &it->second;
    }
    TORCH_CHECK(it->second.device == device, "gmem: pool (", id.first, ", ", id.second,
                ") belongs to device ", int(it->second.device), ", not ", int(device));
    ++it->second.use_count;
    return it->second;
  }

  void destroy_if_unused(std::map<MempoolId_t, Pool>::iterator it) {
    Pool& pool = it->second;
    if (pool.use_count != 0 || pool.live_blocks != 0) return;
    if (gmem_pool_destroy(pool.engine) != GMEM_OK) {
      std::fprintf(stderr, "gmem: %s\n", gmem_last_error());
      return;  // keep it: its memory stays accounted for
    }
    pool_of_engine_.erase(pool.engine);
    pools_.erase(it);
  }

  Pool* route(DeviceIndex device, cudaStream_t stream) {
    for (const Route& r : routes_[static_cast<std::size_t>(device)]) {
      if (r.filter && !r.filter(stream)) continue;
      auto it = pools_.find(r.id);
      if (it != pools_.end()) return &it->second;
    }
    return nullptr;
  }

  void note_block(Pool& pool) {
    ++pool.live_blocks;
    pool_blocks_.fetch_add(1, std::memory_order_release);
  }

  // Frees a block of the pool `engine`, which a pool destroyed once released and empty.
  // (Takes mutex_.)
  gmem_status_t free_in_pool(gmem_engine_t* engine, void* ptr) {
    std::lock_guard lock(mutex_);
    const gmem_status_t status = gmem_engine_free(engine, ptr);
    auto it = pool_of_engine_.find(engine);
    if (status != GMEM_OK || it == pool_of_engine_.end()) return status;
    Pool* pool = it->second;
    --pool->live_blocks;
    pool_blocks_.fetch_sub(1, std::memory_order_release);
    if (pool->use_count == 0 && pool->live_blocks == 0) destroy_if_unused(pools_.find(pool->id));
    return GMEM_OK;
  }

  // --- state -----------------------------------------------------------------------------------

  DeviceEngines& engines_;  // the allocator's: set_capturing and the caches reach them
  std::mutex mutex_;        // guards everything below but the two counters
  std::map<MempoolId_t, Pool> pools_;  // node-based: Pool pointers stay valid
  std::array<std::vector<Route>, kMaxDevices> routes_;  // per device, in the order begun
  std::unordered_map<gmem_engine_t*, Pool*> pool_of_engine_;  // a pool per engine, not per block
  std::atomic<int> routes_active_{0};  // begun routes, all devices: routing()
  std::atomic<int> pool_blocks_{0};    // live pool blocks, all pools: has_live_blocks()
};

}  // namespace
}  // namespace gmem_torch
