// Physical memory behind virtual ranges, and the policy that keeps it small. Backing owns the
// arenas (each stream's virtual ranges and their pages), the chunks held from the device and the
// pages each is mapped at (aliases), the pages freed while mapped (where stitching finds a free
// chunk), and the clash rule (when a page gets a chunk of its own). The engine asks it for a
// used range backed by mapped pages and gives ranges back; it never handles a chunk itself.
//
// Why apart from the engine: this is where every device call and every placement decision is
// made, and the only part that knows pages and chunks; blocks, slabs and counting sit above it.
// The steady state is one pass over a range's pages (back_pages, unref_pages); mapping,
// stitching, waiting for streams and reclaiming are out of line (backing.cpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/accounting.hpp"
#include "engine/chunk_pool.hpp"
#include "engine/clash_rule.hpp"
#include "engine/freed_pages.hpp"
#include "engine/kept_places.hpp"
#include "engine/map_job.hpp"
#include "engine/observer.hpp"
#include "engine/page_runs.hpp"
#include "engine/page_table.hpp"
#include "engine/plan_region.hpp"
#include "engine/range_allocator.hpp"
#include "engine/step_plan.hpp"
#include "engine/streams.hpp"
#include "gmem/device.hpp"
#include "gmem/engine.hpp"

namespace gmem::detail {

// One virtual address reservation, used by one stream.
struct Arena {
  Arena(DevicePtr base, std::size_t size, std::size_t page_count, std::uint32_t stream_index)
      : ranges(base, size), pages(page_count), stream(stream_index) {}
  RangeAllocator ranges;
  PageTable pages;
  std::uint32_t stream;
};

// What Backing asks of the engine around it, for the blocks it does not own (slow paths only).
class BackingClient {
 public:
  // A new arena is about to be added (its index: the arenas so far); may throw, and the arena
  // is then not added.
  virtual void arena_added() = 0;
  // Memory is short: give back empty slabs and the frees that wait on other streams.
  virtual void reclaim() = 0;
  // Stream `stream`'s frees held for other streams (record_stream) whose events are recorded:
  // makes `stream` wait for those events on the GPU and gives them back as its frees from now
  // on (a handover, no host wait). Returns how many went back; none during a capture.
  virtual std::size_t hand_over_held(StreamId stream) = 0;
  // The engine's lock around a malloc's device calls (its creates, maps, set-access calls, clash
  // unmaps and waits for its stream; see Backing::map_missing). without_lock releases it while
  // `calls` runs (device calls only: no engine state; never throws) and takes it again;
  // wait_for_landing releases it until another thread calls landed() (or a spurious wakeup),
  // and takes it again; landed() wakes every waiter.
  virtual void without_lock(const std::function<void()>& calls) = 0;
  virtual void wait_for_landing() = 0;
  virtual void landed() = 0;
  // Takes the engine's lock on a thread that does not hold it (Backing's map-ahead thread), runs
  // `work` and releases it; wait_for_landing may be called from `work`.
  virtual void with_lock(const std::function<void()>& work) = 0;

 protected:
  ~BackingClient() = default;
};




class Backing {
 public:
  // Throws Error(invalid_argument) for a device granularity that is not a power of two >= 512,
  // or a `page_size` (0: the device's granularity) that is not a power-of-two multiple of it up
  // to kMaxPageSize. `observer` is the engine's (read when a page is mapped or unmapped, or on
  // OOM). `stable_pages`: EngineOptions::stable_pages (a page keeps its chunk, none aliased).
  // `handovers`: EngineOptions::stream_handovers. `map_ahead`: EngineOptions::map_ahead.
  Backing(Device& device, Streams& streams, Accounting& accounting,
          EngineObserver* const& observer, BackingClient& client, std::size_t page_size = 0,
          bool stable_pages = false, bool handovers = true, bool map_ahead = false);
  static constexpr std::size_t kMaxPageSize = std::size_t{1} << 30;
  ~Backing();  // unmaps every page, gives back every address range and chunk
  Backing(const Backing&) = delete;
  Backing& operator=(const Backing&) = delete;

