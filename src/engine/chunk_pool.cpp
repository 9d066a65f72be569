#include "engine/chunk_pool.hpp"

#include <algorithm>
#include <cassert>

namespace gmem::detail {

ChunkId ChunkPool::add(ChunkHandle handle) {
  ChunkId id;
  if (!unused_ids_.empty()) {
    id = unused_ids_.back();
    unused_ids_.pop_back();
  } else {
    id = static_cast<ChunkId>(chunks_.size());
    chunks_.emplace_back();
  }
  spare_.reserve(held_ + 1);  // every chunk can be spare at once: remove_map never allocates
  chunks_[id] = Chunk{handle, 0, {}};
  spare_.push_back(id);
  ++held_;
  return id;
}

void ChunkPool::remove(ChunkId id) {
  assert(chunks_[id].maps == 0);
  auto it = std::find(spare_.rbegin(), spare_.rend(), id);
  assert(it != spare_.rend());
  spare_.erase(std::next(it).base());
  chunks_[id] = Chunk{};
  unused_ids_.push_back(id);
  --held_;
}

void ChunkPool::add_map(ChunkId id, PageId page) {
  Chunk& c = chunks_[id];
  assert(c.maps < Chunk::kMaxMaps);
  if (c.maps == 0) {  // no longer spare (any_spare() hands out the last one: found at once)
    auto it = std::find(spare_.rbegin(), spare_.rend(), id);
    assert(it != spare_.rend());
    spare_.erase(std::next(it).base());
  }
  c.pages[c.maps++] = page;
  ++mapped_pages_;
}

void ChunkPool::remove_map(ChunkId id, PageId page) {
  Chunk& c = chunks_[id];
  auto end = c.pages.begin() + c.maps;
  auto it = std::find(c.pages.begin(), end, page);
  assert(it != end);
  *it = *(end - 1);
  --c.maps;
  --mapped_pages_;
  if (c.maps == 0) spare_.push_back(id);  // capacity reserved in add()
}

}  // namespace gmem::detail
