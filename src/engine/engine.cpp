// The engine's fast paths and its public face. A malloc: the stream's index (the last one is
// cached), a slab pop or a range from Backing (a best fit whose pages are all mapped and free),
// a record. A free: the record, the slot or the range back. Everything slower (mapping,
// stitching, waiting for streams, reclaiming) is out of line, below Backing.
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
    : device_(device), options_(options), streams_(device),
      backing_(device, streams_, accounting_, observer_, *this, lock_,
               {.page_size = options.page_size, .alignment = kAlignment,
                .stable_pages = options.stable_pages,
                .handovers = options.stream_handovers, .map_ahead = options.map_ahead}),
      cross_stream_(device), empty_cache_rule_(options.strict_empty_cache) {
  detail::ChunkSource& chunks = backing_.chunk_source();
  chunks.set_limit(chunks.checked_limit(options.memory_limit, "EngineOptions::memory_limit"));
  backing_.set_arena_size(options.address_space);
  accounting_.stats.granularity = static_cast<std::int64_t>(backing_.granularity());
  accounting_.stats.memory_limit = static_cast<std::int64_t>(chunks.limit());
}

void Engine::Impl::attach(detail::EngineObserver* observer) {
  observer_ = observer;
  capture_.set(observer ? observer->context_capture() : detail::ContextCapture{});
}

namespace {
void check_request(const char* call, std::size_t size) {
  if (size == 0)
    throw Error(Errc::invalid_argument, std::string(call) + "(0): size must be at least 1 byte");
  if (size > kMaxRequest)
    throw Error(Errc::invalid_argument, std::string(call) + "(" + std::to_string(size) +
                                            "): larger than any device (a negative size cast?)");
}
}  // namespace

void* Engine::Impl::malloc(std::size_t size, StreamId stream) {
  check_request("malloc", size);
  const std::uint32_t context = capture_.gather(false);
  std::lock_guard lock(mutex_);
  if (!cross_stream_.empty()) [[unlikely]] process_pending(false);
  if (watch_for_capture_) [[unlikely]] capture_begins_if(stream);
  const std::uint32_t si = streams_.index(stream);
  const std::size_t rounded = round_up(size, kAlignment);
  Record record{.size = rounded, .requested = size, .stream = stream};
  // A stable engine (a graph's pool) keeps no slabs: malloc_at must be able to put any block
  // back, and a slab's slot cannot be once its slab is gone.
  const DevicePtr ptr = rounded <= detail::kSlabLimit && !backing_.stable()
                            ? malloc_slab(size, rounded, si, record)
                            : malloc_range(size, rounded, si, record);
  return hand_out(ptr, record, context);
}

void* Engine::Impl::hand_out(DevicePtr ptr, detail::Record& record, std::uint32_t context) {
  if (observer_) observer_->on_malloc(ptr, record.size, record.stream, context, record.tag);
  live_.insert(ptr, record);
  accounting_.count_malloc(record);
  return reinterpret_cast<void*>(ptr);
}

void* Engine::Impl::malloc_at(void* p, std::size_t size) {
  check_request("malloc_at", size);
  const auto ptr = reinterpret_cast<DevicePtr>(p);
  if (!backing_.stable())
    throw Error(Errc::invalid_argument,
                "malloc_at: only an engine with stable pages (a CUDA graph's pool) places blocks "
                "at given addresses");
  if (ptr % kAlignment != 0)
    throw Error(Errc::invalid_argument, "malloc_at(" + hex(ptr) + "): not a block's address (" +
                                            std::to_string(kAlignment) + "-byte aligned)");
  const std::uint32_t context = capture_.gather(false);
  std::lock_guard lock(mutex_);
  if (!cross_stream_.empty()) process_pending(false);
  const std::size_t rounded = round_up(size, kAlignment);
  const detail::Backing::Taken range = backing_.take_at(ptr, rounded, size);
  if (range.node == detail::kNoNode)
    throw Error(Errc::invalid_argument, "malloc_at(" + hex(ptr) + ", " + std::to_string(size) +
                                            "): that range is not free in this engine's memory");
  const StreamId stream = streams_.progress.stream(backing_.arenas()[range.arena].stream);
  Record record{.size = rounded, .requested = size, .stream = stream};
  return hand_out(note_range(range, record), record, context);
}

