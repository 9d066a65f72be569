// gmem as PyTorch's CUDA allocator: a complete c10::cuda::CUDACachingAllocator::CUDAAllocator
// over libgmem's C API (include/gmem/gmem.h), written for PyTorch 2.11's interface.
//
// Built by gmem/_shim.py at first use against the installed torch's headers, linked to libc10,
// libc10_cuda, libtorch_cuda and to the very libgmem.so the Python package loaded; cached. libgmem
// itself stays free of torch. Installed with torch::cuda::CUDAPluggableAllocator::
// changeCurrentAllocator (gmem_torch_allocator_install), which PyTorch allows only before its
// current allocator is initialised.
//
// What each method does (answered by gmem, delegated, refused) is tabled in docs/pytorch.md.
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
//
// One translation unit (gmem/_shim.py compiles this file alone, at install or first use), made of
// private headers in _torch_allocator/, each for one part:
//   convert.hpp  c10's names, device checks, gmem's errors and statistics as c10's
//   engines.hpp  DeviceEngines: each device's engine, looked up once
//   pools.hpp    Pools: private pools, allocate-to-pool routes, captures, checkpoints
//   history.hpp  History: memory history, trace trackers, OOM observers, snapshots
// GmemAllocator below overrides c10's interface (about 45 virtuals), each in a few lines that
// answer from gmem's C API or delegate to those parts; malloc and free stay here, whole.
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "_torch_allocator/convert.hpp"
#include "_torch_allocator/engines.hpp"
#include "_torch_allocator/history.hpp"
#include "_torch_allocator/pools.hpp"
#include "gmem/gmem.h"

namespace gmem_torch {
namespace {

const char kIpcRefusal[] =
    "gmem: sending CUDA tensors between processes (torch.multiprocessing, CUDA IPC) is not "
    "supported by gmem's allocator: its memory is mapped through CUDA's virtual memory API, "
    "which cudaIpcGetMemHandle cannot export. Send CPU tensors (tensor.cpu()) or let each "
    "process allocate its own CUDA tensors, or run this program without gmem.torch.enable().";

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
    std::shared_ptr<c10::GatheredContext> context = history_.gather_context();
    void* ptr = nullptr;
    MempoolId_t pool_id{0, 0};
    if (pools_.routing() && malloc_in_pool(size, device, stream, &ptr, &pool_id)) {
      // served by a private pool
    } else {
      const gmem_status_t status =
          gmem_engine_malloc(engines_.get(device), &ptr, size, reinterpret_cast<uintptr_t>(stream));
      if (status == GMEM_ERROR_OUT_OF_MEMORY) {
        ptr = malloc_after_oom(size, device, stream, &pool_id);
      } else if (status != GMEM_OK) {
        TORCH_CHECK(false, "gmem: ", last_gmem_error());
      }
    }
    if (history_.tracing()) {
      history_.record_alloc(ptr, size, device, stream, pool_id, std::move(context));
    }
    return ptr;
  }

  void free(void* ptr) {
    if (ptr == nullptr) return;
    if (history_.tracing()) history_.record_free(ptr);
    // Deleters run in destructors, where throwing would terminate the process: report and go on.
    gmem_status_t status = GMEM_OK;
    if (!pools_.has_live_blocks()) {
      status = gmem_free(ptr);
    } else {
      status = pools_.free(ptr);  // one lookup names the engine; a pool's updates its count
    }
    if (status != GMEM_OK) std::fprintf(stderr, "gmem: %s\n", gmem_last_error());
  }

  // --- lifecycle ---------------------------------------------------------------------------

