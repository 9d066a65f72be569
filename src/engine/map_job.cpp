#include "engine/map_job.hpp"

namespace gmem::detail {

void MapCalls::run(MapJob& job) noexcept {
  std::lock_guard order(calls_order_);  // no unmap between a map and its set_access
  try {
    for (; job.mapped < job.pages.size(); ++job.mapped)
      device_.map(address(job, job.mapped), page_size(), job.chunks[job.mapped]);
    job.for_each_run(job.pages.size(), [&](std::size_t k, std::size_t count) {
      device_.set_access(address(job, k), count << page_shift_);
      job.accessible = k + count;
    });
  } catch (...) {
    job.error = std::current_exception();
    // Undone before calls_order_ is let go: a map left without its access while another
    // thread unmaps an alias of its chunk is what breaks the chunk.
    for (std::size_t k = job.mapped; k-- > 0;) {
      try {
        device_.unmap(address(job, k), page_size());
        job.undone[k] = 1;
      } catch (...) {  // stays mapped: a page like any other, its chunk free once unref'd
        if (k >= job.accessible) {
          try {  // ... so it needs its access (a block may be placed on it)
            device_.set_access(address(job, k), page_size());
          } catch (...) {  // both failed: the device is failing; the books say mapped
          }
        }
      }
    }
  }
}

bool MapCalls::land(const MapJob& job) {
  if (!job.error) [[likely]] {
    if (observer_)
      job.for_each_run(job.pages.size(), [&](std::size_t k, std::size_t count) {
        observer_->on_map(address(job, k), count << page_shift_);
      });
    return true;
  }
  // The device failed: what it did not map is taken back from the books, as are the maps
  // run() undid (device calls made: counted).
  forget(job, job.mapped);
  for (std::size_t k = job.mapped; k-- > 0;) {
    if (job.undone[k]) {
      pages_.note_unmapped(page_id(job.arena, job.pages[k]));
      ++accounting_.stats.num_unmaps;
    } else if (observer_) {  // stays mapped: told like any map, as its unmap will be
      observer_->on_map(address(job, k), page_size());
    }
  }
  return false;
}

void MapCalls::forget(const MapJob& job, std::size_t from) {
  for (std::size_t k = job.pages.size(); k-- > from;) {
    pages_.note_unmapped(page_id(job.arena, job.pages[k]));
    --accounting_.stats.num_maps;
  }
}

}  // namespace gmem::detail
