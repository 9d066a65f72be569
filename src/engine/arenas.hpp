// Arenas: the engine's virtual address reservations, each used by one stream, with the pages of
// each (PageTable). A page anywhere is a PageId (page_table.hpp): arena index and page index.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/backing_client.hpp"
#include "engine/page_table.hpp"
#include "engine/range_allocator.hpp"
#include "engine/streams.hpp"
#include "gmem/device.hpp"

namespace gmem::detail {

// One virtual address reservation, used by one stream.
struct Arena {
  Arena(DevicePtr base, std::size_t size, std::size_t page_count, std::uint32_t stream_index)
      : ranges(base, size), pages(page_count), stream(stream_index) {}
  RangeAllocator ranges;
  PageTable pages;
  std::uint32_t stream;
};

inline constexpr std::uint32_t kNoArena = ~std::uint32_t{0};

// No address space left for a malloc's new arena: Backing turns it into the malloc's
// OutOfMemoryError (it alone knows what the report needs).
struct NoAddressSpace {
  std::size_t min_bytes;
  std::uint32_t stream;  // index
};

class Arenas {
 public:
  Arenas(Device& device, Streams& streams, BackingClient& client, std::size_t page_size)
      : device_(device), streams_(streams), client_(client), page_size_(page_size),
        page_shift_(static_cast<int>(std::countr_zero(page_size))) {}
  ~Arenas() { release_all(); }
  // Gives back every address range (their pages unmapped by then) and forgets the arenas.
  void release_all();
  Arenas(const Arenas&) = delete;
  Arenas& operator=(const Arenas&) = delete;

  std::size_t page_size() const { return page_size_; }
  Streams& streams() const { return streams_; }
  int page_shift() const { return page_shift_; }
  void set_arena_size(std::size_t bytes);  // rounded up to pages

  // A new arena for stream index `si`, at least `min_bytes` large. `listed`: among the stream's
  // arenas, where online placement looks (the plan region is not). The client is told first
  // (BackingClient::arena_added; it may throw, and the arena is then not added). No address
  // space: NoAddressSpace where `for_malloc`, else the device's error.
  std::uint32_t add(std::uint32_t si, std::size_t min_bytes, bool listed, bool for_malloc = true);

  Arena& operator[](std::uint32_t a) { return *arenas_[a]; }
  const Arena& operator[](std::uint32_t a) const { return *arenas_[a]; }
  std::uint32_t size() const { return static_cast<std::uint32_t>(arenas_.size()); }
  bool contains(DevicePtr ptr) const;  // in one of the arenas, or one past its end

  Page& page(PageId id) { return arenas_[arena_of(id)]->pages.at(index_of(id)); }
  const Page& page(PageId id) const { return arenas_[arena_of(id)]->pages.get(index_of(id)); }
  std::uint32_t stream_of(PageId id) const { return arenas_[arena_of(id)]->stream; }
  DevicePtr address(PageId id) const {
    return arenas_[arena_of(id)]->ranges.base() + (DevicePtr{index_of(id)} << page_shift_);
  }
  // The first and last pages of [addr, addr + bytes) in arena `a`.
  std::pair<std::size_t, std::size_t> span(std::uint32_t a, DevicePtr addr, std::size_t bytes) const {
    const DevicePtr base = arenas_[a]->ranges.base();
    return {(addr - base) >> page_shift_, (addr + bytes - 1 - base) >> page_shift_};
  }
  // The pages of [first, last] wholly inside the range at addr (first or last may not be).
  std::pair<std::size_t, std::size_t> interior(std::uint32_t a, DevicePtr addr, std::size_t bytes,
                                               std::size_t first, std::size_t last) const {
    const DevicePtr base = arenas_[a]->ranges.base();
    return {addr == base + (first << page_shift_) ? first : first + 1,
            addr + bytes == base + ((last + 1) << page_shift_) ? last : last - 1};
  }
  // What is mapped now, as [begin, end) ranges by address (adjacent pages merged).
  std::vector<std::pair<DevicePtr, DevicePtr>> mapped_ranges() const;

 private:
  Device& device_;
  Streams& streams_;
  BackingClient& client_;
  const std::size_t page_size_;
  const int page_shift_;
  std::size_t arena_size_ = 0;
  std::vector<std::unique_ptr<Arena>> arenas_;
};

}  // namespace gmem::detail
