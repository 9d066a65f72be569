// The engine's hot paths (malloc, free) and its public face. Slow paths live in backing.cpp.
#include <algorithm>
#include <bit>
#include <string>

#include "engine/engine_impl.hpp"

namespace gmem {

using detail::Record;

namespace {
constexpr std::size_t kMaxRequest = std::size_t{1} << 46;  // 64 TiB: beyond any device

std::size_t round_up(std::size_t value, std::size_t to) { return (value + to - 1) / to * to; }

std::string hex(DevicePtr ptr) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(ptr));
  return buf;
}
}  // namespace

Engine::Impl::Impl(Device& device, EngineOptions options)
    : device_(device), options_(options), granularity_(device.granularity()), streams_(device) {
  if (!std::has_single_bit(granularity_) || granularity_ < kAlignment)
    throw Error(Errc::invalid_argument, "device granularity must be a power of two >= 512, got " +
                                            std::to_string(granularity_));
  page_shift_ = std::countr_zero(granularity_);
  device_total_ = device.mem_info().total;
  limit_ = checked_limit(options.memory_limit, "EngineOptions::memory_limit");
  // One device's worth of virtual space per arena: a stream rarely needs a second one, and a
  // thousand streams stay within the GPU's address space (2^47 bytes and more).
  arena_size_ = round_up(options.address_space ? options.address_space : device_total_,
                         granularity_);
  stats_.granularity = static_cast<std::int64_t>(granularity_);
  stats_.memory_limit = static_cast<std::int64_t>(limit_);
}

Engine::Impl::~Impl() {
  // Give everything back, live blocks included: the engine owns the memory it handed out.
  for (detail::PendingFree& p : pending_)
    for (EventHandle e : p.events) {
      try { device_.destroy_event(e); } catch (...) {}
    }
  for (const auto& arena : arenas_) {
    const DevicePtr base = arena->ranges.base();
    arena->pages.for_each_touched([&](std::size_t i, const detail::Page& page) {
      if (!page.mapped()) return;
      try {
        device_.unmap(base + (i << page_shift_), granularity_);
      } catch (...) {  // nothing to report to from a destructor
      }
    });
    try { device_.release_address(base, arena->ranges.size()); } catch (...) {}
  }
  for (detail::ChunkId id = 0; id < chunks_.slots(); ++id) {
    if (const ChunkHandle handle = chunks_.at(id).handle) {
      try { device_.release_chunk(handle); } catch (...) {}
    }
  }
}

void Engine::Impl::attach(detail::EngineObserver* observer) {
  observer_ = observer;
  const detail::ContextCapture capture = observer ? observer->context_capture() : detail::ContextCapture{};
  capture_depth_.store(capture.depth, std::memory_order_relaxed);
  capture_frees_.store(capture.on_free, std::memory_order_relaxed);
  capture_.store(capture.capture, std::memory_order_release);
}

void* Engine::Impl::malloc(std::size_t size, StreamId stream) {
  if (size == 0) throw Error(Errc::invalid_argument, "malloc(0): size must be at least 1 byte");
  if (size > kMaxRequest)
    throw Error(Errc::invalid_argument, "malloc(" + std::to_string(size) +
                                            "): larger than any device (a negative size cast?)");
  const std::uint32_t context = gather_context(false);
  std::lock_guard lock(mutex_);
  if (!pending_.empty()) [[unlikely]] process_pending(false);
  const std::uint32_t si = streams_.index(stream);
  const std::size_t rounded = round_up(size, kAlignment);
  Record record{rounded, size, stream, 0, 0, false, false, false, {}};
  const DevicePtr ptr = rounded <= detail::kSlabLimit ? malloc_slab(size, rounded, si, record)
                                                      : malloc_range(size, rounded, si, record);
  if (observer_) observer_->on_malloc(ptr, rounded, stream, context, record.tag);
  live_.insert(ptr, record);
  count_malloc(record);
  return reinterpret_cast<void*>(ptr);
}