DevicePtr Engine::Impl::malloc_slab(std::size_t size, std::size_t rounded, std::uint32_t si,
                                    Record& record) {
  backing_.count_slot_malloc(si);
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
    const detail::Backing::Taken range = backing_.take_range(si, bytes, size);
    arena = range.arena;
    slabs_.add(arena, cls, range.addr, range.node);
    accounting_.move_reserved_to_small(static_cast<std::int64_t>(bytes));
    ptr = slabs_.allocate(arena, cls, slab);
  }
  record.arena = arena;
  record.id = slab;
  record.small = record.in_slab = true;
  return ptr;
}

DevicePtr Engine::Impl::malloc_range(std::size_t size, std::size_t rounded, std::uint32_t si,
                                     Record& record) {
  return note_range(backing_.take_range(si, rounded, size, true), record);
}

DevicePtr Engine::Impl::note_range(const detail::Backing::Taken& range, Record& record) {
  record.arena = range.arena;
  record.id = range.node;
  record.keep_place = range.kept;
  record.birth = ++range_births_;
  record.small = record.size <= kSmallLimit;
  accounting_.count_range_taken(record.size, record.small);
  return range.addr;
}

void Engine::Impl::free(void* p) {
  const auto ptr = reinterpret_cast<DevicePtr>(p);
  const std::uint32_t context = capture_.gather(true);
  std::lock_guard lock(mutex_);
  Record record;
  if (!live_.take(ptr, record)) throw_bad_free("free", ptr);
  // A range's free is stamped now, on its stream, even when other streams hold it back (with an
  // event then): its own stream's work up to here is all that must be done with it there.
  // Stamped when released, a side stream's block (a prefetched batch, streamed weights) waited
  // for the work that stream queued meanwhile too, before another stream or an unmap could have
  // its pages.
  const std::uint64_t freed_at = free_stamp(record, record.shared);
  if (record.shared) {
    try {
      cross_stream_.defer(ptr, record, freed_at);  // reused once its other streams have caught up
    } catch (...) {
      live_.insert(ptr, record);  // the driver failed: the block stays live, the free can be retried
      throw;
    }
  }
  if (observer_) observer_->on_free(ptr, record.size, record.stream, record.tag, context);
  accounting_.count_free(record);
  recent_frees_.note(ptr);
  if (!record.shared) release_record(ptr, record, freed_at);
}

void Engine::Impl::release_record(DevicePtr ptr, const Record& record, std::uint64_t freed_at) {
  accounting_.count_release(record);
  if (!record.in_slab) {
    if (record.keep_place) [[unlikely]]
      backing_.keep_range(record.arena, record.id, record.birth, freed_at);
    else backing_.release_range(record.arena, record.id, freed_at);
    return;
  }
  if (!slabs_.free(record.id, ptr)) [[likely]] return;
  if (slabs_.emptied(record.id, spare_budget())) release_slab(record.id);
  std::vector<detail::SlabId>& evicted = slabs_.evicted();
  for (detail::SlabId id : evicted) release_slab(id);
  evicted.clear();
}

void Engine::Impl::release_slab(detail::SlabId id) {
  const detail::Slab& slab = slabs_.slab(id);
  const auto bytes = static_cast<std::int64_t>(slab.bytes());
  backing_.release_range(slab.arena, slab.node, backing_.free_stamp(slab.arena));
  slabs_.remove(id);
  accounting_.move_reserved_to_small(-bytes);
}

void Engine::Impl::process_pending(bool wait) {
  cross_stream_.process(wait, [this](DevicePtr ptr, const Record& record, std::uint64_t freed_at) {
    release_record(ptr, record, freed_at);
  });
}

// --- the slow paths that Backing asks for, and the rest of the API -------------------------------

void Engine::Impl::release_spare_slabs() {
  for (detail::SlabId id : slabs_.take_spares()) release_slab(id);
}

