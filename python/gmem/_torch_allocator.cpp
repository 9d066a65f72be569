// gmem as PyTorch's CUDA allocator: a complete c10::cuda::CUDACachingAllocator::CUDAAllocator
// over libgmem's C API (include/gmem/gmem.h), written for PyTorch 2.11's interface.
//
// Built by gmem/_shim.py at first use against the installed torch's headers, linked to libc10,
// libc10_cuda, libtorch_cuda and to the very libgmem.so the Python package loaded; cached. libgmem
// itself stays free of torch. Installed with torch::cuda::CUDAPluggableAllocator::
// changeCurrentAllocator (gmem_torch_allocator_install), which PyTorch allows only before its
// current allocator is initialised.
//
// What each method does (answered by gmem, delegated, refused) is tabled in python/README.md.
//
// Design:
//   * The hot path is one engine call: malloc goes to the device's engine unless a private pool is
//     being allocated to (one atomic load says whether any is), free goes to gmem_free unless a
//     pool block is live anywhere (another atomic load). Pools and history take a mutex.
//   * A private pool (CUDA graphs, MemPool) is an engine of its own (gmem_pool_create), so memory
//     freed inside it is never handed to allocations outside it: a graph replay writes there.
//     It is destroyed once released by every user and empty of live blocks.
//   * History (torch.cuda.memory._record_memory_history) keeps PyTorch's GatheredContext per block
//     and in trace entries, so torch's own _snapshot() symbolises the stacks as it does for its
//     allocator.
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "gmem/gmem.h"

namespace gmem_torch {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::DeviceIndex;
using c10::MempoolId_t;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::TraceEntry;

constexpr int kMaxDevices = 64;  // as libgmem
constexpr std::size_t kSmallLimit = std::size_t{1} << 20;  // gmem's small pool: <= 1 MiB

const char kIpcRefusal[] =
    "gmem: sending CUDA tensors between processes (torch.multiprocessing, CUDA IPC) is not "
    "supported by gmem's allocator: its memory is mapped through CUDA's virtual memory API, "
    "which cudaIpcGetMemHandle cannot export. Send CPU tensors (tensor.cpu()) or let each "
    "process allocate its own CUDA tensors, or run this program without gmem.torch.enable().";

std::string last_gmem_error() { return gmem_last_error(); }

// One private pool: its engine, how many users hold it (graphs, MemPool objects, begun
// allocate-to-pool routes), and how many of its blocks are live (the blocks themselves are the
// engine's: gmem_engine_for_each_block).
struct Pool {
  MempoolId_t id{0, 0};
  DeviceIndex device = 0;
  gmem_engine_t* engine = nullptr;
  int use_count = 0;
  bool use_on_oom = false;
  std::size_t live_blocks = 0;
};

// An engine's live blocks (under its lock; gmem_engine_for_each_block).
std::vector<gmem_block_t> live_blocks_of(gmem_engine_t* engine) {
  std::vector<gmem_block_t> blocks;
  auto collect = [](void* user, const gmem_block_t* block) {
    static_cast<std::vector<gmem_block_t>*>(user)->push_back(*block);
  };
  TORCH_CHECK(gmem_engine_for_each_block(engine, collect, &blocks) == GMEM_OK, "gmem: ",
              gmem_last_error());
  return blocks;
}

std::unordered_set<void*> pointers_of(const std::vector<gmem_block_t>& blocks) {
  std::unordered_set<void*> pointers;
  for (const gmem_block_t& block : blocks) pointers.insert(block.ptr);
  return pointers;
}

// An allocate-to-pool route begun by beginAllocateToPool: mallocs on streams `filter` accepts go
// to the pool.
struct Route {
  MempoolId_t id;
  std::function<bool(cudaStream_t)> filter;
};

// What history remembers of a block allocated while it was on.
struct TracedBlock {
  std::size_t size = 0;
  DeviceIndex device = 0;
  cudaStream_t stream = nullptr;
  MempoolId_t pool{0, 0};
  std::shared_ptr<c10::GatheredContext> context;
};

// A pool's live blocks at getCheckpointState (cudagraph trees): where they were, how large, on
// which stream.
struct PoolCheckpoint final : cca::AllocatorState {
  MempoolId_t id{0, 0};
  DeviceIndex device = 0;
  std::vector<gmem_block_t> blocks;
  std::unordered_set<void*> live;
};

// A pointer as error messages print it. (Not `<< ptr`: streaming a void* into c10::str's
// ostringstream from this library crashed the process on the H100's torch build, inside
// libstdc++'s num_put, where the same message with a string printed.)
std::string hex(const void* ptr) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx",
                static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(ptr)));
  return buf;
}

c10::CachingAllocator::Stat to_stat(const gmem_stat_t& s) {
  c10::CachingAllocator::Stat out;
  out.current = s.current;
  out.peak = s.peak;
  out.allocated = s.allocated;
  out.freed = s.freed;
  return out;
}