  std::size_t granularity() const { return granularity_; }  // the page size: bytes per chunk
  std::size_t peak_used_bytes() const { return peak_used_ * granularity_; }  // most pages used at once
  // Bytes of chunks that the most pages used at once since begin_interval() need, with the clash
  // rule's allowance: what empty_cache() keeps once it keeps (EmptyCacheRule).
  std::size_t interval_need_bytes() const {
    return (interval_peak_used_ + clash_rule_.allowance(interval_peak_used_)) * granularity_;
  }
  void begin_interval() { interval_peak_used_ = used_pages_; }
  std::size_t device_total() const { return device_total_; }
  std::size_t limit() const { return limit_; }
  // A limit in bytes as given (0: the device's total), or Error(invalid_argument) for one above
  // the device or below a page: a limit never quietly becomes no limit.
  std::size_t checked_limit(std::size_t bytes, const char* what) const;
  void set_limit(std::size_t bytes) { limit_ = bytes; }
  void set_arena_size(std::size_t address_space);  // 0: the device's total

  // --- the fast path (the steady state makes no device call) ------------------------------------
  struct Taken {
    std::uint32_t arena;
    NodeId node;
    DevicePtr addr;
    bool kept = false;  // a kept place taken back (kept_places.hpp): the block keeps its place too
  };
  // A used range of `bytes` in one of stream `si`'s arenas, backed by mapped pages; throws
  // OutOfMemoryError (for `requested` bytes) or DeviceError with nothing changed. `plannable`:
  // a block's own range (not a slab's), which a planned step layout may place (mark_step).
  Taken take_range(std::uint32_t si, std::size_t bytes, std::size_t requested,
                   bool plannable = false) {
    if (plannable && planner_.active()) [[unlikely]] return take_planned(si, bytes, requested);
    return take_online(si, bytes, requested);
  }
  // A free on arena `arena`'s stream: its stamp (StreamTracker::stamp), which release_range and
  // keep_range take, so that a free held back for other streams can be stamped when it was made.
  std::uint64_t free_stamp(std::uint32_t arena) {
    return streams_.progress.stamp(arenas_[arena]->stream);
  }
  // free_stamp for a block other streams hold back (record_stream): an event marks the free.
  std::uint64_t held_free_stamp(std::uint32_t arena) {
    return streams_.progress.stamp_marked(arenas_[arena]->stream);
  }
  // The used range `node` goes back, freed on its stream at `freed_at` (free_stamp).
  void release_range(std::uint32_t arena, NodeId node, std::uint64_t freed_at);
  // release_range for a block whose place a CUDA graph may have captured (kept_places.hpp): its
  // pages are given back, its range is kept for the next malloc of its size on its stream.
  // `birth`: Record::birth, the order the blocks were made in.
  void keep_range(std::uint32_t arena, NodeId node, std::uint32_t birth, std::uint64_t freed_at);
  // The used range [addr, addr + bytes) in the arena that holds it, backed by mapped pages, as
  // take_range's; kNoNode in the result's node when that range is not all free (nothing changed).
  // What Engine::malloc_at puts a block back with.
  Taken take_at(DevicePtr addr, std::size_t bytes, std::size_t requested);

  // --- planned step layouts (step_plan.hpp) -----------------------------------------------------
  // A training step ends: from now on the range mallocs of one stream (the first to make one)
  // are recorded step by step, and once shapes take turns a step whose shape was seen before
  // takes its planned offsets.
  void mark_step() {
    if (stable_pages_) return;  // a plan region's pages alias online chunks
    if (!planner_.active()) clash_rule_.restart_window(device_.host_time());
    // The round ends (a batch in flight gives its pages back when it lands; its pages are booked).
    if (!ahead_.booked.empty() || ahead_.next < ahead_.queue.size()) [[unlikely]] end_map_ahead();
    planner_.mark_step();
    follow_warm_up();
  }
  const StepPlanner::Stats& plan_stats() const { return planner_.stats(); }