  void init(int device_count) override {
    history_.init(device_count);
    device_count_ = device_count;
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

  void emptyCache(MempoolId_t mempool_id = {0, 0}) override { pools_.empty_cache(mempool_id); }

  void cacheInfo(DeviceIndex device, size_t* largest_block) override {
    check_device(device);
    *largest_block = engines_.largest_block(device);
  }

  DeviceStats getDeviceStats(DeviceIndex device) override { return device_stats(device); }

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

  // --- private pools (pools.hpp) -------------------------------------------------------------

  void beginAllocateToPool(DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    check_device(device);
    pools_.begin_route(device, mempool_id, std::move(filter));
  }

  void endAllocateToPool(DeviceIndex device, MempoolId_t mempool_id) override {
    check_device(device);
    pools_.end_route(device, mempool_id);
  }

  void releasePool(DeviceIndex device, MempoolId_t mempool_id) override {
    pools_.release(device, mempool_id);
  }

  int getPoolUseCount(DeviceIndex, MempoolId_t mempool_id) override {
    return pools_.use_count(mempool_id);
  }

  void createOrIncrefPool(DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    TORCH_CHECK(allocator == nullptr || allocator.get() == this,
                "gmem: a MemPool served by another allocator (MemPool(allocator=...)) is not "
                "supported while gmem is PyTorch's allocator; create torch.cuda.MemPool() "
                "without an allocator (gmem serves it as a private pool)");
    check_device(device);
    pools_.hold(device, mempool_id);
  }

  void setUseOnOOM(DeviceIndex, MempoolId_t mempool_id, bool use_on_oom) override {
    pools_.set_use_on_oom(mempool_id, use_on_oom);
  }

  void setNoSplit(DeviceIndex, MempoolId_t) override {
    // PyTorch's no-split keeps a pool's blocks whole for registration with NCCL; gmem's pool is
    // an engine whose pages may be shared by small blocks. Accepted, and said once.
    TORCH_WARN_ONCE("gmem: MemPool no_split is not honoured: gmem's pools map pages on demand");
  }

  bool checkPoolLiveAllocations(DeviceIndex, MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected) override {
    return pools_.check_live(mempool_id, expected);
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(DeviceIndex device,
                                                          MempoolId_t id) override {
    return pools_.checkpoint(device, id);
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
    const std::vector<const gmem_block_t*> to_restore =
        pools_.restore(*state, &delta.ptrs_freed, [this](void* ptr) { free(ptr); });
    if (history_.tracing())
      for (const gmem_block_t* block : to_restore)
        history_.record_alloc(block->ptr, block->requested, device,
                              reinterpret_cast<cudaStream_t>(block->stream), state->id, nullptr);
    for (const gmem_block_t& block : state->blocks)
      delta.dataptrs_allocd.emplace_back(block.ptr, block.ptr, &raw_delete_fn,
                                         c10::Device(c10::DeviceType::CUDA, device));
    return delta;
  }

  // --- history and snapshots (history.hpp) ---------------------------------------------------

  void recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override {
    history_.record(enabled, context_recorder, alloc_trace_max_entries, when, clear_history,
                    skip_actions);
  }

  bool isHistoryEnabled() override { return history_.enabled(); }

  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    history_.annotate(md);
  }

  void pushCompileContext(std::string& md) override { history_.push_compile_context(md); }

  void popCompileContext() override { history_.pop_compile_context(); }

  void setUserMetadata(const std::string& metadata) override {
    history_.set_user_metadata(metadata);
  }

  std::string getUserMetadata() override { return history_.user_metadata(); }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    history_.attach_oom_observer(std::move(observer));
  }

  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    history_.attach_trace_tracker(std::move(tracker));
  }

  // One segment per live block: the pools' and device engines' blocks, with history's stacks.
  cca::SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    return history_.snapshot(pools_.live_blocks(mempool_id), include_traces);
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
  // --- out of memory ---------------------------------------------------------------------------

  // True when a begun route took the malloc; *ptr is then set, or an OOM is thrown.
  bool malloc_in_pool(size_t size, DeviceIndex device, cudaStream_t stream, void** ptr,
                      MempoolId_t* pool_id) {
    const Pools::Routed routed = pools_.malloc_routed(size, device, stream, ptr, pool_id);
    if (routed == Pools::Routed::kOutOfMemory) history_.raise_oom(device, size);
    return routed == Pools::Routed::kServed;
  }

  // The device engine failed (after reclaiming its own cache): give back what released pools
  // cache, try pools marked use_on_oom (MemPool(use_on_oom=True)), then the engine once more.
  void* malloc_after_oom(size_t size, DeviceIndex device, cudaStream_t stream,
                         MempoolId_t* pool_id) {
    const std::string first_error = last_gmem_error();
    if (void* ptr = pools_.malloc_on_oom(size, device, stream, pool_id)) return ptr;
    if (pools_.release_caches(engines_.get(device))) {
      void* ptr = nullptr;
      if (gmem_engine_malloc(engines_.get(device), &ptr, size,
                             reinterpret_cast<uintptr_t>(stream)) == GMEM_OK)
        return ptr;
    }
    history_.raise_oom(device, size, first_error);
  }

  // --- state -----------------------------------------------------------------------------------

  std::atomic<bool> initialized_{false};  // init() ran
  std::atomic<bool> enabled_{true};       // enable()'s flag, as isEnabled() reports it
  int device_count_ = 0;                  // init()'s
  std::array<std::atomic<double>, kMaxDevices> fractions_{};  // 0 = never set: 1.0
  DeviceEngines engines_;                 // declared before pools_, which keeps a reference
  Pools pools_{engines_};
  History history_;
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