// gmem's numbers as PyTorch's DeviceStats.
DeviceStats to_device_stats(const gmem_engine_stats_t& s) {
  DeviceStats out;
  auto copy = [](c10::CachingAllocator::StatArray& to, const gmem_stat_t (&from)[3]) {
    for (std::size_t i = 0; i < 3; ++i) to[i] = to_stat(from[i]);
  };
  copy(out.allocation, s.allocation);
  copy(out.segment, s.segment);
  copy(out.active, s.active);
  copy(out.inactive_split, s.inactive_split);
  copy(out.allocated_bytes, s.allocated_bytes);
  copy(out.reserved_bytes, s.reserved_bytes);
  copy(out.active_bytes, s.active_bytes);
  copy(out.inactive_split_bytes, s.inactive_split_bytes);
  copy(out.requested_bytes, s.requested_bytes);
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  out.num_sync_all_streams = s.num_sync_all_streams;
  out.num_device_alloc = s.num_device_alloc;
  out.num_device_free = s.num_device_free;
  out.max_split_size = -1;  // gmem never refuses to split: PyTorch's "no limit"
  return out;
}


void raw_delete_fn(void* ptr);

class GmemAllocator final : public cca::CUDAAllocator {
 public:
  // --- allocation --------------------------------------------------------------------------

  c10::DataPtr allocate(size_t size) override {
    const DeviceIndex device = c10::cuda::current_device();
    void* ptr = malloc(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
    return {ptr, ptr, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete_fn; }

  void* raw_alloc(size_t nbytes) override {
    const DeviceIndex device = c10::cuda::current_device();
    return malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    return malloc(nbytes, c10::cuda::current_device(), stream);
  }

  void raw_delete(void* ptr) override { free(ptr); }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  void* malloc(size_t size, DeviceIndex device, cudaStream_t stream) {
    // Empty tensors: PyTorch's allocator hands out no memory for them either.
    if (size == 0) return nullptr;
    TORCH_CHECK(device >= 0 && device < kMaxDevices, "gmem: device ", int(device),
                " is out of range");
    // Stacks are gathered before any lock: the recorder may take the GIL. (gmem's own tracker
    // takes the Python call site inside the engine, when tracking is on.)
    std::shared_ptr<c10::GatheredContext> context = gather_context();
    void* ptr = nullptr;
    MempoolId_t pool_id{0, 0};
    if (routes_active_.load(std::memory_order_acquire) != 0 &&
        malloc_in_pool(size, device, stream, &ptr, &pool_id)) {
      // served by a private pool
    } else {
      const gmem_status_t status =
          gmem_engine_malloc(device_engine(device), &ptr, size, reinterpret_cast<uintptr_t>(stream));
      if (status == GMEM_ERROR_OUT_OF_MEMORY) {
        ptr = malloc_after_oom(size, device, stream, &pool_id);
      } else if (status != GMEM_OK) {
        TORCH_CHECK(false, "gmem: ", last_gmem_error());
      }
    }
    if (tracing_.load(std::memory_order_relaxed)) {
      record_alloc(ptr, size, device, stream, pool_id, std::move(context));
    }
    return ptr;
  }

  void free(void* ptr) {
    if (ptr == nullptr) return;
    if (tracing_.load(std::memory_order_relaxed)) record_free(ptr);
    // Deleters run in destructors, where throwing would terminate the process: report and go on.
    gmem_status_t status = GMEM_OK;
    if (pool_blocks_.load(std::memory_order_acquire) == 0) {
      status = gmem_free(ptr);
    } else {
      // One lookup names the pointer's engine; a pool's block also updates the pool's count.
      gmem_engine_t* engine = nullptr;
      status = gmem_engine_of(ptr, &engine);
      if (status == GMEM_OK)
        status = gmem_engine_is_pool(engine) == 1 ? free_in_pool(engine, ptr)
                                                  : gmem_engine_free(engine, ptr);
    }
    if (status != GMEM_OK) std::fprintf(stderr, "gmem: %s\n", gmem_last_error());
  }

  // --- lifecycle ---------------------------------------------------------------------------

  void init(int device_count) override {
    std::lock_guard lock(history_mutex_);
    device_count_ = device_count;
    traces_.resize(static_cast<std::size_t>(std::max(device_count, 1)));
    initialized_.store(true, std::memory_order_release);
  }

  bool initialized() override { return initialized_.load(std::memory_order_acquire); }

  std::string name() override { return "gmem"; }

  void enable(bool value) override { enabled_.store(value); }
  bool isEnabled() const override { return enabled_.load(); }

  // --- memory fraction, caches, statistics --------------------------------------------------

  double getMemoryFraction(DeviceIndex device) override {
    check_device(device);
    const double fraction = fractions_[static_cast<std::size_t>(device)].load();
    return fraction > 0.0 ? fraction : 1.0;
  }

  void setMemoryFraction(double fraction, DeviceIndex device) override {
    check_device(device);
    TORCH_CHECK(gmem_set_memory_fraction(device, fraction) == GMEM_OK, "gmem: ",
                last_gmem_error());
    fractions_[static_cast<std::size_t>(device)].store(fraction);
  }

  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex) override {
    return {};  // gmem has no expandable segments: every engine maps pages on demand
  }

  // {0, 0}: every device engine, and pools no graph or MemPool holds any more (their cached
  // memory cannot be replayed into). A pool's id: that pool's cache, as asked.
  void emptyCache(MempoolId_t mempool_id = {0, 0}) override {
    std::vector<gmem_engine_t*> engines;
    {
      std::lock_guard lock(pools_mutex_);
      for (auto& [id, pool] : pools_) {
        if (mempool_id == MempoolId_t{0, 0} ? pool.use_count == 0 : id == mempool_id)
          engines.push_back(pool.engine);
      }
      if (mempool_id == MempoolId_t{0, 0}) {
        for (auto& slot : engines_)
          if (gmem_engine_t* e = slot.load(std::memory_order_acquire)) engines.push_back(e);
      }
      for (gmem_engine_t* e : engines)
        TORCH_CHECK(gmem_engine_empty_cache(e) == GMEM_OK, "gmem: ", last_gmem_error());
    }
  }

  // The largest allocation that needs no new memory from outside gmem's reach: any free page
  // held can be mapped into one range (gmem stitches), plus what the limit and the device allow.
  void cacheInfo(DeviceIndex device, size_t* largest_block) override {
    check_device(device);
    gmem_engine_stats_t s{};
    TORCH_CHECK(gmem_engine_stats(device_engine(device), 1, &s) == GMEM_OK, "gmem: ",
                last_gmem_error());
    size_t free_bytes = 0, total_bytes = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    }
    const int64_t reserved = s.reserved_bytes[0].current;
    const int64_t headroom =
        std::min<int64_t>(static_cast<int64_t>(free_bytes), std::max<int64_t>(0, s.memory_limit - reserved));
    const int64_t held_free = s.free_mapped_bytes + s.free_unmapped_bytes;
    *largest_block = static_cast<size_t>(std::max(s.largest_free_range, held_free + headroom));
  }