std::size_t Engine::Impl::hand_over_held(StreamId stream) {
  // Stamped after the waits: another stream that takes this memory later is ordered after
  // them through this stream (StreamTracker::ordered).
  auto release = [this](DevicePtr ptr, const Record& record, std::uint64_t /*freed_at*/) {
    release_record(ptr, record, free_stamp(record, false));
  };
  const std::size_t released = cross_stream_.hand_over(stream, release);
  accounting_.stats.num_stream_handovers += static_cast<std::int64_t>(released);
  return released;
}

void Engine::Impl::reclaim() {
  release_spare_slabs();
  if (!cross_stream_.empty()) process_pending(true);
}

void Engine::Impl::empty_cache() {
  std::lock_guard lock(mutex_);
  if (!cross_stream_.empty()) process_pending(true);
  const double began = device_.host_time();
  const auto created = static_cast<std::uint64_t>(accounting_.stats.num_device_alloc);
  const std::size_t held = backing_.pages().chunks().held();
  // With no block live the program is done with what it held (or between passes): all goes.
  const bool keeps = empty_cache_rule_.keeps(began, created) && live_.size() > 0;
  const std::size_t keep = empty_cache_rule_.keep_bytes(backing_.interval_need_bytes());
  if (keeps) {  // what the recent steps needed stays, with the slabs kept
    backing_.chunk_source().trim_to(keep, true);
  } else {
    release_spare_slabs();
    backing_.chunk_source().trim_to(0, true);
  }
  const std::size_t now_held = backing_.pages().chunks().held();
  empty_cache_rule_.called(began, created, held > now_held ? held - now_held : 0);
  backing_.begin_interval();
  ++accounting_.stats.num_empty_cache;
  accounting_.stats.empty_cache_kept_bytes =
      keeps ? static_cast<std::int64_t>((now_held - std::min(now_held, backing_.pages().used_pages())) *
                                        backing_.granularity())
            : 0;
}

void Engine::Impl::set_memory_limit(std::size_t bytes) {
  const std::size_t limit = backing_.chunk_source().checked_limit(bytes, "memory limit");
  std::lock_guard lock(mutex_);
  backing_.chunk_source().set_limit(limit);
  accounting_.stats.memory_limit = static_cast<std::int64_t>(limit);
  if (backing_.pages().chunks().held() * backing_.granularity() > limit) {
    release_spare_slabs();
    backing_.chunk_source().trim_to(limit, true);
  }
}

void Engine::Impl::throw_bad_free(const char* call, DevicePtr ptr) const {
  // A pointer freed lately is a double free; any other address is not a block's start: inside
  // gmem's ranges an interior pointer (or one past the end), outside them a foreign one.
  if (recent_frees_.contains(ptr))
    throw Error(Errc::double_free, std::string(call) + "(" + hex(ptr) +
                                       "): this block was already freed (double free)");
  if (backing_.arenas().contains(ptr))
    throw Error(Errc::invalid_pointer,
                std::string(call) + "(" + hex(ptr) +
                    "): not the start of a live block (an interior pointer, one past the end, "
                    "or a block freed long ago)");
  throw Error(Errc::invalid_pointer,
              std::string(call) + "(" + hex(ptr) + "): not a pointer gmem allocated (foreign pointer)");
}

void Engine::Impl::record_stream(void* p, StreamId stream) {
  const auto ptr = reinterpret_cast<DevicePtr>(p);
  std::lock_guard lock(mutex_);
  Record* record = live_.find(ptr);
  if (record == nullptr) throw_bad_free("record_stream", ptr);
  if (stream == record->stream) return;
  if (!cross_stream_.add_user(ptr, stream)) return;
  record->shared = true;
}

void Engine::Impl::mark_step() {
  std::lock_guard lock(mutex_);
  backing_.mark_step();
}

