// The places of freed blocks that a CUDA graph may have captured, kept for the next block of
// their size. A graph replays its kernels against the addresses it was captured with, so a
// program that makes a buffer anew under a graph that reads it (transformers makes its static KV
// cache anew in every generate(), and the decoding graph was captured on the first) must find
// the new buffer where the old one was: else cudagraph trees record the graph again, each time
// the buffer moves (on the H100 that made generation 30% slower than PyTorch's allocator).
// Online placement packs by the free ranges of the moment, and those differ with whatever the
// program allocated before the buffer (a prefill of another length), so it does not.
//
// So the engine marks the ranges of the blocks live when a capture begins; when such a block is
// freed, Backing keeps its range taken, out of online placement's reach, and a malloc of the same
// size on the same stream takes it back: the earliest born first, so that the i-th buffer made
// anew lands where the i-th of the freed ones was made (programs make them in the same order;
// they free them in any). A block placed so is marked again. A place not taken back within
// kLifetime range mallocs, or beyond kMaxPlaces, goes back to the free ranges. A kept place holds
// no memory: its pages are free, and their chunks may serve other places meanwhile.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <unordered_map>

#include "engine/range_allocator.hpp"

namespace gmem::detail {

class KeptPlaces {
 public:
  struct Place {
    std::uint32_t arena;
    NodeId node;  // a used range of the arena, with no page references
    DevicePtr addr;
  };
  static constexpr std::uint32_t kLifetime = std::uint32_t{1} << 14;  // range mallocs
  static constexpr std::size_t kMaxPlaces = 4096;

  bool empty() const { return count_ == 0; }
  std::size_t count() const { return count_; }
  std::size_t bytes() const { return bytes_; }

  // Keeps the range of `bytes` of a block born `birth` (Record::birth), freed at `now`
  // (PageBacking::clock: ranges taken). Call expire() after. Births are unique until the counter
  // wraps; should one come round again while kept, the older place is returned, for the caller
  // to give back.
  std::optional<Place> keep(std::size_t bytes, std::uint32_t birth, const Place& place,
                            std::uint32_t now) {
    auto& places = by_size_[bytes];
    order_.push_back({bytes, birth, place.node, now});
    const auto [it, added] = places.emplace(birth, Kept{place, now});
    if (added) {
      ++count_;
      bytes_ += bytes;
      return std::nullopt;
    }
    const Place older = it->second.place;
    it->second = Kept{place, now};
    return older;
  }

  // The place of `bytes` born first among those in an arena `usable(arena)` accepts, no longer
  // kept; nullopt when there is none.
  template <class Usable>
  std::optional<Place> take(std::size_t bytes, Usable&& usable) {
    const auto it = by_size_.find(bytes);
    if (it == by_size_.end()) return std::nullopt;
    for (auto p = it->second.begin(); p != it->second.end(); ++p) {
      if (!usable(p->second.place.arena)) continue;
      const Place place = p->second.place;
      forget(it, p);
      return place;
    }
    return std::nullopt;
  }

  // Gives back (release(place)) the places kept since kLifetime before `now` or longer, and the
  // oldest beyond kMaxPlaces; all of them with `all`.
  template <class Release>
  void expire(std::uint32_t now, Release&& release, bool all = false) {
    while (!order_.empty()) {
      const Ref& oldest = order_.front();
      if (!all && count_ <= kMaxPlaces && now - oldest.since < kLifetime) break;
      const auto it = by_size_.find(oldest.bytes);
      if (it != by_size_.end()) {
        const auto p = it->second.find(oldest.birth);
        // Still kept, and this keeping of it (not a later one of the same birth).
        if (p != it->second.end() && p->second.place.node == oldest.node &&
            p->second.since == oldest.since) {
          const Place place = p->second.place;
          forget(it, p);
          release(place);
        }
      }
      order_.pop_front();
    }
  }

  // Calls visit(bytes, place) for each kept place.
  template <class Visit>
  void for_each(Visit&& visit) const {
    for (const auto& [bytes, places] : by_size_)
      for (const auto& [birth, kept] : places) visit(bytes, kept.place);
  }

 private:
  struct Kept {
    Place place;
    std::uint32_t since;
  };
  using BySize = std::unordered_map<std::size_t, std::map<std::uint32_t, Kept>>;
  void forget(BySize::iterator size, std::map<std::uint32_t, Kept>::iterator place) {
    --count_;
    bytes_ -= size->first;
    size->second.erase(place);
    if (size->second.empty()) by_size_.erase(size);
  }
  struct Ref {  // a keeping, in the order they were made (taken ones are skipped on the way)
    std::size_t bytes;
    std::uint32_t birth;
    NodeId node;
    std::uint32_t since;
  };

  BySize by_size_;
  std::deque<Ref> order_;
  std::size_t count_ = 0;
  std::size_t bytes_ = 0;
};

}  // namespace gmem::detail