  // The device's engine and its pools as one, with peaks of their sum (gmem_device_stats).
  DeviceStats getDeviceStats(DeviceIndex device) override {
    check_device(device);
    gmem_engine_stats_t s{};
    // O(1) per engine (no walk): inactive_split* read 0 here; gmem.memory_summary() has them.
    TORCH_CHECK(gmem_device_stats(device, 0, &s) == GMEM_OK, "gmem: ", last_gmem_error());
    return to_device_stats(s);
  }

  void resetAccumulatedStats(DeviceIndex device) override {
    check_device(device);
    TORCH_CHECK(gmem_reset_accumulated_stats(device) == GMEM_OK, "gmem: ", last_gmem_error());
  }

  void resetPeakStats(DeviceIndex device) override {
    check_device(device);
    TORCH_CHECK(gmem_reset_peak_stats(device) == GMEM_OK, "gmem: ", last_gmem_error());
  }

  // --- blocks --------------------------------------------------------------------------------

  // Every gmem block is its own base: blocks are never carved out of a larger cudaMalloc.
  void* getBaseAllocation(void* ptr, size_t* size) override {
    gmem_block_t block{};
    gmem_engine_t* engine = engine_of_block(ptr);
    TORCH_CHECK(engine != nullptr && gmem_engine_block(engine, ptr, &block) == GMEM_OK,
                "gmem: getBaseAllocation(", hex(ptr), "): not the start of a live gmem block");
    if (size != nullptr) *size = block.size;
    return ptr;
  }

