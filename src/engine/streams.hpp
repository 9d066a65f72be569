// The streams an engine has seen: each one's index (the last one looked up is answered inline:
// one stream per thread is usual), the arenas it allocates from, and how far its work has
// progressed (StreamTracker). A stream costs a map entry and a tracker entry here; its arenas,
// once it allocates, a range allocator and a page-table leaf each.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "engine/stream_tracker.hpp"
#include "gmem/device.hpp"

namespace gmem::detail {

class Streams {
 public:
  explicit Streams(Device& device) : progress(device) {}

  std::uint32_t index(StreamId stream) {
    if (stream == last_ && last_index_ != ~0u) [[likely]] return last_index_;
    return lookup(stream);
  }
  std::vector<std::uint32_t>& arenas(std::uint32_t index) { return arenas_[index]; }
  std::size_t size() const { return arenas_.size(); }

  StreamTracker progress;

 private:
  std::uint32_t lookup(StreamId stream) {  // registers a stream seen for the first time
    auto [it, fresh] = index_.try_emplace(stream, 0);
    if (fresh) {
      try {
        arenas_.emplace_back();
        it->second = progress.add(stream);
      } catch (...) {
        if (arenas_.size() > progress.size()) arenas_.pop_back();
        index_.erase(it);
        throw;
      }
    }
    last_ = stream;
    last_index_ = it->second;
    return it->second;
  }

  std::unordered_map<StreamId, std::uint32_t> index_;
  std::vector<std::vector<std::uint32_t>> arenas_;  // by stream index
  StreamId last_ = 0;
  std::uint32_t last_index_ = ~0u;
};

}  // namespace gmem::detail
