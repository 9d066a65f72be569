// The pages (granules, 2 MiB) of one arena's virtual range: which physical chunk is mapped at
// each and how many used ranges (blocks, slabs) overlap it. An arena spans the device's size in
// virtual memory, but a stream that allocates little touches few pages, so the table is two
// levels and a leaf of kLeafPages pages is allocated the first time one of its pages is written:
// an idle stream costs a few KiB of host memory, not a page record per granule of its range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace gmem::detail {

// A page anywhere: arena index in the high half, page index within the arena in the low half.
using PageId = std::uint64_t;
inline constexpr PageId kNoPage = ~PageId{0};
inline PageId page_id(std::uint32_t arena, std::uint32_t index) {
  return (PageId{arena} << 32) | index;
}
inline std::uint32_t arena_of(PageId id) { return static_cast<std::uint32_t>(id >> 32); }
inline std::uint32_t index_of(PageId id) { return static_cast<std::uint32_t>(id & 0xffffffffu); }

using ChunkId = std::uint32_t;  // index into the ChunkPool
inline constexpr ChunkId kNoChunk = ~ChunkId{0};

struct Page {
  ChunkId chunk = kNoChunk;    // the chunk mapped here; kNoChunk: nothing mapped
  static constexpr std::uint32_t kMaxClashes = 15;
  std::uint32_t refs : 22 = 0;    // used ranges overlapping the page (a few dozen at most)
  // Mapped ahead of its plan's first use (MapAhead): one of refs is the map-ahead's,
  // handed to the first range that takes the page, or given back when the step ends.
  std::uint32_t ahead : 1 = 0;
  // A CUDA graph may use it (stable pages only: a pool's page under a block live during a
  // capture): it keeps its chunk until the pool's cache is emptied (PageBacking::pin_used_pages).
  std::uint32_t pinned : 1 = 0;
  // Claimed by a malloc in its slow path (Mapper::map_missing) or a map-ahead batch, which
  // release the engine's lock before their maps are made: not usable before they land.
  std::uint32_t in_flight : 1 = 0;
  std::uint32_t aliased : 1 = 0;  // the chunk is mapped at other pages too (ChunkPool)
  // How many times it had to be remapped (its chunk was busy elsewhere), up to kMaxClashes.
  std::uint32_t clashes : 4 = 0;
  std::uint32_t listed : 1 = 0;   // has an entry in the engine's FreedPages
  // In one of PageBacking's page runs: refs, free_seq, last_use and reuse are the run's (this
  // page's are stale), and last_use holds the run's index (page_runs.hpp).
  std::uint32_t in_run : 1 = 0;
  std::uint64_t free_seq = 0;  // the latest free stamp (the arena's stream's) of the blocks on it
  // When the page was last taken into use and how long before that the previous time, on the
  // engine's clock of ranges taken: the page's next use is due at about last_use + reuse.
  std::uint32_t last_use = 0;
  std::uint32_t reuse = 0;
  bool mapped() const { return chunk != kNoChunk; }
};
static_assert(sizeof(Page) == 24);

class PageTable {
 public:
  static constexpr int kLeafShift = 9;  // 512 pages (1 GiB of 2 MiB pages) per leaf
  static constexpr std::size_t kLeafPages = std::size_t{1} << kLeafShift;

  explicit PageTable(std::size_t pages) : leaves_((pages + kLeafPages - 1) >> kLeafShift) {}

  std::size_t size() const { return leaves_.size() << kLeafShift; }
  // The page for writing: its leaf is created on first use.
  Page& at(std::size_t index) {
    std::unique_ptr<Page[]>& leaf = leaves_[index >> kLeafShift];
    if (!leaf) [[unlikely]] leaf = std::make_unique<Page[]>(kLeafPages);
    return leaf[index & (kLeafPages - 1)];
  }
  // The page for reading: a page never written reads as unmapped and unused.
  const Page& get(std::size_t index) const {
    const std::unique_ptr<Page[]>& leaf = leaves_[index >> kLeafShift];
    return leaf ? leaf[index & (kLeafPages - 1)] : kUntouched;
  }
  // Calls visit(index, page) for every page of every leaf allocated so far.
  template <class Visit>
  void for_each_touched(Visit&& visit) const {
    for (std::size_t l = 0; l < leaves_.size(); ++l)
      if (leaves_[l])
        for (std::size_t i = 0; i < kLeafPages; ++i) visit((l << kLeafShift) | i, leaves_[l][i]);
  }
  std::size_t host_bytes() const {
    std::size_t bytes = leaves_.capacity() * sizeof(leaves_[0]);
    for (const auto& leaf : leaves_) bytes += leaf ? kLeafPages * sizeof(Page) : 0;
    return bytes;
  }

 private:
  static inline const Page kUntouched{};
  std::vector<std::unique_ptr<Page[]>> leaves_;
};

}  // namespace gmem::detail