DevicePtr Engine::Impl::malloc_slab(std::size_t size, std::size_t rounded, std::uint32_t si,
                                    Record& record) {
  const int cls = detail::size_class(rounded);
  detail::SlabId slab = detail::kNoSlab;
  DevicePtr ptr = 0;
  std::uint32_t arena = 0;
  for (std::uint32_t a : streams_.arenas(si)) {
    if ((ptr = slabs_.allocate(a, cls, slab)) != 0) {
      arena = a;
      break;
    }
  }
  if (ptr == 0) {  // a new slab
    const std::size_t bytes = detail::class_size(cls) * detail::slab_objects(cls);
    const auto [a, node] = take_range(si, bytes, size);
    arena = a;
    slabs_.add(a, cls, arenas_[a]->ranges.node(node).addr, node);
    move_reserved_to_small(static_cast<std::int64_t>(bytes));
    ptr = slabs_.allocate(a, cls, slab);
  }
  record.arena = arena;
  record.id = slab;
  record.small = record.in_slab = true;
  return ptr;
}

DevicePtr Engine::Impl::malloc_range(std::size_t size, std::size_t rounded, std::uint32_t si,
                                     Record& record) {
  const auto [arena, node] = take_range(si, rounded, size);
  const DevicePtr ptr = arenas_[arena]->ranges.node(node).addr;
  const bool small = rounded <= kSmallLimit;
  range_bytes_ += rounded;
  if (small) {
    small_range_bytes_ += rounded;
    move_reserved_to_small(static_cast<std::int64_t>(rounded));
  }
  record.arena = arena;
  record.id = node;
  record.small = small;
  return ptr;
}

void Engine::Impl::count_malloc(const Record& record) {
  const auto r = static_cast<std::int64_t>(record.size);
  const auto q = static_cast<std::int64_t>(record.requested);
  const int own = record.small ? kSmallPool : kLargePool;
  for (int pool : {static_cast<int>(kAllPools), own}) {
    stats_.allocated_bytes[pool].increase(r);
    stats_.active_bytes[pool].increase(r);
    stats_.requested_bytes[pool].increase(q);
    stats_.allocation[pool].increase(1);
    stats_.active[pool].increase(1);
  }
}

void Engine::Impl::move_reserved_to_small(std::int64_t bytes) {
  // Reserved memory is chunks; the small pool's share is what its slabs and ranges cover. All
  // pools' total does not change, but counts the move as the pools do (stats.hpp: .all's running
  // totals are the pools' sums).
  stats_.reserved_bytes[kAllPools].count_move(bytes > 0 ? bytes : -bytes);
  if (bytes > 0) {
    stats_.reserved_bytes[kSmallPool].increase(bytes);
    stats_.reserved_bytes[kLargePool].decrease(bytes);
    stats_.segment[kSmallPool].increase(1);
    stats_.segment[kAllPools].increase(1);
  } else {
    stats_.reserved_bytes[kSmallPool].decrease(-bytes);
    stats_.reserved_bytes[kLargePool].increase(-bytes);
    stats_.segment[kSmallPool].decrease(1);
    stats_.segment[kAllPools].decrease(1);
  }
}

void Engine::Impl::free(void* p) {
  const auto ptr = reinterpret_cast<DevicePtr>(p);
  const std::uint32_t context = gather_context(true);
  std::lock_guard lock(mutex_);
  Record record;
  if (!live_.take(ptr, record)) throw_bad_free("free", ptr);
  if (record.shared) {
    try {
      free_shared(ptr, record);
    } catch (...) {
      live_.insert(ptr, record);  // the driver failed: the block stays live, the free can be retried
      throw;
    }
  }
  if (observer_) observer_->on_free(ptr, record.size, record.stream, record.tag, context);
  const auto r = static_cast<std::int64_t>(record.size);
  const auto q = static_cast<std::int64_t>(record.requested);
  const int pool = record.small ? kSmallPool : kLargePool;
  for (int i : {static_cast<int>(kAllPools), pool}) {
    stats_.allocated_bytes[i].decrease(r);
    stats_.requested_bytes[i].decrease(q);
    stats_.allocation[i].decrease(1);
  }
  recently_freed_[freed_count_++ % recently_freed_.size()] = ptr;
  if (!record.shared) release_record(ptr, record);
}