  // --- a new plan's pages mapped ahead (EngineOptions::map_ahead) -------------------------------
  // The step that first follows a plan maps the plan region's pages (a Llama step: 3,380 of them,
  // 110-180 ms of driver calls, serialized by the driver), on the program's thread, in a step the
  // host is the bottleneck of. The same calls made by another thread while the step runs cost it
  // 6-8 ms (H100: bench/torch/overlap_maps.py). So at that step's first malloc, the pages its
  // plan uses that are not mapped are queued in the order the step will first use them, and a
  // thread of Backing's maps them a batch at a time: each batch is booked under the engine's
  // lock (a spare chunk or a free one the stream may use now, never a new one: where there is
  // none, the rest is left to the step, as without map-ahead), each page holding a reference of
  // the map-ahead's (Page::ahead) so that its chunk stays busy; its calls are made without the
  // lock, and it lands under it. The first block that takes such a page takes that reference
  // over; a block that needs a page still in flight waits for its batch (map_missing). The step's
  // mark gives back the references no block took.
  //
  // That step's mallocs catch up with the thread (a Llama step's forward pass takes most of the
  // plan's extent within tens of milliseconds), so the region is also mapped early: during the
  // steps before any plan is followed, while they keep beginning new shapes (they will come
  // back), as much of it as the largest step recorded held at once in its own blocks
  // (StepPlanner::extent_to_map_early). Those maps are aliases of chunks that were free as such a
  // step began (a step's temporaries: free again when the plan's step begins), one chunk to a
  // page, none aliased in the region already; each page holds a reference only while its batch
  // is in flight (so that no chunk of the batch is stolen or unmapped meanwhile; a malloc whose
  // page shares such a chunk waits for the batch instead of remapping), counted nowhere, and is
  // a free mapped page once it lands. A page whose chunk is busy when the plan's step reaches it
  // is remapped then, as any alias would be.

  // Stops and joins the thread (called without the engine's lock, before the engine goes), and
  // gives back what the round still holds.
  void stop_map_ahead();

  // --- captures into a pool (stable pages) ------------------------------------------------------
  // A pool's pages keep their chunks because a CUDA graph's kernels were captured against them;
  // but only pages under a block live during a capture can be in a graph. The others (a warm-up's,
  // which cudagraph trees run eagerly in the pool) may give their chunks back for the capture's
  // new pages, which take spares before they create chunks. So, in a stable engine:
  // pin_used_pages() pins every page a live block or slab uses; release_unpinned_pages() unmaps
  // the free pages no capture pinned whose streams are known to be done (their chunks go spare;
  // no event call); after set_pinning(true), every range taken pins its pages.
  bool stable() const { return stable_pages_; }
  void pin_used_pages();
  void release_unpinned_pages();
  void set_pinning(bool pinning) { pinning_ = pinning; }

  // --- reclaiming ---------------------------------------------------------------------------------
  // Gives back free chunks until at most `bytes` are held (waits for streams with `wait`).
  void trim_to(std::size_t bytes, bool wait);

  // --- reading ------------------------------------------------------------------------------------
  const Arena& arena(std::uint32_t a) const { return *arenas_[a]; }
  std::size_t arena_count() const { return arenas_.size(); }
  bool in_arenas(DevicePtr ptr) const;  // in one of the arenas, or one past its end
  const ChunkPool& chunks() const { return chunks_; }
  std::size_t used_pages() const { return used_pages_; }
  std::size_t largest_free_range() const;
  // What is mapped now, as [begin, end) ranges by address (adjacent pages merged).
  std::vector<std::pair<DevicePtr, DevicePtr>> mapped_ranges() const;
  // Calls visit(arena, node) for each free range of each arena, in address order.
  template <class F>
  void for_each_free_range(F&& visit) const {
    for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
      const RangeAllocator& ranges = arenas_[a]->ranges;
      for (NodeId id = ranges.first(); id != kNoNode; id = ranges.node(id).next) {
        const RangeNode& n = ranges.node(id);
        if (n.free) visit(*arenas_[a], n);
      }
    }
  }
  // A page's references (what Page::refs says, or its run's).
  std::uint32_t page_refs(const Arena& arena, std::size_t index) const {
    return refs_of(arena.pages.get(index));
  }
  // Mallocs in their slow path that wait for pages in flight or have a MapJob under way: their
  // ranges are taken but not yet blocks, so the invariants hold only when there are none.
  std::size_t slow_mallocs() const { return slow_mallocs_; }
  // Verifies pages, chunks and the freed-page list against the arenas' ranges; throws
  // std::logic_error (engine_checks.cpp). Returns the bytes of used ranges.
  std::int64_t check_invariants() const;

