// PageBacking: the books of the pages behind used ranges, and the fast path over them. It owns
// each page's references (Page::refs: the used ranges on it), the chunks held and the pages each
// is mapped at (ChunkPool), the pages freed while mapped (FreedPages, where stitching looks), the
// page runs (PageRuns) and the counts of used and free pages. It makes no device call: a range
// whose pages are not all mapped and ready comes back not ready, its references taken, for the
// Mapper to map.
//
// Invariants (Backing::check_invariants verifies them):
//   - a page's refs are the used ranges overlapping it (a page mapped ahead holds one more,
//     map_ahead.hpp); a used page is mapped; a chunk is used through one of its pages at most;
//   - Page::chunk and Chunk::pages agree; Page::aliased is set exactly when its chunk has more
//     than one page;
//   - used_pages() counts pages with refs > 0, mapped_free_pages() mapped pages with refs == 0;
//   - every free chunk is findable through a listed page (FreedPages), so stitching sees it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "engine/arenas.hpp"
#include "engine/chunk_pool.hpp"
#include "engine/freed_pages.hpp"
#include "engine/page_runs.hpp"
#include "engine/streams.hpp"

namespace gmem::detail {

class PageBacking {
 public:
  PageBacking(Arenas& arenas, Streams& streams) : arenas_(arenas), streams_(streams) {}

  // --- the fast path ------------------------------------------------------------------------------
  // Takes a reference on every page of [addr, addr + bytes) in arena `arena`: true when all are
  // mapped and ready for its stream (the steady state), false when some must be mapped (the
  // references stay taken: Mapper::map_missing maps them, or gives them back).
  bool take(std::uint32_t arena, DevicePtr addr, std::size_t bytes);
  // Gives back the range's references, its pages freed on its stream at `stamp`.
  void give_back(std::uint32_t arena, DevicePtr addr, std::size_t bytes, std::uint64_t stamp);
  // One of page `index`'s references goes back; with the last, a mapped page is free (listed
  // where steals look). `counted`: the reference made the page one of used_pages() (all but an
  // early map's, map_ahead.hpp).
  void drop_ref(std::uint32_t arena, std::size_t index, Page& p, bool counted = true);
  // A reference taken without take() (a map-ahead booking): counted as used.
  void count_used() {
    if (++used_pages_ > interval_peak_used_) note_peak_used();
  }
  // Ends the run a page is in, if any, before anything but the fast path looks at the page.
  void settle(Page& p) {
    if (p.in_run) [[unlikely]] end_run(p.last_use);
  }
  void end_run(std::uint32_t index) { runs_.end(index, arenas_[runs_[index].arena].pages); }
  std::uint32_t refs_of(const Page& p) const { return runs_.refs_of(p); }

  // --- what a page's chunk may serve (no device call) ---------------------------------------------
  // Whether the free page's chunk may serve its arena now: no other alias of the chunk is in use,
  // or freed on another stream that the arena's stream is not known to come after
  // (StreamTracker::ordered; blocking_alias names the first that is, kNoPage when none).
  PageId blocking_alias(std::uint32_t arena, std::size_t index, const Page& page) const;
  bool page_ready(std::uint32_t arena, std::size_t index, const Page& page) const {
    return blocking_alias(arena, index, page) == kNoPage;
  }
  bool chunk_in_use(ChunkId chunk) const;  // used through one of its pages
  // Every page the free chunk is mapped at is known to be done on its stream (StreamTracker::
  // done): none of them waits for the GPU before an unmap.
  bool chunk_gpu_done(ChunkId chunk) const;

  // --- the books of maps ----------------------------------------------------------------------------
  // A map made (or to be made, in flight, by a MapJob), and an unmap made.
  void note_mapped(std::uint32_t arena, std::size_t index, ChunkId chunk);
  void note_unmapped(PageId id);
  ChunkPool& chunks() { return chunks_; }
  const ChunkPool& chunks() const { return chunks_; }
  FreedPages& freed() { return freed_; }
  const FreedPages& freed() const { return freed_; }
  const PageRuns& runs() const { return runs_; }

  // --- captures into a pool (stable pages) ---------------------------------------------------------
  // Pins every page a used range holds; after set_pinning(true), pin() pins a range's pages.
  void pin_used_pages();
  void set_pinning(bool pinning) { pinning_ = pinning; }
  void pin_if_pinning(std::uint32_t arena, DevicePtr addr, std::size_t bytes) {
    if (!pinning_) [[likely]] return;
    const auto [first, last] = arenas_.span(arena, addr, bytes);
    for (std::size_t i = first; i <= last; ++i) arenas_[arena].pages.at(i).pinned = 1;
  }

  // --- counts ---------------------------------------------------------------------------------------
  std::size_t used_pages() const { return used_pages_; }  // pages with refs > 0
  std::size_t mapped_free_pages() const { return mapped_free_; }  // mapped pages with refs == 0
  std::size_t peak_used() const { return peak_used_; }    // most pages used at once
  std::size_t interval_peak_used() const { return interval_peak_used_; }  // since begin_interval
  void begin_interval() { interval_peak_used_ = used_pages_; }
  // Ranges taken so far (wraps): the pages' time of use, and when a free page is due again.
  std::uint32_t clock() const { return clock_; }
  // Ranges in a slow path whose pages are claimed (Page::in_flight) with the engine's lock
  // released at times: a malloc in map_missing, or a map-ahead batch. The invariants hold only
  // when there are none.
  std::size_t claims() const { return claims_; }
  void add_claim() { ++claims_; }
  void end_claim() { --claims_; }
  // The largest free range whose pages are all mapped and ready for its stream.
  std::size_t largest_free_range() const;

 private:
  void note_peak_used() {  // used_pages_ passed interval_peak_used_ (so perhaps peak_used_ too)
    interval_peak_used_ = used_pages_;
    peak_used_ = std::max(peak_used_, used_pages_);
  }

  Arenas& arenas_;
  Streams& streams_;
  ChunkPool chunks_;
  FreedPages freed_;  // where stitching looks for free chunks
  PageRuns runs_;     // large ranges' interior pages, one record each
  std::size_t used_pages_ = 0;
  std::size_t mapped_free_ = 0;
  std::size_t peak_used_ = 0;
  std::size_t interval_peak_used_ = 0;
  std::uint32_t clock_ = 0;
  bool pinning_ = false;  // a capture is under way in this stable engine: ranges taken pin
  std::size_t claims_ = 0;
};

}  // namespace gmem::detail