void Engine::Impl::free_shared(DevicePtr ptr, const Record& record) {
  // Used on other streams too: reuse only once they have caught up with this free.
  auto it = shared_streams_.find(ptr);
  detail::PendingFree pending{ptr, record, {}};
  try {
    for (StreamId s : it->second) {
      pending.events.push_back(device_.create_event());
      device_.record_event(pending.events.back(), s);
    }
  } catch (...) {
    for (EventHandle e : pending.events) {
      try { device_.destroy_event(e); } catch (...) {}
    }
    throw;
  }
  shared_streams_.erase(it);
  pending_.push_back(std::move(pending));
}

void Engine::Impl::release_record(DevicePtr ptr, const Record& record) {
  const int pool = record.small ? kSmallPool : kLargePool;
  for (int i : {static_cast<int>(kAllPools), pool}) {
    stats_.active_bytes[i].decrease(static_cast<std::int64_t>(record.size));
    stats_.active[i].decrease(1);
  }
  if (!record.in_slab) {
    range_bytes_ -= record.size;
    if (record.small) {
      small_range_bytes_ -= record.size;
      move_reserved_to_small(-static_cast<std::int64_t>(record.size));
    }
    release_range(record.arena, record.id);
    return;
  }
  if (!slabs_.free(record.id, ptr)) return;
  const detail::Slab& slab = slabs_.slab(record.id);
  const auto bytes = static_cast<std::int64_t>(slab.bytes());
  release_range(slab.arena, slab.node);
  slabs_.remove(record.id);
  move_reserved_to_small(-bytes);
}

void Engine::Impl::process_pending(bool wait) {
  for (std::size_t i = 0; i < pending_.size();) {
    detail::PendingFree& p = pending_[i];
    bool done = true;
    for (EventHandle e : p.events) {
      if (wait) device_.synchronize_event(e);
      else if (!device_.query_event(e)) done = false;
    }
    if (!done) {
      ++i;
      continue;
    }
    // Each event leaves the list once destroyed: should a destroy fail, the list keeps only live
    // events, and the next call polls and destroys those (a destroyed one would fail forever).
    while (!p.events.empty()) {
      device_.destroy_event(p.events.back());
      p.events.pop_back();
    }
    release_record(p.ptr, p.record);
    pending_[i] = std::move(pending_.back());
    pending_.pop_back();
  }
}

void Engine::Impl::throw_bad_free(const char* call, DevicePtr ptr) const {
  // A pointer freed lately is a double free; any other address is not a block's start: inside
  // gmem's ranges an interior pointer (or one past the end), outside them a foreign one.
  for (const DevicePtr freed : recently_freed_)
    if (freed == ptr && ptr != 0)
      throw Error(Errc::double_free, std::string(call) + "(" + hex(ptr) +
                                         "): this block was already freed (double free)");
  for (const auto& arena : arenas_) {
    const DevicePtr base = arena->ranges.base();
    if (ptr >= base && ptr <= base + arena->ranges.size())
      throw Error(Errc::invalid_pointer,
                  std::string(call) + "(" + hex(ptr) +
                      "): not the start of a live block (an interior pointer, one past the end, "
                      "or a block freed long ago)");
  }
  throw Error(Errc::invalid_pointer,
              std::string(call) + "(" + hex(ptr) + "): not a pointer gmem allocated (foreign pointer)");
}

std::size_t Engine::Impl::checked_limit(std::size_t bytes, const char* what) const {
  if (bytes == 0) return device_total_;
  if (bytes > device_total_)
    throw Error(Errc::invalid_argument, std::string(what) + " = " + format_bytes(bytes) +
                                            ": more than the device's " + format_bytes(device_total_) +
                                            " (0 means the whole device)");
  if (bytes < granularity_)
    throw Error(Errc::invalid_argument, std::string(what) + " = " + std::to_string(bytes) +
                                            " bytes: less than one " + format_bytes(granularity_) +
                                            " page, a limit that would allow nothing");
  return bytes;
}

void Engine::Impl::record_stream(void* p, StreamId stream) {
  const auto ptr = reinterpret_cast<DevicePtr>(p);
  std::lock_guard lock(mutex_);
  Record* record = live_.find(ptr);
  if (record == nullptr) throw_bad_free("record_stream", ptr);
  if (stream == record->stream) return;
  std::vector<StreamId>& streams = shared_streams_[ptr];
  for (StreamId s : streams)
    if (s == stream) return;
  streams.push_back(stream);
  record->shared = true;
}