 private:
  struct Placement {
    std::uint32_t arena;
    NodeId node;
    std::size_t offset;  // into the free range
  };
  Placement place(std::uint32_t si, std::size_t bytes);
  Taken take_online(std::uint32_t si, std::size_t bytes, std::size_t requested) {
    if (!kept_.empty()) [[unlikely]] return take_kept(si, bytes, requested);
    return take_placed(place(si, bytes), bytes, requested);
  }
  // take_online while places are kept: the earliest-born kept place of `bytes`, if any.
  Taken take_kept(std::uint32_t si, std::size_t bytes, std::size_t requested);
  void release_kept(const KeptPlaces::Place& place) { arenas_[place.arena]->ranges.release(place.node); }
  // A used range's pages go back (freed at `freed_at` on its stream; the planner told), the
  // range stays used: release_range and keep_range, which then free or keep it.
  void unref_range(std::uint32_t arena, const RangeNode& n, std::uint64_t freed_at);
  // Gives back the kept places that expired by now (KeptPlaces::expire), or all of them.
  void expire_kept(bool all = false) {
    kept_.expire(clock_, [this](const KeptPlaces::Place& p) { release_kept(p); }, all);
  }
  // Takes `bytes` of free range `at.node` at `at.offset` and backs them (OOM for `requested`).
  Taken take_placed(const Placement& at, std::size_t bytes, std::size_t requested);
  Taken take_planned(std::uint32_t si, std::size_t bytes, std::size_t requested);
  // Whether the free page's chunk may serve its arena now without a device call: no other alias
  // of the chunk is in use, or freed on another stream that the arena's stream is not known to
  // come after (StreamTracker::ordered; blocking_alias names the first that is, kNoPage when
  // none).
  PageId blocking_alias(std::uint32_t arena, std::size_t index, const Page& page) const;
  bool page_ready(std::uint32_t arena, std::size_t index, const Page& page) const {
    return blocking_alias(arena, index, page) == kNoPage;
  }
  // The same, polling (an event query, no wait) the other streams whose frees of its aliases
  // are not yet known to be done, and making the arena's stream wait on the GPU for those that
  // are not (a handover: StreamTracker::order_after); no call where the page is ready already.
  // False while an alias is in use, or during a capture that forbids the calls.
  bool page_ready_polled(std::uint32_t arena, std::size_t index, const Page& page);
  bool chunk_free_for(ChunkId chunk, std::uint32_t stream, bool poll);
  // A handover: makes `stream` wait on the GPU for stream `from`'s work up to free `free_seq`,
  // and counts it; false, with no call, where handovers are off or a capture forbids it.
  bool hand_over(std::uint32_t stream, std::uint32_t from, std::uint64_t free_seq);
  // The same for every other stream that freed an alias of the free chunk; false, the chunk not
  // to be used, if one cannot be made.
  bool hand_over_chunk(ChunkId chunk, std::uint32_t stream);
  bool chunk_busy(ChunkId chunk) const;  // used through one of its pages
  // Every page the free chunk is mapped at is known to be done on its stream (StreamTracker::
  // done): none of them waits for the GPU before an unmap.
  bool chunk_done(ChunkId chunk) const;
  // `listed`: among the stream's arenas, where online placement looks (the plan region is not).
  // No address space: OutOfMemoryError for a malloc of min_bytes, else the device's error.
  std::uint32_t add_arena(std::uint32_t si, std::size_t min_bytes, bool listed = true,
                          bool for_malloc = true);
  std::pair<std::size_t, std::size_t> page_span(std::uint32_t arena, DevicePtr addr,
                                                std::size_t bytes) const;
  bool back_pages(std::uint32_t arena, DevicePtr addr, std::size_t bytes);
  // The pages of [first, last] wholly inside the range at addr (first or last may not be).
  std::pair<std::size_t, std::size_t> interior(std::uint32_t arena, DevicePtr addr,
                                               std::size_t bytes, std::size_t first,
                                               std::size_t last) const;
  // Ends the run a page is in, if any, before anything but the fast path looks at the page.
  void settle(Page& p) {
    if (p.in_run) [[unlikely]] end_run(p.last_use);
  }
  void end_run(std::uint32_t index) { runs_.end(index, arenas_[runs_[index].arena]->pages); }
  std::uint32_t refs_of(const Page& p) const { return runs_.refs_of(p); }
  bool map_missing(std::uint32_t arena, DevicePtr addr, std::size_t bytes);  // back_pages' slow path
  // map_missing's steps: decide and book every map (the maps go to `job`; false on OOM, with the
  // range's references given back); make the job's calls (without the engine's lock, holding
  // mapping_calls_); land it (the observer is told; a device failure is rolled back and rethrown).
  bool plan_maps(std::uint32_t arena, DevicePtr addr, std::size_t bytes, MapJob& job, int& stage);
  void run_job(MapJob& job) noexcept;  // a failure unmaps what it mapped before returning
  DevicePtr page_address(const MapJob& job, std::size_t k) const {
    return job.base + (DevicePtr{job.pages[k]} << page_shift_);
  }
  void land(MapJob& job, DevicePtr addr, std::size_t bytes);
  // What land and land_ahead share: the observer told of the maps made, or, when the device
  // failed, the books taken back to what the device did (false then).
  bool land_books(const MapJob& job);
  // Takes back the books of the job's maps from pages[from] on, which the device never made.
  void forget_maps(const MapJob& job, std::size_t from);
  // A boundary page is claimed by another slow malloc: give the references back, wait for it to
  // land, take the pages again (back_pages).
  bool wait_and_take_again(std::uint32_t arena, DevicePtr addr, std::size_t bytes);
  // A page of [first, last] is claimed by another slow malloc, or in a map-ahead batch in flight.
  bool in_flight(std::uint32_t arena, std::size_t first, std::size_t last) const;
  // Counts a malloc in map_missing (slow_mallocs_) and wakes the waiters when it leaves.
  struct SlowMalloc {
    explicit SlowMalloc(Backing& backing);
    ~SlowMalloc();
    Backing& b;
  };
  // Runs device calls with the engine's lock released; rethrows what they threw, with the lock.
  void unlocked(const std::function<void()>& calls);
  void unref_pages(std::uint32_t arena, DevicePtr addr, std::size_t bytes, std::uint64_t stamp);
  // One of page `index`'s references goes back; with the last, a mapped page is free (listed
  // where steals look). `counted`: the reference made the page one of used_pages_ (all but an
  // early map's, map_ahead.cpp).
  void drop_ref(std::uint32_t arena, std::size_t index, Page& p, bool counted = true);
  // clashes_before: how often the page to map had to be remapped before (Page::clashes);
  // planned: the page is the plan region's.
  ChunkId acquire_chunk(std::uint32_t stream, int& stage, std::uint32_t clashes_before, bool planned);
  ChunkId create_chunk();  // kNoChunk when the limit or the device says no
  // Whether a block of `pages` pages may be backed at all: false (oom_reason_ says why) when its
  // pages alone are over the limit, or when the chunks it must create, kAskDeviceBeyond or more
  // beyond those held, are more than the device has free (one cuMemGetInfo). So a malloc that
  // cannot succeed is refused before it creates anything: on an H200, a 140.8 GiB request under
  // a 139.8 GiB limit created the 130 GiB the device had free (65,000 cuMemCreate, then as many
  // cuMemRelease) before it failed, and peak reserved read 138 GiB ever after.
  bool could_back(std::size_t pages);
  static constexpr std::size_t kAskDeviceBeyond = 512;
  // How steal_free_chunk may take a free chunk mapped elsewhere: only one the stream may use
  // now (its other streams known to be done, after a poll); also one another stream freed and
  // may still use, the stream made to wait for it on the GPU (hand_over_chunk: no host wait, no
  // new memory); or after waiting on the host for the other streams (pressure).
  enum class Steal { ready, handed_over, waited };
  ChunkId steal_free_chunk(std::uint32_t stream, Steal how);
  Page& page_at(PageId id) { return arenas_[arena_of(id)]->pages.at(index_of(id)); }
  const Page& page_at(PageId id) const { return arenas_[arena_of(id)]->pages.get(index_of(id)); }
  // The books of a map made (or to be made, in flight, by a MapJob) and of an unmap.
  void note_mapped(std::uint32_t arena, std::size_t index, ChunkId chunk);
  void note_unmapped(PageId id);
  // The device call (with the lock released if `unlock`: the page must be this malloc's), then
  // the books.
  void unmap_page(PageId id, bool unlock = false);
  bool unmap_chunk(ChunkId chunk, bool wait);  // every alias; false if still in use
  void release_chunk(ChunkId chunk);
  [[noreturn]] void throw_oom(std::size_t requested, StreamId stream);