  void recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) override {
    void* ptr = data.get();
    // Not ours (a tensor from another allocator, or an empty one): nothing to track, as PyTorch.
    if (ptr == nullptr || data.get_deleter() != &raw_delete_fn) return;
    gmem_engine_t* engine = engine_of_block(ptr);
    TORCH_CHECK(engine != nullptr, "gmem: record_stream: ", hex(ptr), " is not a gmem block");
    TORCH_CHECK(gmem_engine_record_stream(engine, ptr,
                                          reinterpret_cast<uintptr_t>(stream.stream())) == GMEM_OK,
                "gmem: ", last_gmem_error());
  }

  // --- private pools -------------------------------------------------------------------------

  void beginAllocateToPool(DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    check_device(device);
    std::lock_guard lock(pools_mutex_);
    create_or_incref(device, mempool_id);
    auto& routes = routes_[static_cast<std::size_t>(device)];
    routes.push_back(Route{mempool_id, std::move(filter)});
    routes_active_.fetch_add(1, std::memory_order_release);
    if (routes.size() == 1) set_capturing(device, true);
  }

  void endAllocateToPool(DeviceIndex device, MempoolId_t mempool_id) override {
    check_device(device);
    std::lock_guard lock(pools_mutex_);
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

  void releasePool(DeviceIndex device, MempoolId_t mempool_id) override {
    std::lock_guard lock(pools_mutex_);
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

  int getPoolUseCount(DeviceIndex, MempoolId_t mempool_id) override {
    std::lock_guard lock(pools_mutex_);
    auto it = pools_.find(mempool_id);
    return it == pools_.end() ? 0 : it->second.use_count;
  }

  void createOrIncrefPool(DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    TORCH_CHECK(allocator == nullptr || allocator.get() == this,
                "gmem: a MemPool served by another allocator (MemPool(allocator=...)) is not "
                "supported while gmem is PyTorch's allocator; create torch.cuda.MemPool() "
                "without an allocator (gmem serves it as a private pool)");
    check_device(device);
    std::lock_guard lock(pools_mutex_);
    create_or_incref(device, mempool_id);
  }

  void setUseOnOOM(DeviceIndex, MempoolId_t mempool_id, bool use_on_oom) override {
    std::lock_guard lock(pools_mutex_);
    auto it = pools_.find(mempool_id);
    TORCH_CHECK(it != pools_.end(), "gmem: setUseOnOOM: no pool (", mempool_id.first, ", ",
                mempool_id.second, ")");
    it->second.use_on_oom = use_on_oom;
  }

  void setNoSplit(DeviceIndex, MempoolId_t) override {
    // PyTorch's no-split keeps a pool's blocks whole for registration with NCCL; gmem's pool is
    // an engine whose pages may be shared by small blocks. Accepted, and said once.
    TORCH_WARN_ONCE("gmem: MemPool no_split is not honoured: gmem's pools map pages on demand");
  }

  bool checkPoolLiveAllocations(DeviceIndex, MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected) override {
    std::lock_guard lock(pools_mutex_);
    auto it = pools_.find(mempool_id);
    if (it == pools_.end()) return expected.empty();
    if (it->second.live_blocks != expected.size()) return false;
    for (const gmem_block_t& block : live_blocks_of(it->second.engine))
      if (expected.count(block.ptr) == 0) return false;
    return true;
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(DeviceIndex device,
                                                          MempoolId_t id) override {
    std::lock_guard lock(pools_mutex_);
    auto state = std::make_shared<PoolCheckpoint>();
    state->id = id;
    state->device = device;
    auto it = pools_.find(id);
    if (it == pools_.end()) return state;
    state->blocks = live_blocks_of(it->second.engine);
    state->live = pointers_of(state->blocks);
    return state;
  }

  // Puts a pool back to a checkpoint, as PyTorch's allocator does (cudagraph trees call it before
  // recording a graph that follows another): the blocks allocated since are freed, and every
  // block live at the checkpoint is handed out anew at its address, those freed since allocated
  // there again (Engine::malloc_at). As in PyTorch, a block live all along is listed both as
  // freed and as allocated, so that only the blocks of neither count as freed for good.
  cca::CheckpointDelta setCheckpointPoolState(
      DeviceIndex device, std::shared_ptr<cca::AllocatorState> pps) override {
    auto* state = dynamic_cast<PoolCheckpoint*>(pps.get());
    TORCH_CHECK(state != nullptr, "gmem: setCheckpointPoolState: not a gmem checkpoint");
    cca::CheckpointDelta delta;
    std::vector<void*> to_free;
    std::vector<const gmem_block_t*> to_restore;
    gmem_engine_t* engine = nullptr;
    {
      std::lock_guard lock(pools_mutex_);
      auto it = pools_.find(state->id);
      TORCH_CHECK(it != pools_.end(), "gmem: setCheckpointPoolState: the pool is gone");
      engine = it->second.engine;
      const std::unordered_set<void*> live = pointers_of(live_blocks_of(engine));
      for (void* ptr : live) {
        delta.ptrs_freed.push_back(ptr);
        if (state->live.count(ptr) == 0) to_free.push_back(ptr);
      }
      for (const gmem_block_t& block : state->blocks)
        if (live.count(block.ptr) == 0) to_restore.push_back(&block);
    }
    for (void* ptr : to_free) free(ptr);
    for (std::size_t k = 0; k < to_restore.size(); ++k) {
      const gmem_block_t& block = *to_restore[k];
      if (gmem_pool_malloc_at(engine, block.ptr, block.requested) != GMEM_OK) {
        const std::string why = last_gmem_error();
        for (std::size_t j = 0; j < k; ++j) free(to_restore[j]->ptr);  // as it was
        TORCH_CHECK(false, "gmem: putting a CUDA-graph pool back to its checkpoint "
                    "(cudagraph trees): the block at ", hex(block.ptr), " (", block.requested,
                    " bytes) cannot be allocated there again: ", why);
      }
      std::lock_guard lock(pools_mutex_);
      auto it = pools_.find(state->id);
      note_pool_block(it->second);
    }
    if (tracing_.load(std::memory_order_relaxed))
      for (const gmem_block_t* block : to_restore)
        record_alloc(block->ptr, block->requested, device,
                     reinterpret_cast<cudaStream_t>(block->stream), state->id, nullptr);
    for (const gmem_block_t& block : state->blocks)
      delta.dataptrs_allocd.emplace_back(block.ptr, block.ptr, &raw_delete_fn,
                                         c10::Device(c10::DeviceType::CUDA, device));
    return delta;
  }

  // --- history and snapshots -----------------------------------------------------------------

  void recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override {
    std::lock_guard lock(history_mutex_);
    record_history_ = enabled;
    recorder_.store(enabled && when != RecordContext::NEVER ? context_recorder : nullptr);
    when_ = when;
    max_entries_ = std::max<size_t>(alloc_trace_max_entries, 1);
    skip_actions_.clear();
    for (const std::string& action : skip_actions)
      skip_actions_.insert(c10::CachingDeviceAllocator::parseTraceEntryAction(action));
    if (clear_history) {
      for (auto& trace : traces_) trace.clear();
      annotations_.clear();
    }
    tracing_.store(record_history_ || !trackers_.empty(), std::memory_order_relaxed);
  }

  bool isHistoryEnabled() override {
    std::lock_guard lock(history_mutex_);
    return record_history_;
  }

  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    if (!tracing_.load(std::memory_order_relaxed)) return;
    c10::CachingDeviceAllocator::AnnotationEntry entry(c10::cuda::current_device(),
                                                       c10::getApproximateTime());
    for (const auto& [key, value] : md) entry.recordUserMetadata(key, value);
    std::lock_guard lock(history_mutex_);
    if (!record_history_) return;
    if (annotations_.size() >= max_entries_) annotations_.pop_front();
    annotations_.push_back(std::move(entry));
  }

  void pushCompileContext(std::string& md) override {
    if (tracing_.load(std::memory_order_relaxed)) compile_contexts().push_back(md);
  }

  void popCompileContext() override {
    auto& stack = compile_contexts();
    if (!stack.empty()) stack.pop_back();
  }

  void setUserMetadata(const std::string& metadata) override {
    std::lock_guard lock(history_mutex_);
    user_metadata_ = metadata;
  }

  std::string getUserMetadata() override {
    std::lock_guard lock(history_mutex_);
    return user_metadata_;
  }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard lock(history_mutex_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    std::lock_guard lock(history_mutex_);
    trackers_.push_back(std::move(tracker));
    tracing_.store(true, std::memory_order_relaxed);
  }

  // Segments are gmem's live blocks, one segment each (gmem has no cudaMalloc'd segments to carve
  // blocks from); cached free memory is not listed (memory_stats has it).
  cca::SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    struct Found {
      gmem_block_t block;
      DeviceIndex device;
      MempoolId_t pool;
    };
    std::vector<Found> found;
    auto collect = [&](gmem_engine_t* engine, DeviceIndex device, MempoolId_t pool) {
      struct Sink {
        std::vector<Found>* out;
        DeviceIndex device;
        MempoolId_t pool;
      } sink{&found, device, pool};
      TORCH_CHECK(gmem_engine_for_each_block(
                      engine,
                      [](void* user, const gmem_block_t* b) {
                        auto* s = static_cast<Sink*>(user);
                        s->out->push_back(Found{*b, s->device, s->pool});
                      },
                      &sink) == GMEM_OK,
                  "gmem: ", last_gmem_error());
    };
    {
      std::lock_guard lock(pools_mutex_);
      for (auto& [id, pool] : pools_)
        if (mempool_id == MempoolId_t{0, 0} || id == mempool_id)
          collect(pool.engine, pool.device, id);
      if (mempool_id == MempoolId_t{0, 0}) {
        for (int d = 0; d < kMaxDevices; ++d)
          if (gmem_engine_t* e = engines_[static_cast<std::size_t>(d)].load())
            collect(e, static_cast<DeviceIndex>(d), {0, 0});
      }
    }
    std::sort(found.begin(), found.end(),
              [](const Found& a, const Found& b) { return a.block.ptr < b.block.ptr; });

    cca::SnapshotInfo info;
    std::lock_guard lock(history_mutex_);
    for (const Found& f : found) {
      c10::CachingDeviceAllocator::SegmentInfo segment;
      segment.device = f.device;
      segment.address = reinterpret_cast<size_t>(f.block.ptr);
      segment.total_size = segment.allocated_size = segment.active_size = f.block.size;
      segment.requested_size = f.block.requested;
      segment.stream = reinterpret_cast<void*>(f.block.stream);
      segment.is_large = f.block.size > kSmallLimit;
      segment.owner_private_pool_id = f.pool;
      c10::CachingDeviceAllocator::BlockInfo block;
      block.size = f.block.size;
      block.requested_size = f.block.requested;
      block.allocated = block.active = true;
      auto traced = traced_.find(f.block.ptr);
      if (traced != traced_.end()) block.context_when_allocated = traced->second.context;
      segment.context_when_allocated = block.context_when_allocated;
      segment.blocks.push_back(std::move(block));
      info.segments.push_back(std::move(segment));
    }
    if (include_traces) {
      auto to_unix_ns = clock_converter_.makeConverter();
      const std::size_t devices = std::max<std::size_t>(traces_.size(), 1);
      info.device_traces.resize(devices);
      for (std::size_t d = 0; d < traces_.size(); ++d) {
        for (const TraceEntry& entry : traces_[d]) {
          TraceEntry copy = entry;
          copy.time_.t_ = to_unix_ns(entry.time_.approx_t_) / 1000;  // microseconds
          info.device_traces[d].push_back(std::move(copy));
        }
      }
      for (const auto& entry : annotations_) {
        auto copy = entry;
        copy.time_.t_ = to_unix_ns(entry.time_.approx_t_) / 1000;
        info.external_annotations.push_back(std::move(copy));
      }
    }
    info.config_metadata = cca::AllocatorConfigInfo{};
    info.config_metadata.last_allocator_settings = "gmem";
    return info;
  }

  // --- IPC, peers, copies ----------------------------------------------------------------------

  cca::ShareableHandle shareIpcHandle(void*) override { TORCH_CHECK(false, kIpcRefusal); }

  std::shared_ptr<void> getIpcDevPtr(std::string) override { TORCH_CHECK(false, kIpcRefusal); }

  // As PyTorch: lets `dev` reach `dev_to_access`'s cudaMalloc memory. gmem's own mappings grant
  // access to their device only; copies between devices go through memcpyAsync's peer copy.
  void enablePeerAccess(DeviceIndex dev, DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();  // clear the sticky-free error
      return;
    }
    C10_CUDA_CHECK(err);
  }

  // gmem's memory is cuMemMap'ed, so a copy between devices must be a peer copy whether or not
  // peer access is on (plain cudaMemcpyAsync would fail without it).
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                          size_t count, cudaStream_t stream, bool /*p2p_enabled*/) override {
    if (dst_device == src_device)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }

 private:
  // --- engines ---------------------------------------------------------------------------------

  static void check_device(DeviceIndex device) {
    TORCH_CHECK(device >= 0 && device < kMaxDevices, "gmem: device ", int(device),
                " is out of range");
  }

  gmem_engine_t* device_engine(DeviceIndex device) {
    auto& slot = engines_[static_cast<std::size_t>(device)];
    if (gmem_engine_t* e = slot.load(std::memory_order_acquire)) return e;
    gmem_engine_t* e = nullptr;
    TORCH_CHECK(gmem_device_engine(device, &e) == GMEM_OK, "gmem: ", last_gmem_error());
    slot.store(e, std::memory_order_release);  // the same handle whoever wins
    return e;
  }

  // The engine whose memory holds `ptr`, a pool's or its device's; nullptr when no gmem engine's.
  gmem_engine_t* engine_of_block(void* ptr) {
    gmem_engine_t* engine = nullptr;
    return gmem_engine_of(ptr, &engine) == GMEM_OK ? engine : nullptr;
  }

  // --- pools (pools_mutex_ held) ---------------------------------------------------------------

  // A capture (or another allocation to a pool) begins on `device`, or the last one ends: as
  // PyTorch's allocator defers its events while captures are under way, every engine of the
  // device makes no event call meanwhile (an event query invalidates a capture).
  void set_capturing(DeviceIndex device, bool capturing) {
    auto set = [&](gmem_engine_t* e) {
      TORCH_CHECK(gmem_engine_set_capturing(e, capturing) == GMEM_OK, "gmem: ", last_gmem_error());
    };
    set(device_engine(device));
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

  void note_pool_block(Pool& pool) {
    ++pool.live_blocks;
    pool_blocks_.fetch_add(1, std::memory_order_release);
  }

  // True when a begun route took the malloc; *ptr is then set, or an OOM is thrown.
  bool malloc_in_pool(size_t size, DeviceIndex device, cudaStream_t stream, void** ptr,
                      MempoolId_t* pool_id) {
    gmem_engine_t* engine = nullptr;
    {
      // The pool malloc runs under the lock so that no release can destroy the pool meanwhile.
      std::lock_guard lock(pools_mutex_);
      Pool* pool = route(device, stream);
      if (pool == nullptr) return false;
      engine = pool->engine;
      *pool_id = pool->id;
      const gmem_status_t status =
          gmem_engine_malloc(engine, ptr, size, reinterpret_cast<uintptr_t>(stream));
      if (status == GMEM_OK) {
        note_pool_block(*pool);
        return true;
      }
      TORCH_CHECK(status == GMEM_ERROR_OUT_OF_MEMORY, "gmem: ", last_gmem_error());
    }
    // Out of memory in the pool: what the device engine and released pools cache may go back.
    release_caches_for(nullptr);
    {
      std::lock_guard lock(pools_mutex_);
      Pool* pool = route(device, stream);
      if (pool != nullptr &&
          gmem_engine_malloc(pool->engine, ptr, size, reinterpret_cast<uintptr_t>(stream)) ==
              GMEM_OK) {
        note_pool_block(*pool);
        return true;
      }
    }
    raise_oom(device, size);
  }

  // The device engine failed (after reclaiming its own cache): give back what released pools
  // cache, try pools marked use_on_oom (MemPool(use_on_oom=True)), then the engine once more.
  void* malloc_after_oom(size_t size, DeviceIndex device, cudaStream_t stream,
                         MempoolId_t* pool_id) {
    const std::string first_error = last_gmem_error();
    {
      std::lock_guard lock(pools_mutex_);
      for (auto& [id, pool] : pools_) {
        if (pool.device != device || !pool.use_on_oom) continue;
        void* ptr = nullptr;
        if (gmem_engine_malloc(pool.engine, &ptr, size, reinterpret_cast<uintptr_t>(stream)) ==
            GMEM_OK) {
          note_pool_block(pool);
          *pool_id = id;
          return ptr;
        }
      }
    }
    if (release_caches_for(device_engine(device))) {
      void* ptr = nullptr;
      if (gmem_engine_malloc(device_engine(device), &ptr, size,
                             reinterpret_cast<uintptr_t>(stream)) == GMEM_OK)
        return ptr;
    }
    raise_oom(device, size, first_error);
  }

  // Empties the caches of pools no user holds, and of the device engines other than `except`.
  // True when any engine was emptied.
  bool release_caches_for(gmem_engine_t* except) {
    bool any = false;
    std::lock_guard lock(pools_mutex_);  // held: a pool's last free may destroy its engine
    for (auto& [id, pool] : pools_) {
      if (pool.use_count != 0) continue;
      (void)gmem_engine_empty_cache(pool.engine);
      any = true;
    }
    for (auto& slot : engines_) {
      gmem_engine_t* e = slot.load(std::memory_order_acquire);
      if (e == nullptr || e == except) continue;
      (void)gmem_engine_empty_cache(e);
      any = true;
    }
    return any;
  }

  // Out of memory for good: tell the observers (torch's OOM hooks), record it, and throw the
  // error torch turns into torch.OutOfMemoryError, carrying gmem's report.
  [[noreturn]] void raise_oom(DeviceIndex device, size_t size, std::string message = {}) {
    if (message.empty()) message = last_gmem_error();
    size_t free_bytes = 0, total_bytes = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
    }
    const DeviceStats stats = getDeviceStats(device);
    const auto allocated = static_cast<size_t>(stats.allocated_bytes[0].current);
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard lock(history_mutex_);
      observers = oom_observers_;
    }
    if (tracing_.load(std::memory_order_relaxed))
      record_trace(TraceEntry::OOM, device, free_bytes, size, nullptr, {0, 0}, nullptr);
    for (const auto& observer : observers) observer(device, allocated, total_bytes, free_bytes);
    C10_THROW_ERROR(OutOfMemoryError, "gmem: " + message);
  }

  // Frees a block of the pool `engine`, which a pool destroyed once released and empty.
  gmem_status_t free_in_pool(gmem_engine_t* engine, void* ptr) {
    std::lock_guard lock(pools_mutex_);
    const gmem_status_t status = gmem_engine_free(engine, ptr);
    auto it = pool_of_engine_.find(engine);
    if (status != GMEM_OK || it == pool_of_engine_.end()) return status;
    Pool* pool = it->second;
    --pool->live_blocks;
    pool_blocks_.fetch_sub(1, std::memory_order_release);
    if (pool->use_count == 0 && pool->live_blocks == 0) destroy_if_unused(pools_.find(pool->id));
    return GMEM_OK;
  }

  // --- history ---------------------------------------------------------------------------------

  static std::vector<std::string>& compile_contexts() {
    thread_local std::vector<std::string> stack;
    return stack;
  }

  std::shared_ptr<c10::GatheredContext> gather_context() {
    cca::CreateContextFn recorder = recorder_.load(std::memory_order_relaxed);
    return recorder != nullptr ? recorder() : nullptr;
  }

  void record_alloc(void* ptr, size_t size, DeviceIndex device, cudaStream_t stream,
                    MempoolId_t pool, std::shared_ptr<c10::GatheredContext> context) {
    {
      std::lock_guard lock(history_mutex_);
      if (record_history_) traced_[ptr] = TracedBlock{size, device, stream, pool, context};
    }
    const RecordContext when = when_.load(std::memory_order_relaxed);
    const bool in_trace = when == RecordContext::ALLOC || when == RecordContext::ALL;
    record_trace(TraceEntry::ALLOC, device, reinterpret_cast<size_t>(ptr), size, stream, pool,
                 in_trace ? std::move(context) : nullptr);
  }

  void record_free(void* ptr) {
    TracedBlock block;
    {
      std::lock_guard lock(history_mutex_);
      auto it = traced_.find(ptr);
      if (it == traced_.end()) return;  // allocated before history was on
      block = std::move(it->second);
      traced_.erase(it);
    }
    std::shared_ptr<c10::GatheredContext> context =
        when_.load(std::memory_order_relaxed) == RecordContext::ALL ? gather_context() : nullptr;
    // gmem completes a free at once (reuse on other streams waits inside the engine).
    record_trace(TraceEntry::FREE_REQUESTED, block.device, reinterpret_cast<size_t>(ptr),
                 block.size, block.stream, block.pool, context);
    record_trace(TraceEntry::FREE_COMPLETED, block.device, reinterpret_cast<size_t>(ptr),
                 block.size, block.stream, block.pool, std::move(context));
  }

  void record_trace(TraceEntry::Action action, DeviceIndex device, size_t addr, size_t size,
                    cudaStream_t stream, MempoolId_t pool,
                    std::shared_ptr<c10::GatheredContext> context) {
    const auto& compile = compile_contexts();
    std::lock_guard lock(history_mutex_);
    TraceEntry entry(action, device, addr, size, stream, pool, c10::getApproximateTime(),
                     std::move(context), compile.empty() ? std::string() : compile.back(),
                     user_metadata_);
    for (const auto& tracker : trackers_) tracker(entry);
    if (!record_history_ || skip_actions_.count(action) != 0) return;
    const auto d = static_cast<std::size_t>(device);
    if (d >= traces_.size()) traces_.resize(d + 1);
    auto& trace = traces_[d];
    if (trace.size() >= max_entries_) trace.pop_front();
    trace.push_back(std::move(entry));
  }

  // --- state -----------------------------------------------------------------------------------

  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  int device_count_ = 0;
  std::array<std::atomic<gmem_engine_t*>, kMaxDevices> engines_{};
  std::array<std::atomic<double>, kMaxDevices> fractions_{};  // 0 = never set: 1.0

  // Pools: what routes and frees read only when their counter says there is something.
  std::mutex pools_mutex_;
  std::map<MempoolId_t, Pool> pools_;  // node-based: Pool pointers stay valid
  std::array<std::vector<Route>, kMaxDevices> routes_;
  std::unordered_map<gmem_engine_t*, Pool*> pool_of_engine_;  // a pool per engine, not per block
  std::atomic<int> routes_active_{0};
  std::atomic<int> pool_blocks_{0};

  // History, trace trackers and OOM observers.
  std::mutex history_mutex_;
  std::atomic<bool> tracing_{false};  // history on, or a trace tracker attached
  std::atomic<cca::CreateContextFn> recorder_{nullptr};
  bool record_history_ = false;
  std::atomic<RecordContext> when_{RecordContext::NEVER};
  size_t max_entries_ = 1;
  std::set<TraceEntry::Action> skip_actions_;
  std::vector<std::deque<TraceEntry>> traces_;  // per device
  std::deque<c10::CachingDeviceAllocator::AnnotationEntry> annotations_;
  std::unordered_map<void*, TracedBlock> traced_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  std::string user_metadata_;
  c10::ApproximateClockToUnixTimeConverter clock_converter_;
};

