#include "engine/page_backing.hpp"

namespace gmem::detail {

bool PageBacking::take(std::uint32_t arena, DevicePtr addr, std::size_t bytes) {
  PageTable& pages = arenas_[arena].pages;
  const auto [first, last] = arenas_.span(arena, addr, bytes);
  bool ready = true;
  const std::uint32_t now = ++clock_;
  auto take_page = [&](std::size_t i, auto in_runs) {  // in_runs: std::true_type while runs exist
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
    if (p.mapped()) --mapped_free_;
    // Checked in address order with refs already taken, so that one block never gets a chunk
    // twice through two of its pages.
    ready &= p.mapped() && page_ready(arena, i, p);
  };
  if (last - first + 1 >= PageRuns::kMinPages) [[unlikely]] {
    const auto [inner_first, inner_last] = arenas_.interior(arena, addr, bytes, first, last);
    if (const std::uint32_t run = runs_.at(pages, inner_first, inner_last);
        run != PageRuns::kNone && runs_[run].refs == 0) {
      // Taken the same way before: its interior pages are mapped, unaliased, ready.
      if (inner_first != first) take_page(first, std::true_type{});
      PageRun& r = runs_[run];
      const std::size_t n = inner_last - inner_first + 1;
      r.refs = 1;
      r.reuse = now - r.last_use;
      r.last_use = now;
      if ((used_pages_ += n) > interval_peak_used_) note_peak_used();
      mapped_free_ -= n;
      if (inner_last != last) take_page(last, std::true_type{});
      if (ready) [[likely]] return true;
      end_run(run);  // the slow path looks at every page
      return false;
    }
    for (std::size_t i = first; i <= last; ++i) take_page(i, std::true_type{});
    if (!ready) return false;
    runs_.make(arena, pages, inner_first, inner_last);
    return true;
  }
  if (!runs_.any()) [[likely]] {
    for (std::size_t i = first; i <= last; ++i) take_page(i, std::false_type{});
  } else {
    for (std::size_t i = first; i <= last; ++i) take_page(i, std::true_type{});
  }
  return ready;  // the steady state: every page mapped, its chunk free
}

void PageBacking::give_back(std::uint32_t arena, DevicePtr addr, std::size_t bytes,
                            std::uint64_t stamp) {
  PageTable& pages = arenas_[arena].pages;
  const auto [first, last] = arenas_.span(arena, addr, bytes);
  auto put = [&](std::size_t i, auto in_runs) {  // in_runs: std::true_type while runs exist
    Page& p = pages.at(i);
    if constexpr (decltype(in_runs)::value) settle(p);
    // The latest of its blocks' frees: a free held back for other streams comes stamped when it
    // was made, maybe before a neighbour's on the same page.
    p.free_seq = std::max(p.free_seq, stamp);
    drop_ref(arena, i, p);
  };
  if (last - first + 1 >= PageRuns::kMinPages) [[unlikely]] {
    const auto [inner_first, inner_last] = arenas_.interior(arena, addr, bytes, first, last);
    if (const std::uint32_t run = runs_.at(pages, inner_first, inner_last);
        run != PageRuns::kNone && runs_[run].refs == 1) {
      // The run's pages all fall to 0 at once: mapped, and listed as freed already.
      if (inner_first != first) put(first, std::true_type{});
      PageRun& r = runs_[run];
      const std::size_t n = inner_last - inner_first + 1;
      r.refs = 0;
      r.free_seq = stamp;
      used_pages_ -= n;
      mapped_free_ += n;
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

void PageBacking::drop_ref(std::uint32_t arena, std::size_t index, Page& p, bool counted) {
  if (--p.refs > 0) return;
  if (counted) --used_pages_;
  if (!p.mapped()) return;  // a failed malloc's rollback, or a map-ahead's
  ++mapped_free_;
  freed_.add(page_id(arena, static_cast<std::uint32_t>(index)), p);
}

PageId PageBacking::blocking_alias(std::uint32_t arena, std::size_t index, const Page& page) const {
  if (!page.aliased) return kNoPage;  // its chunk was last used here, by this arena's stream
  const std::uint32_t stream = arenas_[arena].stream;
  const PageId self = page_id(arena, static_cast<std::uint32_t>(index));
  const Chunk& chunk = chunks_.at(page.chunk);
  for (std::uint32_t k = 0; k < chunk.maps; ++k) {
    const PageId other = chunk.pages[k];
    if (other == self) continue;
    const Page& p = arenas_.page(other);
    if (p.refs > 0) return other;  // busy through another alias
    if (!streams_.progress.ordered(stream, arenas_.stream_of(other), p.free_seq)) return other;
  }
  return kNoPage;
}

bool PageBacking::chunk_in_use(ChunkId chunk) const {
  const Chunk& c = chunks_.at(chunk);
  for (std::uint32_t k = 0; k < c.maps; ++k)
    if (arenas_.page(c.pages[k]).refs > 0) return true;
  return false;
}

bool PageBacking::chunk_gpu_done(ChunkId chunk) const {
  const Chunk& c = chunks_.at(chunk);
  for (std::uint32_t k = 0; k < c.maps; ++k)
    if (!streams_.progress.done(arenas_.stream_of(c.pages[k]), arenas_.page(c.pages[k]).free_seq))
      return false;
  return true;
}

void PageBacking::note_mapped(std::uint32_t arena, std::size_t index, ChunkId chunk) {
  const PageId id = page_id(arena, static_cast<std::uint32_t>(index));
  Page& p = arenas_[arena].pages.at(index);
  p.chunk = chunk;
  chunks_.add_map(chunk, id);
  const Chunk& c = chunks_.at(chunk);
  if (c.maps > 1)
    for (std::uint32_t k = 0; k < c.maps; ++k) arenas_.page(c.pages[k]).aliased = 1;
  if (p.refs == 0) {
    ++mapped_free_;
    freed_.add(id, p);
  }
}

void PageBacking::note_unmapped(PageId id) {
  Page& p = arenas_.page(id);
  const ChunkId chunk = p.chunk;
  chunks_.remove_map(chunk, id);
  p.chunk = kNoChunk;
  p.aliased = 0;
  if (p.refs == 0) --mapped_free_;
  const Chunk& c = chunks_.at(chunk);
  if (c.maps == 1) arenas_.page(c.pages[0]).aliased = 0;
  // The alias that kept the chunk busy may have been this one: list the chunk again, through a
  // page where it stays (its earlier entries may have been dropped while it was busy).
  if (c.maps > 0 && !chunk_in_use(chunk)) freed_.add(c.pages[0], arenas_.page(c.pages[0]));
}

void PageBacking::pin_used_pages() {
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    PageTable& pages = arenas_[a].pages;
    pages.for_each_touched([&](std::size_t i, const Page&) {
      Page& p = pages.at(i);
      settle(p);
      if (p.refs > 0) p.pinned = 1;
    });
  }
}

std::size_t PageBacking::largest_free_range() const {
  std::size_t best = 0;
  const int shift = arenas_.page_shift();
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    const RangeAllocator& ranges = arenas_[a].ranges;
    const PageTable& pages = arenas_[a].pages;
    for (NodeId id = ranges.first(); id != kNoNode; id = ranges.node(id).next) {
      const RangeNode& n = ranges.node(id);
      if (!n.free) continue;
      std::size_t run = 0;
      for (DevicePtr pos = n.addr, end = n.addr + n.size; pos < end;) {
        const std::size_t i = (pos - ranges.base()) >> shift;
        const DevicePtr page_end = std::min<DevicePtr>(end, ranges.base() + ((i + 1) << shift));
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