  // Map-ahead (above): queues a new plan's pages at its step's first malloc; books the next
  // batch (false: nothing left); lands one; gives back one page's reference, or every reference
  // the round holds (at a mark); the thread's loop.
  void start_map_ahead();
  // Maps `extent` bytes of the plan region early (above), for stream `si`'s plan.
  void start_mapping_early(std::uint32_t si, std::size_t extent);
  bool book_ahead(MapJob& job);
  ChunkId early_chunk(Page& page);  // the next chunk for an early map; kNoChunk: none left
  // Whether a chunk may be mapped early (free, on the stream's order, room for an alias, none
  // of its pages in the plan region).
  bool early_chunk_fits(ChunkId chunk, std::uint32_t stream) const;
  void wake_map_ahead();  // starts the thread if there is none, and wakes it
  bool pinned_early(std::uint32_t arena, std::size_t first, std::size_t last) const;
  void land_ahead(const MapJob& job, std::uint64_t round, bool held);
  void give_back_ahead(std::uint32_t index);
  void end_map_ahead();
  // Ends the round and waits for its batch in flight: false when map-ahead held no chunk.
  bool take_back_map_ahead();
  void map_ahead_loop() noexcept;
  // The pages a held round may book beyond the step's progress (booking_limit).
  std::size_t booking_limit();
  static constexpr std::size_t kAheadBatch = 32;      // pages a batch: ~1 ms of calls
  // A held round books at most this many pages beyond those the step has reached (~1 ms of
  // calls): each holds its chunk from its booking, and a step that leaves its plan, or places
  // long-lived blocks online, needs the chunks the plan's later pages would otherwise hold.
  static constexpr std::size_t kAheadWindow = 32;
  // An early round leaves the step at least 1/kEarlyReserve of the chunks held free.
  static constexpr std::size_t kEarlyReserve = 16;
  static constexpr std::size_t kMinAheadPages = 16;   // fewer are mapped by the step
  struct MapAhead {
    bool enabled = false;
    std::vector<std::uint32_t> queue;   // the plan region's pages, in the order of first use
    std::size_t next = 0;               // queue[next...] not booked yet
    // A held round's: the ordinal of the block that first uses each page of the queue, and how
    // many of them the step has reached (booking_limit).
    std::vector<std::uint32_t> ordinals;
    std::size_t reached = 0;
    bool waits_for_step = false;  // the thread waits for the step to reach more of the queue
    std::vector<std::uint32_t> booked;  // pages booked this round (the reference may be a block's since)
    std::uint64_t round = 0;            // rounds ended: a batch of an earlier round gives back all
    // The round maps early (held: false): its candidate chunks, free as its step began, with the
    // page each was found through (whose next use the early page takes on).
    bool held = true;
    std::vector<std::pair<ChunkId, PageId>> candidates;
    std::size_t next_candidate = 0;
    bool job_in_flight = false;
    bool early_in_flight = false;  // the batch in flight maps early
    bool stop = false;
    std::thread thread;
  };

