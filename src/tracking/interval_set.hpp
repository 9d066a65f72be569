// A set of disjoint address ranges, coalesced: [begin, end) pairs by address.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>

namespace gmem::detail {

class IntervalSet {
 public:
  void add(std::uintptr_t begin, std::uintptr_t end) {
    if (begin >= end) return;
    auto next = ranges_.lower_bound(begin);
    if (next != ranges_.begin()) {
      auto prev = std::prev(next);
      if (prev->second >= begin) {  // touches or overlaps: merge
        begin = prev->first;
        end = std::max(end, prev->second);
        ranges_.erase(prev);
      }
    }
    while (next != ranges_.end() && next->first <= end) {
      end = std::max(end, next->second);
      next = ranges_.erase(next);
    }
    ranges_.emplace(begin, end);
  }

  void remove(std::uintptr_t begin, std::uintptr_t end) {
    if (begin >= end) return;
    auto it = ranges_.upper_bound(begin);
    if (it != ranges_.begin()) --it;
    while (it != ranges_.end() && it->first < end) {
      const std::uintptr_t b = it->first, e = it->second;
      if (e <= begin) {
        ++it;
        continue;
      }
      it = ranges_.erase(it);
      if (b < begin) ranges_.emplace(b, begin);
      if (e > end) it = ranges_.emplace(end, e).first;
    }
  }

  bool contains(std::uintptr_t addr) const {
    auto it = ranges_.upper_bound(addr);
    if (it == ranges_.begin()) return false;
    --it;
    return addr < it->second;
  }

  const std::map<std::uintptr_t, std::uintptr_t>& ranges() const { return ranges_; }

 private:
  std::map<std::uintptr_t, std::uintptr_t> ranges_;  // begin -> end
};

}  // namespace gmem::detail
