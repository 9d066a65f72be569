// Memory history (torch.cuda.memory._record_memory_history), trace trackers and OOM observers.
//
// History keeps PyTorch's GatheredContext per block and in trace entries, so torch's own
// _snapshot() symbolises the stacks as it does for its allocator. The allocator's hot path reads
// one atomic (tracing()) and calls in only when history is on or a trace tracker is attached;
// everything else is under one mutex. Stacks are gathered by the caller before any lock: the
// recorder may take the GIL.
//
// Private to _torch_allocator.cpp (one translation unit: gmem/_shim.py compiles that file only).
#pragma once

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "convert.hpp"
#include "gmem/gmem.h"

namespace gmem_torch {
namespace {

constexpr std::size_t kSmallLimit = std::size_t{1} << 20;  // gmem's small pool: <= 1 MiB

// What history remembers of a block allocated while it was on.
struct TracedBlock {
  std::size_t size = 0;            // as requested
  DeviceIndex device = 0;
  cudaStream_t stream = nullptr;   // the allocation's stream
  MempoolId_t pool{0, 0};          // the private pool; {0, 0} for the device's engine
  std::shared_ptr<c10::GatheredContext> context;  // the stack at allocation, when recorded
};

class History {
 public:
  // --- the hot path ----------------------------------------------------------------------------

  // History on, or a trace tracker attached: mallocs and frees are then recorded.
  bool tracing() const { return tracing_.load(std::memory_order_relaxed); }

  // The stack of the current call, when history records stacks; else nullptr.
  std::shared_ptr<c10::GatheredContext> gather_context() {
    cca::CreateContextFn recorder = recorder_.load(std::memory_order_relaxed);
    return recorder != nullptr ? recorder() : nullptr;
  }

  void record_alloc(void* ptr, size_t size, DeviceIndex device, cudaStream_t stream,
                    MempoolId_t pool, std::shared_ptr<c10::GatheredContext> context) {
    {
      std::lock_guard lock(mutex_);
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
      std::lock_guard lock(mutex_);
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

  // Out of memory for good: tell the observers (torch's OOM hooks), record it, and throw the
  // error torch turns into torch.OutOfMemoryError, carrying gmem's report.
  [[noreturn]] void raise_oom(DeviceIndex device, size_t size, std::string message = {}) {
    if (message.empty()) message = last_gmem_error();
    size_t free_bytes = 0, total_bytes = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
    }
    const DeviceStats stats = device_stats(device);
    const auto allocated = static_cast<size_t>(stats.allocated_bytes[0].current);
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard lock(mutex_);
      observers = oom_observers_;
    }
    if (tracing_.load(std::memory_order_relaxed))
      record_trace(TraceEntry::OOM, device, free_bytes, size, nullptr, {0, 0}, nullptr);
    for (const auto& observer : observers) observer(device, allocated, total_bytes, free_bytes);
    C10_THROW_ERROR(OutOfMemoryError, "gmem: " + message);
  }

  // --- settings (c10's recordHistory and the like) --------------------------------------------

  void init(int device_count) {
    std::lock_guard lock(mutex_);
    traces_.resize(static_cast<std::size_t>(std::max(device_count, 1)));
  }

  void record(bool enabled, cca::CreateContextFn context_recorder,
              size_t alloc_trace_max_entries, RecordContext when, bool clear_history,
              const std::vector<std::string>& skip_actions) {
    std::lock_guard lock(mutex_);
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

  bool enabled() {
    std::lock_guard lock(mutex_);
    return record_history_;
  }

  void annotate(const std::vector<std::pair<std::string, std::string>>& md) {
    if (!tracing_.load(std::memory_order_relaxed)) return;
    c10::CachingDeviceAllocator::AnnotationEntry entry(c10::cuda::current_device(),
                                                       c10::getApproximateTime());
    for (const auto& [key, value] : md) entry.recordUserMetadata(key, value);
    std::lock_guard lock(mutex_);
    if (!record_history_) return;
    if (annotations_.size() >= max_entries_) annotations_.pop_front();
    annotations_.push_back(std::move(entry));
  }

  void push_compile_context(std::string& md) {
    if (tracing_.load(std::memory_order_relaxed)) compile_contexts().push_back(md);
  }

  void pop_compile_context() {
    auto& stack = compile_contexts();
    if (!stack.empty()) stack.pop_back();
  }

  void set_user_metadata(const std::string& metadata) {
    std::lock_guard lock(mutex_);
    user_metadata_ = metadata;
  }

  std::string user_metadata() {
    std::lock_guard lock(mutex_);
    return user_metadata_;
  }

  void attach_oom_observer(cca::OutOfMemoryObserver observer) {
    std::lock_guard lock(mutex_);
    oom_observers_.push_back(std::move(observer));
  }

  void attach_trace_tracker(cca::AllocatorTraceTracker tracker) {
    std::lock_guard lock(mutex_);
    trackers_.push_back(std::move(tracker));
    tracing_.store(true, std::memory_order_relaxed);
  }

  // --- snapshots -------------------------------------------------------------------------------

  // Segments are gmem's live blocks (`found`, in address order), one segment each (gmem has no
  // cudaMalloc'd segments to carve blocks from), with the stacks history kept; cached free
  // memory is not listed (memory_stats has it).
  cca::SnapshotInfo snapshot(const std::vector<LiveBlock>& found, bool include_traces) {
    cca::SnapshotInfo info;
    std::lock_guard lock(mutex_);
    for (const LiveBlock& f : found) {
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

 private:
  // torch.compile's context stack (pushCompileContext), per thread: trace entries name its top.
  static std::vector<std::string>& compile_contexts() {
    thread_local std::vector<std::string> stack;
    return stack;
  }

  // Hands the entry to the trace trackers, and keeps it when history is on (the oldest go past
  // max_entries_).
  void record_trace(TraceEntry::Action action, DeviceIndex device, size_t addr, size_t size,
                    cudaStream_t stream, MempoolId_t pool,
                    std::shared_ptr<c10::GatheredContext> context) {
    const auto& compile = compile_contexts();
    std::lock_guard lock(mutex_);
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

  std::mutex mutex_;  // guards everything below but the three atomics
  std::atomic<bool> tracing_{false};  // history on, or a trace tracker attached
  std::atomic<cca::CreateContextFn> recorder_{nullptr};  // gathers stacks; nullptr: none kept
  bool record_history_ = false;  // _record_memory_history(enabled=...)
  std::atomic<RecordContext> when_{RecordContext::NEVER};  // which events keep their stacks
  size_t max_entries_ = 1;  // per device trace, and of annotations: the oldest go
  std::set<TraceEntry::Action> skip_actions_;  // kept out of the traces (trackers see them)
  std::vector<std::deque<TraceEntry>> traces_;  // per device
  std::deque<c10::CachingDeviceAllocator::AnnotationEntry> annotations_;  // recordAnnotation's
  std::unordered_map<void*, TracedBlock> traced_;  // blocks allocated while history was on
  std::vector<cca::AllocatorTraceTracker> trackers_;  // called with every trace entry
  std::vector<cca::OutOfMemoryObserver> oom_observers_;  // torch's OOM hooks
  std::string user_metadata_;  // setUserMetadata's, in every trace entry
  c10::ApproximateClockToUnixTimeConverter clock_converter_;  // trace times to Unix time
};

}  // namespace
}  // namespace gmem_torch