  // --- what it works with -------------------------------------------------------------------------
  Device& device_;
  Streams& streams_;
  Accounting& accounting_;
  EngineObserver* const& observer_;
  BackingClient& client_;
  std::size_t granularity_;
  int page_shift_;
  // EngineOptions::stable_pages: chunks come from the spares or the device, never from another
  // page, so no page is ever aliased, remapped or waited for (acquire_chunk).
  const bool stable_pages_;
  const bool handovers_;  // EngineOptions::stream_handovers
  bool pinning_ = false;  // a capture is under way in this stable engine: ranges taken pin
  std::size_t device_total_;
  std::size_t arena_size_ = 0;
  std::size_t limit_ = 0;
  std::string oom_reason_ = "limit";  // why the last growth failed
  static constexpr const char* kCaptureReason =
      "a CUDA graph is being captured on this stream: a page it freed must be remapped, and "
      "whether the stream is done with it cannot be asked before the capture ends (an event "
      "query invalidates it); allocate this before or after the capture";

  // --- what it holds ------------------------------------------------------------------------------
  std::vector<std::unique_ptr<Arena>> arenas_;
  ChunkPool chunks_;
  FreedPages freed_pages_;      // where stitching looks for free chunks
  std::size_t used_pages_ = 0;  // pages with refs > 0 (each pins one busy chunk)
  std::size_t peak_used_ = 0;   // most pages used at once
  std::size_t interval_peak_used_ = 0;  // most pages used at once since begin_interval()
  void note_peak_used() {  // used_pages_ passed interval_peak_used_ (so perhaps peak_used_ too)
    interval_peak_used_ = used_pages_;
    peak_used_ = std::max(peak_used_, used_pages_);
  }
  std::size_t free_pages_ = 0;  // mapped pages with refs == 0
  std::size_t slow_mallocs_ = 0;  // in map_missing (its lock released at times)
  std::size_t creating_ = 0;      // chunks being created with the lock released
  // Held by a MapJob over all its calls and by a clash unmap made without the engine's lock: the
  // CUDA driver broke a chunk (its next cuMemMap failed with CUDA_ERROR_UNKNOWN) when another
  // thread unmapped one of its aliases between the job's cuMemMap and cuMemSetAccess of it (see
  // Backing::map_missing). The only lock besides the engine's, and taken after it.
  std::mutex mapping_calls_;
  const StreamTracker::Unlocked unlocked_ = [this](const std::function<void()>& calls) {
    unlocked(calls);
  };
  std::uint32_t clock_ = 0;     // ranges taken so far (wraps): the pages' time of use
  ClashRule clash_rule_;
  // Tells the clash rule whether the planner's step is a warm-up (whose clashes do not count).
  void follow_warm_up() {
    if (planner_.warm_up() == clash_rule_.counting()) [[unlikely]]
      clash_rule_.set_counting(!planner_.warm_up(), device_.host_time());
  }
  PageRuns runs_;  // large ranges' interior pages, one record each
  // Planned step layouts: the planner, the stream whose steps it records, and the plan region
  // (an arena of that stream that online placement never uses).
  static constexpr std::uint32_t kNoArena = ~std::uint32_t{0};
  StepPlanner planner_;
  std::uint32_t plan_stream_ = kNoArena;
  std::uint32_t plan_arena_ = kNoArena;
  PlanRegion plan_region_;
  KeptPlaces kept_;
  MapAhead ahead_;
};

}  // namespace gmem::detail
