// ChunkSource: where a page's physical memory comes from when it has none ready, and where it
// goes back. Every way of finding a chunk is here, all out of line: a spare; a new chunk (within
// the limit, and the clash rule for pages that keep clashing); a free chunk mapped elsewhere,
// stolen (stitching) when the stream may use it now, or handed over (the stream made to wait for
// another on the GPU), or after a host wait under pressure; the engine's reclaim. Also the
// unmaps, trimming, and the OOM report with its reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/accounting.hpp"
#include "engine/arenas.hpp"
#include "engine/backing_client.hpp"
#include "engine/clash_rule.hpp"
#include "engine/engine_lock.hpp"
#include "engine/map_job.hpp"
#include "engine/observer.hpp"
#include "engine/page_backing.hpp"
#include "engine/streams.hpp"
#include "gmem/device.hpp"

namespace gmem::detail {

// How far a malloc had to go for its chunks; its stats say so (num_stitches, num_alloc_retries).
enum Stage : int { kFromCache = 0, kStitched = 1, kRetried = 2 };

class ChunkSource {
 public:
  struct Options {
    // EngineOptions::stable_pages: chunks come from the spares or the device, never from
    // another page, so no page is ever aliased, remapped or waited for.
    bool stable_pages = false;
    bool handovers = true;  // EngineOptions::stream_handovers
  };
  ChunkSource(Device& device, Arenas& arenas, PageBacking& pages, MapCalls& calls,
              Accounting& accounting, EngineObserver* const& observer, BackingClient& client,
              const EngineLock& lock, Options options);

  // --- a chunk for a page ---------------------------------------------------------------------------
  // A chunk for a page of `stream` (an arena's stream index) that has none ready. clashes_before:
  // how often the page had to be remapped before (Page::clashes); planned: the page is the plan
  // region's; warm_up: the step is a warm-up (StepPlanner::warm_up), whose layout is not seen
  // again. kNoChunk when none can be had short of what map-ahead holds (then: after_map_ahead).
  ChunkId acquire(std::uint32_t stream, int& stage, std::uint32_t clashes_before, bool planned,
                  bool warm_up);
  // acquire's last resort, once map-ahead gave back what it held.
  ChunkId after_map_ahead(std::uint32_t stream);
  // How steal may take a free chunk mapped elsewhere: only one the stream may use now (its other
  // streams known to be done, after a poll); also one another stream freed and may still use,
  // the stream made to wait for it on the GPU (hand_over_chunk: no host wait, no new memory); or
  // after waiting on the host for the other streams (pressure).
  enum class Steal { ready, handed_over, waited };
  ChunkId steal(std::uint32_t stream, Steal how);
  // Whether a block of `pages` pages may be backed at all (see could_back in chunk_source.cpp).
  bool could_back(std::size_t pages);
  // The free page's chunk made ready for its arena: as PageBacking::page_ready, polling (an event
  // query, no wait) the other streams whose frees of its aliases are not yet known to be done,
  // and making the arena's stream wait on the GPU for those that are not (a handover); no call
  // where the page is ready already. False while an alias is in use, or during a capture.
  bool make_ready(std::uint32_t arena, std::size_t index, const Page& page);

  // --- unmaps and giving back -------------------------------------------------------------------------
  // The device call (with the engine's lock released if `unlock`: the page must be this
  // malloc's), then the books.
  void unmap_page(PageId id, bool unlock = false);
  // Gives back free chunks until at most `bytes` are held (waits for streams with `wait`).
  void trim_to(std::size_t bytes, bool wait);
  // A malloc that failed: the chunks created for it go back to the device.
  void release_spares();
  // Unmaps the free pages no capture pinned whose streams are known to be done (stable pages).
  void release_unpinned_pages();

  // --- the limit and the OOM ------------------------------------------------------------------------
  std::size_t device_total() const { return device_total_; }
  std::size_t limit() const { return limit_; }
  void set_limit(std::size_t bytes) { limit_ = bytes; }
  // A limit in bytes as given (0: the device's total), or Error(invalid_argument) for one above
  // the device or below a page: a limit never quietly becomes no limit.
  std::size_t checked_limit(std::size_t bytes, const char* what) const;
  void set_oom_reason(const char* reason) { oom_reason_ = reason; }
  [[noreturn]] void throw_oom(std::size_t requested, StreamId stream);
  static constexpr const char* kCaptureReason =
      "a CUDA graph is being captured on this stream: a page it freed must be remapped, and "
      "whether the stream is done with it cannot be asked before the capture ends (an event "
      "query invalidates it); allocate this before or after the capture";

  // --- the clash rule (clash_rule.hpp) --------------------------------------------------------------
  ClashRule& clash_rule() { return clash_rule_; }
  const ClashRule& clash_rule() const { return clash_rule_; }
  // Tells the clash rule whether the planner's step is a warm-up (whose clashes do not count).
  void follow_warm_up(bool warm_up) {
    if (warm_up == clash_rule_.counting()) [[unlikely]]
      clash_rule_.set_counting(!warm_up, device_.host_time());
  }
  bool stable_pages() const { return options_.stable_pages; }

 private:
  // No alias of the free chunk is in use, and each was freed on a stream `stream` comes after
  // (or, with `poll`, one an event query finds done).
  bool chunk_usable_by(ChunkId chunk, std::uint32_t stream, bool poll);
  // A handover: makes `stream` wait on the GPU for stream `from`'s work up to free `free_seq`,
  // and counts it; false, with no call, where handovers are off or a capture forbids it.
  bool hand_over(std::uint32_t stream, std::uint32_t from, std::uint64_t free_seq);
  // The same for every other stream that freed an alias of the free chunk; false, the chunk not
  // to be used, if one cannot be made.
  bool hand_over_chunk(ChunkId chunk, std::uint32_t stream);
  ChunkId create_chunk();  // kNoChunk when the limit or the device says no
  void release_chunk(ChunkId chunk);
  bool unmap_chunk(ChunkId chunk, bool wait);  // every alias; false if still in use
  static constexpr std::size_t kAskDeviceBeyond = 512;

  Device& device_;
  Arenas& arenas_;
  Streams& streams_;
  PageBacking& pages_;
  ChunkPool& chunks_;
  MapCalls& calls_;
  Accounting& accounting_;
  EngineObserver* const& observer_;
  BackingClient& client_;
  const EngineLock& lock_;
  const Options options_;
  const std::size_t page_size_;
  std::size_t device_total_;
  std::size_t limit_ = 0;
  std::string oom_reason_ = "limit";  // why the last growth failed
  std::size_t creating_ = 0;          // chunks being created with the lock released
  ClashRule clash_rule_;
};

}  // namespace gmem::detail
