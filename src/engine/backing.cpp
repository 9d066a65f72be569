// Physical memory behind virtual ranges: placing a range, mapping its pages, stitching (mapping
// a free chunk where it is needed, as an alias: it stays mapped where it was), and reclaiming
// under pressure. Every path that fails puts back what it took, so invariants hold after an error.
//
// Why aliases: a training step that repeats asks for the same blocks in the same order, so the
// engine places them at the same addresses every step. If stitching unmapped a chunk to move it,
// the page it left would be missing the next time its address came round, and every step would
// stitch again (~60 us a page on a GPU). With aliases, the first steps map every page the layout
// touches, each page keeps its chunk, and later steps make no device calls. Physical memory is
// what counts: a chunk is created only when no free chunk can be mapped instead, so reserved
// memory tracks the pages that live blocks touch.
#include "engine/backing.hpp"

#include <algorithm>
#include <bit>
#include <type_traits>

namespace gmem::detail {

namespace {
// How far acquire_chunk had to go; the malloc's stats say so.
enum Stage : int { kFromCache = 0, kStitched = 1, kRetried = 2 };
// Blocks at least this large are placed at the top of their free range, the rest at the bottom:
// the two kinds then keep to their own ends of the address space, and a big block's range stays
// whole for its next use.
constexpr std::size_t kTopDownBytes = std::size_t{16} << 20;
std::size_t offset_in(const RangeNode& fit, std::size_t bytes) {
  return bytes >= kTopDownBytes ? fit.size - bytes : 0;
}
std::size_t round_up(std::size_t value, std::size_t to) { return (value + to - 1) / to * to; }
}  // namespace

Backing::Backing(Device& device, Streams& streams, Accounting& accounting,
                 EngineObserver* const& observer, BackingClient& client, std::size_t page_size,
                 bool stable_pages, bool handovers, bool map_ahead)
    : device_(device), streams_(streams), accounting_(accounting), observer_(observer),
      client_(client), granularity_(device.granularity()), stable_pages_(stable_pages),
      handovers_(handovers),
      clash_rule_(device.host_time()) {
  ahead_.enabled = map_ahead && !stable_pages;
  if (!std::has_single_bit(granularity_) || granularity_ < kAlignment)
    throw Error(Errc::invalid_argument, "device granularity must be a power of two >= 512, got " +
                                            std::to_string(granularity_));
  if (page_size != 0) {
    if (!std::has_single_bit(page_size) || page_size < granularity_ || page_size > kMaxPageSize)
      throw Error(Errc::invalid_argument,
                  "page size " + std::to_string(page_size) + " bytes: must be a power of two from "
                  "the device's granularity (" + format_bytes(granularity_) + ") to " +
                  format_bytes(kMaxPageSize));
    granularity_ = page_size;  // every chunk is one page: created, mapped and unmapped whole
  }
  page_shift_ = std::countr_zero(granularity_);
  device_total_ = device.mem_info().total;
}

Backing::~Backing() {
  if (ahead_.thread.joinable()) std::terminate();  // the engine stops it first (stop_map_ahead)
  // Give everything back, live blocks included: the engine owns the memory it handed out.
  for (const auto& arena : arenas_) {
    const DevicePtr base = arena->ranges.base();
    arena->pages.for_each_touched([&](std::size_t i, const Page& page) {
      if (!page.mapped()) return;
      try {
        device_.unmap(base + (i << page_shift_), granularity_);
      } catch (...) {  // nothing to report to from a destructor
      }
    });
    try { device_.release_address(base, arena->ranges.size()); } catch (...) {}
  }
  for (ChunkId id = 0; id < chunks_.slots(); ++id) {
    if (const ChunkHandle handle = chunks_.at(id).handle) {
      try { device_.release_chunk(handle); } catch (...) {}
    }
  }
}

std::size_t Backing::checked_limit(std::size_t bytes, const char* what) const {
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

void Backing::set_arena_size(std::size_t address_space) {
  // One device's worth of virtual space per arena: a stream rarely needs a second one, and a
  // thousand streams stay within the GPU's address space (2^47 bytes and more).
  arena_size_ = round_up(address_space ? address_space : device_total_, granularity_);
}

bool Backing::in_arenas(DevicePtr ptr) const {
  for (const auto& arena : arenas_) {
    const DevicePtr base = arena->ranges.base();
    if (ptr >= base && ptr <= base + arena->ranges.size()) return true;
  }
  return false;
}

std::uint32_t Backing::add_arena(std::uint32_t si, std::size_t min_bytes, bool listed,
                                 bool for_malloc) {
  const std::size_t size =
      std::max(arena_size_, (min_bytes + granularity_ - 1) / granularity_ * granularity_);
  DevicePtr base = 0;
  try {
    base = device_.reserve_address(size, granularity_);
  } catch (const DeviceError& e) {
    if (!e.device_out_of_memory() || !for_malloc) throw;
    oom_reason_ = "address space";
    throw_oom(min_bytes, streams_.progress.stream(si));
  }
  try {
    arenas_.reserve(arenas_.size() + 1);
    if (listed) streams_.arenas(si).reserve(streams_.arenas(si).size() + 1);
    auto arena = std::make_unique<Arena>(base, size, size >> page_shift_, si);
    client_.arena_added();  // the slabs' classes for it
    arenas_.push_back(std::move(arena));
  } catch (...) {
    try { device_.release_address(base, size); } catch (...) {}
    throw;
  }
  const auto index = static_cast<std::uint32_t>(arenas_.size() - 1);
  if (listed) streams_.arenas(si).push_back(index);
  return index;
}

std::pair<std::size_t, std::size_t> Backing::page_span(std::uint32_t arena, DevicePtr addr,
                                                       std::size_t bytes) const {
  const DevicePtr base = arenas_[arena]->ranges.base();
  return {(addr - base) >> page_shift_, (addr + bytes - 1 - base) >> page_shift_};
}

// --- placement ----------------------------------------------------------------------------------

PageId Backing::blocking_alias(std::uint32_t arena, std::size_t index, const Page& page) const {
  if (!page.aliased) return kNoPage;  // its chunk was last used here, by this arena's stream
  const std::uint32_t stream = arenas_[arena]->stream;
  const PageId self = page_id(arena, static_cast<std::uint32_t>(index));
  const Chunk& chunk = chunks_.at(page.chunk);
  for (std::uint32_t k = 0; k < chunk.maps; ++k) {
    const PageId other = chunk.pages[k];
    if (other == self) continue;
    const Arena& a = *arenas_[arena_of(other)];
    const Page& p = a.pages.get(index_of(other));
    if (p.refs > 0) return other;  // busy through another alias
    if (!streams_.progress.ordered(stream, a.stream, p.free_seq)) return other;
  }
  return kNoPage;
}

bool Backing::page_ready_polled(std::uint32_t arena, std::size_t index, const Page& page) {
  // Each poll that finds its alias's stream done, or handover made, lets the walk go past it, to
  // the next alias that blocks (or none). A handover costs an event record and a stream wait
  // (a few microseconds, no memory) where the remap it saves costs an unmap, a map and a
  // set-access, and a chunk.
  const std::uint32_t stream = arenas_[arena]->stream;
  for (PageId other; (other = blocking_alias(arena, index, page)) != kNoPage;) {
    const Arena& a = *arenas_[arena_of(other)];
    const Page& p = a.pages.get(index_of(other));
    if (p.refs > 0) return false;  // busy: no poll makes it ready
    if (streams_.progress.catch_up(a.stream, false) && streams_.progress.done(a.stream, p.free_seq))
      continue;
    if (!hand_over(stream, a.stream, p.free_seq)) return false;
  }
  return true;
}

Backing::Placement Backing::place(std::uint32_t si, std::size_t bytes) {
  // The best fit, at its end for the block's kind. The choice depends on the free ranges alone,
  // not on what is mapped where: a step that repeats its requests then repeats its layout, and
  // finds its pages mapped. (Preferring ranges that happen to be mapped moves the layout, and
  // with it the pages to map, every step.)
  for (std::uint32_t a : streams_.arenas(si)) {
    if (const NodeId node = arenas_[a]->ranges.find(bytes); node != kNoNode)
      return {a, node, offset_in(arenas_[a]->ranges.node(node), bytes)};
  }
  if (!kept_.empty()) {  // the stream's arenas are full: kept places are worth less than a new one
    expire_kept(true);
    return place(si, bytes);
  }
  const std::uint32_t a = add_arena(si, bytes);
  const NodeId node = arenas_[a]->ranges.find(bytes);
  return {a, node, offset_in(arenas_[a]->ranges.node(node), bytes)};
}

[[gnu::noinline]] Backing::Taken Backing::take_kept(std::uint32_t si, std::size_t bytes,
                                                    std::size_t requested) {
  expire_kept();
  const std::optional<KeptPlaces::Place> kept =
      kept_.take(bytes, [&](std::uint32_t arena) { return arenas_[arena]->stream == si; });
  if (!kept) return take_placed(place(si, bytes), bytes, requested);
  bool backed = false;
  try {
    backed = back_pages(kept->arena, kept->addr, bytes);
  } catch (...) {
    release_kept(*kept);
    throw;
  }
  if (backed) return {kept->arena, kept->node, kept->addr, true};
  release_kept(*kept);  // no memory for its pages: online placement may find some (or throws)
  return take_placed(place(si, bytes), bytes, requested);
}

Backing::Taken Backing::take_at(DevicePtr addr, std::size_t bytes, std::size_t requested) {
  // Not a hot path (a pool put back to a checkpoint): a walk over the arena's ranges in order.
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    const RangeAllocator& ranges = arenas_[a]->ranges;
    if (addr < ranges.base() || addr >= ranges.base() + ranges.size()) continue;
    for (NodeId id = ranges.first(); id != kNoNode; id = ranges.node(id).next) {
      const RangeNode& n = ranges.node(id);
      if (n.addr + n.size <= addr) continue;
      if (!n.free || n.addr + n.size < addr + bytes) break;  // [addr, addr + bytes) is in use
      return take_placed({a, id, addr - n.addr}, bytes, requested);
    }
    break;
  }
  return {0, kNoNode, 0};
}

Backing::Taken Backing::take_placed(const Placement& place_at, std::size_t bytes,
                                    std::size_t requested) {
  RangeAllocator& ranges = arenas_[place_at.arena]->ranges;
  const NodeId node = ranges.take(place_at.node, bytes, place_at.offset);
  bool backed = false;
  try {
    backed = back_pages(place_at.arena, ranges.node(node).addr, bytes);
  } catch (...) {
    ranges.release(node);
    throw;
  }
  if (backed && pinning_) [[unlikely]] {
    const auto [first, last] = page_span(place_at.arena, ranges.node(node).addr, bytes);
    for (std::size_t i = first; i <= last; ++i) arenas_[place_at.arena]->pages.at(i).pinned = 1;
  }
  if (!backed) {
    ranges.release(node);
    // Chunks created for this request stay with the device, not idle in gmem's hands.
    try {
      while (chunks_.has_spare()) release_chunk(chunks_.any_spare());
    } catch (const DeviceError&) {  // kept as spare: the OOM is the news here
    }
    throw_oom(requested, streams_.progress.stream(arenas_[place_at.arena]->stream));
  }
  return {place_at.arena, node, ranges.node(node).addr};
}

// A range malloc while steps are marked: at its planned offset in the plan region when the step
// follows a plan and that range is free (it is, if the step's lifetimes repeat), else online.
[[gnu::noinline]] Backing::Taken Backing::take_planned(std::uint32_t si, std::size_t bytes,
                                                       std::size_t requested) {
  if (plan_stream_ == kNoArena) plan_stream_ = si;
  if (si != plan_stream_) return take_online(si, bytes, requested);
  const StepPlanner::Ticket ticket = planner_.request(bytes);
  follow_warm_up();
  // A step that left its plan places the rest online: the pages mapped ahead for the plan's
  // later blocks would hold chunks that the online blocks then need (lstm_varlen's steps, whose
  // packed lengths part from their plans, replayed at 1.83x their peak).
  if (ahead_.held && !planner_.following() && !ahead_.booked.empty()) [[unlikely]] end_map_ahead();
  if (ahead_.waits_for_step) [[unlikely]] client_.landed();  // the step reached further
  if (ahead_.enabled && ticket.ordinal == 0) [[unlikely]]
    if (const std::size_t extent = planner_.extent_to_map_early(); extent > 0) {
      try {
        start_mapping_early(si, extent);
      } catch (...) {  // no address space or host memory for it: the plan's step maps its pages
        end_map_ahead();
      }
    }
  if (const std::size_t offset = ticket.offset; offset != StepPlanner::kOnline) {
    if (plan_arena_ == kNoArena) plan_arena_ = add_arena(si, bytes, false);
    if (ahead_.enabled && ticket.ordinal == 0) [[unlikely]] start_map_ahead();
    RangeAllocator& ranges = arenas_[plan_arena_]->ranges;
    const DevicePtr addr = ranges.base() + offset;
    const NodeId free = offset + bytes <= ranges.size() ? plan_region_.free_node(ranges, addr, bytes) : kNoNode;
    if (free != kNoNode) {
      const NodeId node = ranges.take(free, bytes, addr - ranges.node(free).addr);
      bool backed = false;
      try {
        plan_region_.add(addr, node);
        backed = back_pages(plan_arena_, addr, bytes);
      } catch (...) {
        plan_region_.remove(addr);
        ranges.release(node);
        throw;
      }
      if (backed) {
        planner_.taken(ticket, addr, true);
        return {plan_arena_, node, addr};
      }
      // No memory for the plan's pages: online placement may still find some (or throws).
      plan_region_.remove(addr);
      ranges.release(node);
    }
    planner_.conflict();
  }
  const Taken taken = take_online(si, bytes, requested);
  planner_.taken(ticket, taken.addr, false);
  return taken;
}

void Backing::unref_range(std::uint32_t arena, const RangeNode& n, std::uint64_t freed_at) {
  if (planner_.active()) [[unlikely]] {
    planner_.released(n.addr);
    if (arena == plan_arena_) plan_region_.remove(n.addr);
  }
  unref_pages(arena, n.addr, n.size, freed_at);
}

void Backing::release_range(std::uint32_t arena, NodeId node, std::uint64_t freed_at) {
  RangeAllocator& ranges = arenas_[arena]->ranges;
  unref_range(arena, ranges.node(node), freed_at);
  ranges.release(node);
}

void Backing::keep_range(std::uint32_t arena, NodeId node, std::uint32_t birth,
                         std::uint64_t freed_at) {
  if (arena == plan_arena_ || stable_pages_) return release_range(arena, node, freed_at);
  const RangeNode& n = arenas_[arena]->ranges.node(node);
  unref_range(arena, n, freed_at);
  if (const std::optional<KeptPlaces::Place> older = kept_.keep(n.size, birth, {arena, node, n.addr}, clock_))
    release_kept(*older);
  expire_kept();
}

// --- pages --------------------------------------------------------------------------------------

void Backing::drop_ref(std::uint32_t arena, std::size_t index, Page& p, bool counted) {
  if (--p.refs > 0) return;
  if (counted) --used_pages_;
  if (!p.mapped()) return;  // a failed malloc's rollback, or a map-ahead's
  ++free_pages_;
  freed_pages_.add(page_id(arena, static_cast<std::uint32_t>(index)), p);
}

void Backing::unref_pages(std::uint32_t arena, DevicePtr addr, std::size_t bytes,
                          std::uint64_t stamp) {
  PageTable& pages = arenas_[arena]->pages;
  const auto [first, last] = page_span(arena, addr, bytes);
  auto put = [&](std::size_t i, auto in_runs) {  // in_runs: std::true_type while runs exist
    Page& p = pages.at(i);
    if constexpr (decltype(in_runs)::value) settle(p);
    // The latest of its blocks' frees: a free held back for other streams comes stamped when it
    // was made, maybe before a neighbour's on the same page.
    p.free_seq = std::max(p.free_seq, stamp);
    drop_ref(arena, i, p);
  };
  if (last - first + 1 >= PageRuns::kMinPages) [[unlikely]] {
    const auto [inner_first, inner_last] = interior(arena, addr, bytes, first, last);
    if (const std::uint32_t run = runs_.at(pages, inner_first, inner_last);
        run != PageRuns::kNone && runs_[run].refs == 1) {
      // The run's pages all fall to 0 at once: mapped, and listed as freed already.
      if (inner_first != first) put(first, std::true_type{});
      PageRun& r = runs_[run];
      const std::size_t n = inner_last - inner_first + 1;
      r.refs = 0;
      r.free_seq = stamp;
      used_pages_ -= n;
      free_pages_ += n;
      if (inner_last != last) put(last, std::true_type{});
      return;
    }
  }
  if (!runs_.any()) [[likely]] {
    for (std::size_t i = first; i <= last; ++i) put(i, std::false_type{});
  } else {
    for (std::size_t i = first; i <= last; ++i) put(i, std::true_type{});
  }
}

bool Backing::back_pages(std::uint32_t arena, DevicePtr addr, std::size_t bytes) {
  PageTable& pages = arenas_[arena]->pages;
  const auto [first, last] = page_span(arena, addr, bytes);
  bool ready = true;
  const std::uint32_t now = ++clock_;
  auto take = [&](std::size_t i, auto in_runs) {  // in_runs: std::true_type while runs exist
    Page& p = pages.at(i);
    if constexpr (decltype(in_runs)::value) settle(p);
    if (p.refs++ > 0) {  // shared with a live neighbour: its chunk is busy here already,
      if (p.in_flight) [[unlikely]] {  // or is being mapped by its malloc (or map-ahead) still
        ready = false;
      } else if (p.ahead) [[unlikely]] {  // mapped ahead: the block takes its reference over
        p.ahead = 0;
        --p.refs;
        p.reuse = now - p.last_use;
        p.last_use = now;
        ready &= page_ready(arena, i, p);
      }
      return;
    }
    if (++used_pages_ > interval_peak_used_) note_peak_used();
    p.reuse = now - p.last_use;
    p.last_use = now;
    if (p.mapped()) --free_pages_;
    // Checked in address order with refs already taken, so that one block never gets a chunk
    // twice through two of its pages.
    ready &= p.mapped() && page_ready(arena, i, p);
  };
  if (last - first + 1 >= PageRuns::kMinPages) [[unlikely]] {
    const auto [inner_first, inner_last] = interior(arena, addr, bytes, first, last);
    if (const std::uint32_t run = runs_.at(pages, inner_first, inner_last);
        run != PageRuns::kNone && runs_[run].refs == 0) {
      // Taken the same way before: its interior pages are mapped, unaliased, ready.
      if (inner_first != first) take(first, std::true_type{});
      PageRun& r = runs_[run];
      const std::size_t n = inner_last - inner_first + 1;
      r.refs = 1;
      r.reuse = now - r.last_use;
      r.last_use = now;
      if ((used_pages_ += n) > interval_peak_used_) note_peak_used();
      free_pages_ -= n;
      if (inner_last != last) take(last, std::true_type{});
      if (ready) [[likely]] return true;
      end_run(run);  // the slow path looks at every page
      return map_missing(arena, addr, bytes);
    }
    for (std::size_t i = first; i <= last; ++i) take(i, std::true_type{});
    if (!ready) return map_missing(arena, addr, bytes);
    runs_.make(arena, pages, inner_first, inner_last);
    return true;
  }
  if (!runs_.any()) [[likely]] {
    for (std::size_t i = first; i <= last; ++i) take(i, std::false_type{});
  } else {
    for (std::size_t i = first; i <= last; ++i) take(i, std::true_type{});
  }
  if (ready) [[likely]] return true;  // the steady state: every page mapped, its chunk free
  return map_missing(arena, addr, bytes);
}

std::pair<std::size_t, std::size_t> Backing::interior(std::uint32_t arena, DevicePtr addr,
                                                      std::size_t bytes, std::size_t first,
                                                      std::size_t last) const {
  const DevicePtr base = arenas_[arena]->ranges.base();
  return {addr == base + (first << page_shift_) ? first : first + 1,
          addr + bytes == base + ((last + 1) << page_shift_) ? last : last - 1};
}

// back_pages' slow path, with every page's reference taken: remap the pages whose chunk is busy
// elsewhere, map the missing ones, then set access run by run.
//
// Its device calls (creates, the unmap of a clashing page, a stream wait, the MapJob: up to
// milliseconds) are made with the engine's lock released, so that other threads' mallocs and
// frees from mapped pages go on meanwhile. Every decision is still made under the lock and in
// the same order, so a single thread sees exactly what it saw with the calls made in place. What
// keeps the other threads off this malloc's pages while the lock is released:
//   - its pages hold its references, so their chunks are busy: never stolen, trimmed or unmapped
//     by anyone else (all of that needs refs == 0), and an alias of one is not ready;
//   - only its two boundary pages can be shared (with neighbours in the same page), and it claims
//     them (Page::in_flight) before the lock is first released: a block that takes a claimed page
//     is not ready (back_pages) and waits here, holding no references, until the claim lands.
//     So on a claimed page every other reference is a finished block's: refs > 1 means ready.
// Kept under the lock: the steal's eviction unmap and its waits for other streams (the page and
// chunk are nobody's until the books say so), and reclaiming (it walks the engine's blocks).
//
// One more rule, from the driver: another thread may unmap an alias of a chunk this job maps (it
// took the chunk's old page and found the chunk busy here), and if that unmap lands between the
// job's cuMemMap and cuMemSetAccess of the chunk, an H100 broke the chunk: its next map failed
// with CUDA_ERROR_UNKNOWN. So the job and the clash unmap hold mapping_calls_ (docs/design.md#a-driver-rule); unmaps under the lock never take a chunk a job maps (unmap_page).
[[gnu::noinline]] bool Backing::map_missing(std::uint32_t arena, DevicePtr addr, std::size_t bytes) {
  const auto [first, last] = page_span(arena, addr, bytes);
  SlowMalloc slow(*this);
  PageTable& pages = arenas_[arena]->pages;
  if (in_flight(arena, first, last)) [[unlikely]] return wait_and_take_again(arena, addr, bytes);
  // Claimed until this returns or throws (by then a failed job's maps are undone, and its books
  // rolled back under the lock).
  struct Claim {
    Page &low, &high;
    Claim(Page& l, Page& h) : low(l), high(h) { low.in_flight = high.in_flight = 1; }
    ~Claim() { low.in_flight = high.in_flight = 0; }
  } claim(pages.at(first), pages.at(last));
  MapJob job;
  job.arena = arena;
  job.base = arenas_[arena]->ranges.base();
  int stage = kFromCache;
  if (!plan_maps(arena, addr, bytes, job, stage)) return false;
  if (!job.pages.empty()) {
    client_.without_lock([&] { run_job(job); });
    land(job, addr, bytes);
  }
  if (stage >= kStitched) ++accounting_.stats.num_stitches;
  if (stage >= kRetried) ++accounting_.stats.num_alloc_retries;
  return true;
}

Backing::SlowMalloc::SlowMalloc(Backing& backing) : b(backing) { ++b.slow_mallocs_; }
Backing::SlowMalloc::~SlowMalloc() {
  --b.slow_mallocs_;
  b.client_.landed();  // claims have landed, or a waiter's range is a block: wake the waiters
}

bool Backing::wait_and_take_again(std::uint32_t arena, DevicePtr addr, std::size_t bytes) {
  // Another slow malloc claims a boundary page: wait for it with no reference taken (see
  // map_missing), then take the range's pages again; they may be ready by then.
  unref_pages(arena, addr, bytes, streams_.progress.stamp(arenas_[arena]->stream));
  const auto [first, last] = page_span(arena, addr, bytes);
  const bool ahead = ahead_.job_in_flight;  // waits for map-ahead batches are counted
  const double since = device_.host_time();
  do client_.wait_for_landing();
  while (in_flight(arena, first, last));
  if (ahead) accounting_.stats.map_ahead_wait_us += static_cast<std::int64_t>(device_.host_time() - since);
  return back_pages(arena, addr, bytes);
}

bool Backing::in_flight(std::uint32_t arena, std::size_t first, std::size_t last) const {
  const PageTable& pages = arenas_[arena]->pages;
  if (pages.get(first).in_flight || pages.get(last).in_flight) return true;
  if (ahead_.early_in_flight && pinned_early(arena, first, last)) [[unlikely]] return true;
  // Only a map-ahead batch claims pages inside a range (a malloc claims its two ends).
  if (!ahead_.job_in_flight || arena != plan_arena_) return false;
  for (std::size_t i = first + 1; i < last; ++i)
    if (pages.get(i).in_flight) return true;
  return false;
}

void Backing::unlocked(const std::function<void()>& calls) {
  std::exception_ptr error;
  client_.without_lock([&] {
    try {
      calls();
    } catch (...) {
      error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);
}

bool Backing::plan_maps(std::uint32_t arena, DevicePtr addr, std::size_t bytes, MapJob& job,
                        int& stage) {
  PageTable& pages = arenas_[arena]->pages;
  const auto [first, last] = page_span(arena, addr, bytes);
  const std::uint32_t stream = arenas_[arena]->stream;
  auto rollback = [&] {  // nothing reached the device yet
    forget_maps(job, 0);
    unref_pages(arena, addr, bytes, streams_.progress.stamp(stream));
  };
  if (!could_back(last - first + 1)) [[unlikely]] {
    rollback();
    return false;
  }
  try {
    for (std::size_t i = first; i <= last; ++i) {
      Page& p = pages.at(i);
      const bool conflict = p.mapped();
      if (conflict) {
        // Ready, or made so by asking a stream that freed an alias and was not asked since: an
        // event query costs far less than the remap it may save (a side stream that copies the
        // next batch while the main stream's frees of the last step are done but not polled
        // remapped every step).
        if (p.refs > 1 || page_ready_polled(arena, i, p)) continue;
        // Refs were taken in order, so an alias of this chunk among earlier pages of this block
        // makes it busy, as it should. Its chunk stays mapped elsewhere: only this alias goes.
        double waited_us = 0;
        if (!streams_.progress.done(stream, p.free_seq)) {
          const double waiting_since = device_.host_time();
          if (!streams_.progress.wait_for(stream, p.free_seq, &unlocked_)) {
            // The stream is being captured and may still use the page: it cannot be unmapped,
            // nor the stream asked (StreamTracker::set_capturing).
            oom_reason_ = kCaptureReason;
            rollback();
            return false;
          }
          ++accounting_.stats.num_sync_all_streams;
          waited_us = device_.host_time() - waiting_since;
        }
        unmap_page(page_id(arena, static_cast<std::uint32_t>(i)), /*unlock=*/true);
        if (!planner_.warm_up()) clash_rule_.count_cost(waited_us);
      }
      const std::uint32_t clashes_before = conflict ? p.clashes : 0;
      if (conflict && p.clashes < Page::kMaxClashes) ++p.clashes;
      const ChunkId chunk = acquire_chunk(stream, stage, clashes_before, arena == plan_arena_);
      if (chunk == kNoChunk) {
        rollback();
        return false;
      }
      job.pages.reserve(last - i + 1);
      job.chunks.reserve(last - i + 1);
      job.undone.reserve(last - i + 1);  // the pushes below cannot throw
      job.pages.push_back(static_cast<std::uint32_t>(i));
      job.chunks.push_back(chunks_.at(chunk).handle);
      job.undone.push_back(0);
      note_mapped(arena, i, chunk);
    }
  } catch (...) {
    rollback();
    throw;
  }
  return true;
}

void Backing::run_job(MapJob& job) noexcept {
  std::lock_guard order(mapping_calls_);  // no unmap between a map and its set_access
  try {
    for (; job.mapped < job.pages.size(); ++job.mapped)
      device_.map(page_address(job, job.mapped), granularity_, job.chunks[job.mapped]);
    job.for_each_run(job.pages.size(), [&](std::size_t k, std::size_t count) {
      device_.set_access(page_address(job, k), count << page_shift_);
      job.accessible = k + count;
    });
  } catch (...) {
    job.error = std::current_exception();
    // Undone before mapping_calls_ is let go: a map left without its access while another
    // thread unmaps an alias of its chunk is what breaks the chunk.
    for (std::size_t k = job.mapped; k-- > 0;) {
      try {
        device_.unmap(page_address(job, k), granularity_);
        job.undone[k] = 1;
      } catch (...) {  // stays mapped: a page like any other, its chunk free once unref'd
        if (k >= job.accessible) {
          try {  // ... so it needs its access (a block may be placed on it)
            device_.set_access(page_address(job, k), granularity_);
          } catch (...) {  // both failed: the device is failing; the books say mapped
          }
        }
      }
    }
  }
}

void Backing::land(MapJob& job, DevicePtr addr, std::size_t bytes) {
  if (land_books(job)) [[likely]] return;
  // The range gives its references back.
  unref_pages(job.arena, addr, bytes, streams_.progress.stamp(arenas_[job.arena]->stream));
  std::rethrow_exception(job.error);
}

bool Backing::land_books(const MapJob& job) {
  if (!job.error) [[likely]] {
    if (observer_)
      job.for_each_run(job.pages.size(), [&](std::size_t k, std::size_t count) {
        observer_->on_map(page_address(job, k), count << page_shift_);
      });
    return true;
  }
  // The device failed: what it did not map is taken back from the books, as are the maps
  // run_job undid (device calls made: counted).
  forget_maps(job, job.mapped);
  for (std::size_t k = job.mapped; k-- > 0;) {
    if (job.undone[k]) {
      note_unmapped(page_id(job.arena, job.pages[k]));
      ++accounting_.stats.num_unmaps;
    } else if (observer_) {  // stays mapped: told like any map, as its unmap will be
      observer_->on_map(page_address(job, k), granularity_);
    }
  }
  return false;
}

void Backing::forget_maps(const MapJob& job, std::size_t from) {
  for (std::size_t k = job.pages.size(); k-- > from;) {
    note_unmapped(page_id(job.arena, job.pages[k]));
    --accounting_.stats.num_maps;
  }
}

void Backing::note_mapped(std::uint32_t arena, std::size_t index, ChunkId chunk) {
  const PageId id = page_id(arena, static_cast<std::uint32_t>(index));
  Page& p = arenas_[arena]->pages.at(index);
  p.chunk = chunk;
  chunks_.add_map(chunk, id);
  const Chunk& c = chunks_.at(chunk);
  if (c.maps > 1)
    for (std::uint32_t k = 0; k < c.maps; ++k)
      arenas_[arena_of(c.pages[k])]->pages.at(index_of(c.pages[k])).aliased = 1;
  if (p.refs == 0) {
    ++free_pages_;
    freed_pages_.add(id, p);
  }
  ++accounting_.stats.num_maps;
}

void Backing::unmap_page(PageId id, bool unlock) {
  const DevicePtr va = arenas_[arena_of(id)]->ranges.base() + (DevicePtr{index_of(id)} << page_shift_);
  // Unmaps made under the lock take free pages only (refs == 0 at every alias of the chunk),
  // so no MapJob maps their chunk: a job's chunks are busy through its malloc's references.
  // Only the clash unmap, made without the lock, can meet one (map_missing).
  if (unlock) {
    unlocked([&] {
      std::lock_guard order(mapping_calls_);  // never inside another thread's MapJob
      device_.unmap(va, granularity_);
    });
  } else {
    device_.unmap(va, granularity_);
  }
  note_unmapped(id);
  ++accounting_.stats.num_unmaps;
  if (observer_) observer_->on_unmap(va, granularity_);
}

void Backing::note_unmapped(PageId id) {
  Page& p = page_at(id);
  const ChunkId chunk = p.chunk;
  chunks_.remove_map(chunk, id);
  p.chunk = kNoChunk;
  p.aliased = 0;
  if (p.refs == 0) --free_pages_;
  const Chunk& c = chunks_.at(chunk);
  if (c.maps == 1)
    arenas_[arena_of(c.pages[0])]->pages.at(index_of(c.pages[0])).aliased = 0;
  // The alias that kept the chunk busy may have been this one: list the chunk again, through a
  // page where it stays (its earlier entries may have been dropped while it was busy).
  if (c.maps > 0 && !chunk_busy(chunk)) freed_pages_.add(c.pages[0], page_at(c.pages[0]));
}

// --- captures into a pool ------------------------------------------------------------------------

void Backing::pin_used_pages() {
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    PageTable& pages = arenas_[a]->pages;
    pages.for_each_touched([&](std::size_t i, const Page&) {
      Page& p = pages.at(i);
      settle(p);
      if (p.refs > 0) p.pinned = 1;
    });
  }
}

void Backing::release_unpinned_pages() {
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    const Arena& arena = *arenas_[a];
    arena.pages.for_each_touched([&](std::size_t i, const Page& seen) {
      if (!seen.mapped() || seen.pinned) return;
      Page& p = arenas_[a]->pages.at(i);
      settle(p);
      if (p.refs > 0 || p.in_flight || !streams_.progress.done(arena.stream, p.free_seq)) return;
      unmap_page(page_id(a, static_cast<std::uint32_t>(i)));  // its chunk goes spare
    });
  }
}

// --- chunks -------------------------------------------------------------------------------------

ChunkId Backing::acquire_chunk(std::uint32_t stream, int& stage, std::uint32_t clashes_before,
                               bool planned) {
  if (chunks_.has_spare()) return chunks_.any_spare();
  if (stable_pages_) [[unlikely]] {  // a spare or a new chunk, never one mapped elsewhere
    if (const ChunkId c = create_chunk(); c != kNoChunk) return c;
    stage = kRetried;
    client_.reclaim();
    return chunks_.has_spare() ? chunks_.any_spare() : kNoChunk;
  }
  // A warm-up step (steps marked: a shape's first, the first on a new plan) stitches: its
  // layout is not seen again, and chunks bought to settle it would be held for good.
  if (clashes_before > 0 && !planner_.warm_up() &&
      clash_rule_.allows_new_chunk(chunks_.held(), peak_used_, clashes_before, planned,
                                   device_.host_time()))
    if (const ChunkId c = create_chunk(); c != kNoChunk) return c;
  // A free chunk mapped elsewhere costs the same map and set_access as a new one, and no memory;
  // one another stream may still use costs a stream wait on the GPU besides (hand_over).
  for (const Steal how : {Steal::ready, Steal::handed_over}) {
    if (how == Steal::handed_over && !handovers_) break;  // no scan: hand_over refuses all
    if (const ChunkId c = steal_free_chunk(stream, how); c != kNoChunk) {
      stage = std::max(stage, int{kStitched});
      return c;
    }
  }
  // Blocks this stream freed that other streams still hold (record_stream): this stream made to
  // wait for them on the GPU, their memory is its own again, as the next free of it would be.
  if (handovers_ && client_.hand_over_held(streams_.progress.stream(stream)) > 0) {
    if (const ChunkId c = steal_free_chunk(stream, Steal::ready); c != kNoChunk) {
      stage = std::max(stage, int{kStitched});
      return c;
    }
  }
  if (const ChunkId c = create_chunk(); c != kNoChunk) return c;
  // Pressure: wait for other streams to release their free chunks, then give back empty slabs
  // and frees pending on other streams.
  stage = kRetried;
  if (const ChunkId c = steal_free_chunk(stream, Steal::waited); c != kNoChunk) return c;
  client_.reclaim();
  if (chunks_.has_spare()) return chunks_.any_spare();
  if (const ChunkId c = steal_free_chunk(stream, Steal::waited); c != kNoChunk) return c;
  if (!take_back_map_ahead()) return kNoChunk;
  if (chunks_.has_spare()) return chunks_.any_spare();
  return steal_free_chunk(stream, Steal::waited);
}

bool Backing::chunk_busy(ChunkId chunk) const {
  const Chunk& c = chunks_.at(chunk);
  for (std::uint32_t k = 0; k < c.maps; ++k)
    if (arenas_[arena_of(c.pages[k])]->pages.get(index_of(c.pages[k])).refs > 0)
      return true;
  return false;
}

bool Backing::chunk_free_for(ChunkId chunk, std::uint32_t stream, bool poll) {
  const Chunk& c = chunks_.at(chunk);
  for (std::uint32_t k = 0; k < c.maps; ++k) {
    const Arena& a = *arenas_[arena_of(c.pages[k])];
    const Page& p = a.pages.get(index_of(c.pages[k]));
    if (p.refs > 0) return false;
    if (streams_.progress.ordered(stream, a.stream, p.free_seq)) continue;
    if (!poll || !streams_.progress.catch_up(a.stream, false) || !streams_.progress.done(a.stream, p.free_seq))
      return false;
  }
  return true;
}

bool Backing::hand_over(std::uint32_t stream, std::uint32_t from, std::uint64_t free_seq) {
  if (!handovers_ || !streams_.progress.order_after(stream, from, free_seq)) return false;
  ++accounting_.stats.num_stream_handovers;
  return true;
}

bool Backing::hand_over_chunk(ChunkId chunk, std::uint32_t stream) {
  const Chunk& c = chunks_.at(chunk);
  for (std::uint32_t k = 0; k < c.maps; ++k) {
    const Arena& a = *arenas_[arena_of(c.pages[k])];
    const Page& p = a.pages.get(index_of(c.pages[k]));
    if (!streams_.progress.ordered(stream, a.stream, p.free_seq) &&
        !hand_over(stream, a.stream, p.free_seq))
      return false;
  }
  return true;
}

bool Backing::chunk_done(ChunkId chunk) const {
  const Chunk& c = chunks_.at(chunk);
  for (std::uint32_t k = 0; k < c.maps; ++k)
    if (!streams_.progress.done(arenas_[arena_of(c.pages[k])]->stream, page_at(c.pages[k]).free_seq))
      return false;
  return true;
}

ChunkId Backing::steal_free_chunk(std::uint32_t stream, Steal how) {
  // Which free chunk to take decides whether the layout settles: a chunk taken from a page that
  // is needed again while the thief still holds it must be stitched back (and the page it then
  // takes from, and so on). So take the one whose pages are due last: each page's next use is
  // predicted from its last two (a training step repeats), among the oldest frees (they are
  // also the likeliest to be done on other streams).
  // Before that, one whose pages the GPU is known to be done with (chunk_done, no event call):
  // a page whose chunk serves elsewhere is unmapped when next used, and the host waits there
  // for the GPU to reach the page's free if it has not yet. That wait lasts as long as the GPU
  // lags (milliseconds), a remap tens of microseconds. Most such waits followed a chunk taken on
  // its own stream a moment after its free, which stream order allows (docs/notes/2026-11-25-steals-that-leave-no-wait-behind.md).
  // At most kWeighed usable candidates, among at most kExamined entries unless the caller will
  // wait anyway: entries another stream has not caught up with stay listed, and scanning them all
  // for every page would make each malloc cost grow with the number of streams. A handover
  // (Steal::handed_over) weighs every chunk no alias uses: the poll was made by the scan before.
  const bool wait = how == Steal::waited;
  static constexpr int kWeighed = 64;
  static constexpr int kExamined = 4 * kWeighed;
  std::size_t best = freed_pages_.end();
  bool best_done = false;
  std::int64_t best_due = 0;
  int weighed = 0, examined = 0;
  std::size_t k = freed_pages_.begin();
  for (; k < freed_pages_.end() && weighed < kWeighed && (wait || examined < kExamined); ++k) {
    const PageId id = freed_pages_.at(k);
    if (id == kNoPage) continue;
    const Arena& a = *arenas_[arena_of(id)];
    Page& p = page_at(id);
    settle(p);
    // Stale (used again, or unmapped since), or its chunk busy through another alias (which is
    // listed itself when freed): not worth another look.
    if (p.refs > 0 || !p.mapped() || (p.aliased && chunk_busy(p.chunk))) {
      freed_pages_.drop(k, p);
      continue;
    }
    ++examined;
    if (wait && !streams_.progress.ordered(stream, a.stream, p.free_seq)) {
      streams_.progress.catch_up(a.stream, true);
      ++accounting_.stats.num_sync_all_streams;
    }
    if (how != Steal::handed_over && !chunk_free_for(p.chunk, stream, true)) continue;
    ++weighed;
    const bool done = chunk_done(p.chunk);
    const std::int64_t due = static_cast<std::int64_t>(static_cast<std::uint32_t>(p.last_use + p.reuse - clock_));
    if (best == freed_pages_.end() || done > best_done || (done == best_done && due > best_due)) {
      best = k;
      best_done = done;
      best_due = due;
    }
  }
  // Entries dropped in this scan (or in earlier ones, further back) are not walked again.
  best = freed_pages_.close_gaps_before(k, best);
  if (best == freed_pages_.end()) {
    freed_pages_.sweep();
    return kNoChunk;
  }
  const PageId id = freed_pages_.at(best);
  const Arena& a = *arenas_[arena_of(id)];
  const Page& p = a.pages.get(index_of(id));
  const ChunkId chunk = p.chunk;
  if (how == Steal::handed_over && !hand_over_chunk(chunk, stream)) {
    freed_pages_.sweep();
    return kNoChunk;
  }
  if (chunks_.at(chunk).maps == Chunk::kMaxMaps) {
    // Enough aliases: this one (free, and done on its stream) makes room for the next.
    if (!streams_.progress.wait_for(a.stream, p.free_seq)) return kNoChunk;
    unmap_page(id);
  }
  freed_pages_.sweep();
  return chunk;
}

bool Backing::could_back(std::size_t pages) {
  // At most one page of a chunk is in use at a time, so a block needs a chunk for each of its
  // pages: those held may serve, the rest must be created.
  if (pages * granularity_ > limit_) {
    oom_reason_ = "limit";
    return false;
  }
  const std::size_t held = chunks_.held();
  if (pages <= held + kAskDeviceBeyond) return true;  // a few to create: the creates will tell
  DeviceMemInfo info;
  try {
    info = device_.mem_info();
  } catch (const DeviceError&) {
    return true;  // no answer: the creates will tell
  }
  if ((pages - held) * granularity_ <= info.free) return true;
  oom_reason_ = "device";
  return false;
}

ChunkId Backing::create_chunk() {
  // Chunks being created by other threads (the lock released meanwhile) count as held.
  if ((chunks_.held() + creating_ + 1) * granularity_ > limit_) {
    oom_reason_ = "limit";
    return kNoChunk;
  }
  ChunkHandle handle = 0;
  ++creating_;
  try {
    unlocked([&] { handle = device_.create_chunk(granularity_); });
  } catch (const DeviceError& e) {
    --creating_;
    if (!e.device_out_of_memory()) throw;
    oom_reason_ = "device";
    return kNoChunk;
  } catch (...) {
    --creating_;
    throw;
  }
  --creating_;
  ChunkId id;
  try {
    id = chunks_.add(handle);
  } catch (...) {
    try { device_.release_chunk(handle); } catch (...) {}
    throw;
  }
  accounting_.count_chunk_created(granularity_);
  return id;
}

void Backing::release_chunk(ChunkId chunk) {
  device_.release_chunk(chunks_.at(chunk).handle);
  chunks_.remove(chunk);
  accounting_.count_chunk_released(granularity_);
}

bool Backing::unmap_chunk(ChunkId chunk, bool wait) {
  Chunk& c = chunks_.at(chunk);
  for (std::uint32_t k = 0; k < c.maps; ++k) {
    const Arena& a = *arenas_[arena_of(c.pages[k])];
    const Page& p = a.pages.get(index_of(c.pages[k]));
    if (p.refs > 0) return false;
    if (!streams_.progress.done(a.stream, p.free_seq)) {
      if (wait) ++accounting_.stats.num_sync_all_streams;
      if (!streams_.progress.catch_up(a.stream, wait) && !streams_.progress.done(a.stream, p.free_seq)) return false;
    }
  }
  while (c.maps > 0) unmap_page(c.pages[c.maps - 1]);
  return true;
}

// --- reclaiming ---------------------------------------------------------------------------------

void Backing::trim_to(std::size_t bytes, bool wait) {
  while (chunks_.held() * granularity_ > bytes && chunks_.has_spare())
    release_chunk(chunks_.any_spare());
  // Oldest frees first: the likeliest to be done on their streams.
  for (std::size_t k = freed_pages_.begin();
       k < freed_pages_.end() && chunks_.held() * granularity_ > bytes; ++k) {
    const PageId id = freed_pages_.at(k);
    if (id == kNoPage) continue;
    Page& p = page_at(id);
    settle(p);
    if (p.refs > 0 || !p.mapped()) {
      freed_pages_.drop(k, p);
      continue;
    }
    const ChunkId chunk = p.chunk;
    if (!unmap_chunk(chunk, wait)) continue;
    release_chunk(chunk);  // on failure it stays held, as a spare
  }
  freed_pages_.sweep();
}

void Backing::throw_oom(std::size_t requested, StreamId stream) {
  OomInfo info;
  info.requested = requested;
  info.stream = stream;
  info.limit = limit_;
  info.device_total = device_total_;
  try {
    info.device_free = device_.mem_info().free;
  } catch (...) {  // the report goes on without it
  }
  info.reserved = chunks_.held() * granularity_;
  info.allocated = static_cast<std::size_t>(accounting_.stats.allocated_bytes[kAllPools].current);
  info.largest_free_range = largest_free_range();
  info.reclaimable = (chunks_.held() - used_pages_) * granularity_;
  info.reason = oom_reason_;
  ++accounting_.stats.num_ooms;
  if (observer_) observer_->on_oom(info);
  throw OutOfMemoryError(std::move(info));
}

// --- reading ------------------------------------------------------------------------------------

std::vector<std::pair<DevicePtr, DevicePtr>> Backing::mapped_ranges() const {
  std::vector<std::pair<DevicePtr, DevicePtr>> out;
  for (const auto& arena : arenas_) {
    const DevicePtr base = arena->ranges.base();
    arena->pages.for_each_touched([&](std::size_t i, const Page& page) {
      if (!page.mapped()) return;
      const DevicePtr begin = base + (i << page_shift_);
      if (!out.empty() && out.back().second == begin) out.back().second += granularity_;
      else out.emplace_back(begin, begin + granularity_);
    });
  }
  return out;
}

std::size_t Backing::largest_free_range() const {
  // The largest free range whose pages are all mapped and ready for its stream.
  std::size_t best = 0;
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    const RangeAllocator& ranges = arenas_[a]->ranges;
    const PageTable& pages = arenas_[a]->pages;
    for (NodeId id = ranges.first(); id != kNoNode; id = ranges.node(id).next) {
      const RangeNode& n = ranges.node(id);
      if (!n.free) continue;
      std::size_t run = 0;
      for (DevicePtr pos = n.addr, end = n.addr + n.size; pos < end;) {
        const std::size_t i = (pos - ranges.base()) >> page_shift_;
        const DevicePtr page_end =
            std::min<DevicePtr>(end, ranges.base() + ((i + 1) << page_shift_));
        const Page& p = pages.get(i);
        const bool usable = refs_of(p) > 0 || (p.mapped() && page_ready(a, i, p));
        run = usable ? run + (page_end - pos) : 0;
        best = std::max(best, run);
        pos = page_end;
      }
    }
  }
  return best;
}

}  // namespace gmem::detail