GmemAllocator* g_allocator = nullptr;

void raw_delete_fn(void* ptr) { g_allocator->free(ptr); }

std::shared_ptr<GmemAllocator>& instance() {
  // Never destroyed: PyTorch frees tensors during interpreter shutdown, after static destructors.
  static auto* allocator = new std::shared_ptr<GmemAllocator>(std::make_shared<GmemAllocator>());
  return *allocator;
}

void copy_message(const std::string& text, char* buf, size_t size) {
  if (buf == nullptr || size == 0) return;
  const size_t n = std::min(text.size(), size - 1);
  std::memcpy(buf, text.data(), n);
  buf[n] = '\0';
}

}  // namespace
}  // namespace gmem_torch

extern "C" {

// Makes gmem PyTorch's CUDA allocator. 0 on success; otherwise the reason (PyTorch's, e.g. "Can't
// swap an already initialized allocator") is written to `error`.
int gmem_torch_allocator_install(char* error, size_t size) {
  try {
    auto& allocator = gmem_torch::instance();
    gmem_torch::g_allocator = allocator.get();
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
    return 0;
  } catch (const c10::Error& e) {
    gmem_torch::copy_message(e.what_without_backtrace(), error, size);
  } catch (const std::exception& e) {
    gmem_torch::copy_message(e.what(), error, size);
  }
  return 1;
}

// 1 while gmem's allocator is the one PyTorch uses.
int gmem_torch_allocator_active(void) {
  return gmem_torch::g_allocator != nullptr &&
                 c10::cuda::CUDACachingAllocator::get() == gmem_torch::g_allocator
             ? 1
             : 0;
}

}  // extern "C"
