// Physical memory: every chunk gmem holds from the device, and the pages it is mapped at.
//
// A chunk may be mapped at several pages at once (aliases, in one arena or in several). This is
// how gmem stitches: a free chunk is mapped where a new block needs memory *without* being
// unmapped where it was, so the layout that a repeating step built stays mapped, and the next
// step finds every page it needs already there: no device calls in steady state. A chunk is busy
// while one of its pages is used (refs > 0); the engine maps a busy chunk nowhere else, so at
// most one of a chunk's pages is used at a time. Aliases cost only virtual address space; each
// chunk keeps at most kMaxMaps of them.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/page_table.hpp"
#include "gmem/device.hpp"

namespace gmem::detail {

struct Chunk {
  static constexpr int kMaxMaps = 4;
  ChunkHandle handle = 0;        // 0: this slot is unused
  std::uint32_t maps = 0;        // pages it is mapped at; 0: spare (held, unmapped)
  std::array<PageId, kMaxMaps> pages{};
};

class ChunkPool {
 public:
  // A chunk just created: registered as spare.
  ChunkId add(ChunkHandle handle);
  // Forgets a spare chunk (the caller releases its handle).
  void remove(ChunkId id);

  Chunk& at(ChunkId id) { return chunks_[id]; }
  const Chunk& at(ChunkId id) const { return chunks_[id]; }
  void add_map(ChunkId id, PageId page);     // maps < kMaxMaps
  void remove_map(ChunkId id, PageId page);  // the page must be one of its maps

  // Held chunks that are mapped nowhere.
  bool has_spare() const { return !spare_.empty(); }
  ChunkId any_spare() const { return spare_.back(); }  // stays spare until add_map
  std::size_t spares() const { return spare_.size(); }

  std::size_t held() const { return held_; }
  std::size_t mapped_pages() const { return mapped_pages_; }
  std::size_t slots() const { return chunks_.size(); }  // ids below this may be in use

 private:
  std::vector<Chunk> chunks_;
  std::vector<ChunkId> unused_ids_;
  std::vector<ChunkId> spare_;
  std::size_t held_ = 0;
  std::size_t mapped_pages_ = 0;
};

}  // namespace gmem::detail
