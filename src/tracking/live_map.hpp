// The tracker's live allocations by address: open addressing with linear probing and
// backward-shift deletion (as the engine's PointerMap), with the two operations the hot path
// needs done in one probe each: insert-or-replace, and erase-if-present.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gmem::detail {

template <class Value>
class LiveMap {
 public:
  LiveMap() : slots_(1024) {}

  std::size_t size() const noexcept { return size_; }

  // Stores `value` under `key` (nonzero); returns the value it replaced, if any, in `old`.
  bool put(std::uintptr_t key, const Value& value, Value& old) {
    if ((size_ + 1) * 4 > slots_.size() * 3) grow();
    std::size_t i = index(key);
    for (; slots_[i].key != 0; i = (i + 1) & mask()) {
      if (slots_[i].key == key) {
        old = slots_[i].value;
        slots_[i].value = value;
        return true;
      }
    }
    slots_[i].key = key;
    slots_[i].value = value;
    ++size_;
    return false;
  }

  // Removes `key` and returns its value in `out`; false when absent.
  bool take(std::uintptr_t key, Value& out) noexcept {
    std::size_t i = index(key);
    for (;; i = (i + 1) & mask()) {
      if (slots_[i].key == key) break;
      if (slots_[i].key == 0) return false;
    }
    out = slots_[i].value;
    // Backward shift: pull later entries of the probe run into the hole.
    for (std::size_t j = (i + 1) & mask();; j = (j + 1) & mask()) {
      if (slots_[j].key == 0) break;
      const std::size_t home = index(slots_[j].key);
      if (((j - home) & mask()) >= ((j - i) & mask())) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].key = 0;
    --size_;
    return true;
  }

  template <class Visit>
  void for_each(Visit&& visit) const {
    for (const Slot& s : slots_)
      if (s.key != 0) visit(s.key, s.value);
  }

 private:
  struct Slot {
    std::uintptr_t key = 0;
    Value value{};
  };
  std::size_t mask() const noexcept { return slots_.size() - 1; }
  // Blocks are 512-byte aligned: drop those bits, then spread with a Fibonacci hash.
  std::size_t index(std::uintptr_t key) const noexcept {
    return static_cast<std::size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & mask();
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old) {
      if (s.key == 0) continue;
      std::size_t i = index(s.key);
      while (slots_[i].key != 0) i = (i + 1) & mask();
      slots_[i] = s;
    }
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
};

}  // namespace gmem::detail