void Engine::Impl::set_capturing(bool capturing) {
  std::lock_guard lock(mutex_);
  cross_stream_.hold_events(capturing);
  streams_.progress.set_capturing(capturing);
  if (capturing && !backing_.stable()) {
    // The graph may read any block live now: each keeps its place for its size once freed, so
    // that the program's next buffer of that size is where the graph expects it (kept_places.hpp).
    // Small blocks keep none: a class's slots serve every size in it, so a kept slot would go to
    // whichever small block of its size came first; their slabs hand out the lowest free slot,
    // and a program that makes the same small blocks in the same order gets the same slots.
    live_.for_each_mutable([](std::uintptr_t, Record& r) { r.keep_place = !r.in_slab; });
  }
  if (backing_.stable()) {
    if (capturing) {
      // Before the capture begins (PyTorch calls beginAllocateToPool first), events may still
      // be polled: what the pool's streams have done by now is known when the capture needs it.
      // (catch_up leaves a stream already captured alone.)
      for (std::uint32_t s = 0; s < streams_.progress.size(); ++s) streams_.progress.catch_up(s, false);
      // A graph captured from now on may use any block live now, whether or not it allocates.
      backing_.pin_used_pages();
    }
    backing_.set_pinning(false);
    watch_for_capture_ = capturing;
  }
}

void Engine::Impl::capture_begins_if(StreamId stream) {
  if (!device_.stream_capturing(stream)) return;
  // This pool's first malloc in a capture: the pages no capture pinned give their chunks back
  // as spares, for the capture's new pages; from now on every range taken is pinned.
  backing_.pin_used_pages();
  backing_.release_unpinned_pages();
  backing_.set_pinning(true);
  watch_for_capture_ = false;
}

void Engine::Impl::reset_peak_stats() {
  std::lock_guard lock(mutex_);
  accounting_.reset_peaks();
}

void Engine::Impl::reset_accumulated_stats() {
  std::lock_guard lock(mutex_);
  accounting_.reset_accumulated();
}

// --- the public face ---------------------------------------------------------------------------

Engine::Engine(Device& device, EngineOptions options)
    : impl_(std::make_unique<Impl>(device, options)) {}
Engine::~Engine() {
  std::lock_guard lock(impl_->mutex_);
  impl_->accounting_.join(nullptr);  // what it still holds (its chunks) leaves its group
}
void* Engine::malloc(std::size_t size, StreamId stream) { return impl_->malloc(size, stream); }
void* Engine::malloc_at(void* ptr, std::size_t size) { return impl_->malloc_at(ptr, size); }
void Engine::free(void* ptr) { impl_->free(ptr); }
void Engine::record_stream(void* ptr, StreamId stream) { impl_->record_stream(ptr, stream); }
void Engine::empty_cache() { impl_->empty_cache(); }
void Engine::mark_step() { impl_->mark_step(); }
void Engine::set_capturing(bool capturing) { impl_->set_capturing(capturing); }
void Engine::set_memory_limit(std::size_t bytes) { impl_->set_memory_limit(bytes); }
void Engine::set_memory_fraction(double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0))
    throw Error(Errc::invalid_argument,
                "set_memory_fraction(" + std::to_string(fraction) + "): must be in (0, 1]");
  const auto bytes = static_cast<std::size_t>(fraction * static_cast<double>(impl_->backing_.chunk_source().device_total()));
  const std::size_t pages = bytes / impl_->backing_.granularity();
  if (pages == 0)
    throw Error(Errc::invalid_argument,
                "set_memory_fraction(" + std::to_string(fraction) + "): " + format_bytes(bytes) +
                    " of the device, less than one " + format_bytes(impl_->backing_.granularity()) +
                    " page: a limit that would allow nothing");
  impl_->set_memory_limit(pages * impl_->backing_.granularity());
}
std::size_t Engine::memory_limit() const {
  std::lock_guard lock(impl_->mutex_);
  return impl_->backing_.chunk_source().limit();
}
EngineOptions Engine::options() const {
  EngineOptions options = impl_->options_;
  options.memory_limit = memory_limit();
  return options;
}
void Engine::reset_peak_stats() { impl_->reset_peak_stats(); }
void Engine::reset_accumulated_stats() { impl_->reset_accumulated_stats(); }
void Engine::join_stats_group(std::shared_ptr<StatsGroup> group) {
  std::lock_guard lock(impl_->mutex_);
  impl_->accounting_.join(std::move(group));
}
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