void Engine::Impl::reset_peak_stats() {
  std::lock_guard lock(mutex_);
  for (PoolStats* s : {&stats_.allocated_bytes, &stats_.requested_bytes, &stats_.active_bytes,
                       &stats_.reserved_bytes, &stats_.inactive_split_bytes, &stats_.allocation,
                       &stats_.active, &stats_.segment, &stats_.inactive_split})
    for (Stat& stat : *s) stat.reset_peak();
}

void Engine::Impl::reset_accumulated_stats() {
  std::lock_guard lock(mutex_);
  for (PoolStats* s : {&stats_.allocated_bytes, &stats_.requested_bytes, &stats_.active_bytes,
                       &stats_.reserved_bytes, &stats_.inactive_split_bytes, &stats_.allocation,
                       &stats_.active, &stats_.segment, &stats_.inactive_split})
    for (Stat& stat : *s) stat.reset_accumulated();
  stats_.num_alloc_retries = stats_.num_ooms = stats_.num_device_alloc = 0;
  stats_.num_device_free = stats_.num_sync_all_streams = 0;
  stats_.num_maps = stats_.num_unmaps = stats_.num_stitches = 0;
}

// --- the public face ---------------------------------------------------------------------------

Engine::Engine(Device& device, EngineOptions options)
    : impl_(std::make_unique<Impl>(device, options)) {}
Engine::~Engine() = default;
void* Engine::malloc(std::size_t size, StreamId stream) { return impl_->malloc(size, stream); }
void Engine::free(void* ptr) { impl_->free(ptr); }
void Engine::record_stream(void* ptr, StreamId stream) { impl_->record_stream(ptr, stream); }
void Engine::empty_cache() { impl_->empty_cache(); }
void Engine::set_memory_limit(std::size_t bytes) { impl_->set_memory_limit(bytes); }
void Engine::set_memory_fraction(double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0))
    throw Error(Errc::invalid_argument,
                "set_memory_fraction(" + std::to_string(fraction) + "): must be in (0, 1]");
  const auto bytes = static_cast<std::size_t>(fraction * static_cast<double>(impl_->device_total_));
  const std::size_t pages = bytes / impl_->granularity_;
  if (pages == 0)
    throw Error(Errc::invalid_argument,
                "set_memory_fraction(" + std::to_string(fraction) + "): " + format_bytes(bytes) +
                    " of the device, less than one " + format_bytes(impl_->granularity_) +
                    " page: a limit that would allow nothing");
  impl_->set_memory_limit(pages * impl_->granularity_);
}
std::size_t Engine::memory_limit() const {
  std::lock_guard lock(impl_->mutex_);
  return impl_->limit_;
}
void Engine::reset_peak_stats() { impl_->reset_peak_stats(); }
void Engine::reset_accumulated_stats() { impl_->reset_accumulated_stats(); }
MemoryStats Engine::stats() const { return impl_->stats(false); }
MemoryStats Engine::detailed_stats() const { return impl_->stats(true); }
void Engine::check_invariants() const { impl_->check_invariants(); }
Device& Engine::device() const { return impl_->device_; }

BlockInfo Engine::block_info(const void* ptr) const {
  std::lock_guard lock(impl_->mutex_);
  const detail::Record* r = impl_->live_.find(reinterpret_cast<DevicePtr>(ptr));
  if (r == nullptr)
    throw Error(Errc::invalid_pointer,
                "block_info(" + hex(reinterpret_cast<DevicePtr>(ptr)) + "): not a live allocation");
  return BlockInfo{const_cast<void*>(ptr), r->size, r->requested, r->stream, r->small};
}

void Engine::for_each_block(const std::function<void(const BlockInfo&)>& visit) const {
  std::lock_guard lock(impl_->mutex_);
  impl_->live_.for_each([&](std::uintptr_t key, const detail::Record& r) {
    visit(BlockInfo{reinterpret_cast<void*>(key), r.size, r.requested, r.stream, r.small});
  });
}

}  // namespace gmem
