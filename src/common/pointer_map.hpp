// Live allocations by pointer, for the engine and the tracker: open addressing with linear
// probing and backward-shift deletion, so lookups on the hot path touch one or two cache lines
// and never allocate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gmem::detail {

template <class Value>
class PointerMap {
 public:
  PointerMap() : slots_(1024) {}

  std::size_t size() const noexcept { return size_; }

  // nullptr when absent; 0, the mark of an empty slot, is never a key.
  Value* find(std::uintptr_t key) noexcept {
    if (key == 0) [[unlikely]] return nullptr;
    for (std::size_t i = index(key);; i = (i + 1) & mask()) {
      Slot& s = slots_[i];
      if (s.key == key) return &s.value;
      if (s.key == 0) return nullptr;
    }
  }
  const Value* find(std::uintptr_t key) const noexcept { return const_cast<PointerMap*>(this)->find(key); }

  // `key` must be nonzero and absent.
  void insert(std::uintptr_t key, const Value& value) {
    if ((size_ + 1) * 4 > slots_.size() * 3) grow();
    place(key, value);
    ++size_;
  }

  // Stores `value` under `key` (nonzero) in one probe; true, with the replaced value in `old`,
  // when `key` was present.
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

  // Removes `key` into `value`; false (and nothing changed) when absent.
  bool take(std::uintptr_t key, Value& value) noexcept {
    std::size_t i = index(key);
    for (;; i = (i + 1) & mask()) {
      if (slots_[i].key == key) break;
      if (slots_[i].key == 0) return false;
    }
    value = slots_[i].value;
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

  template <class F>
  void for_each(F&& visit) const {
    for (const Slot& s : slots_)
      if (s.key != 0) visit(s.key, s.value);
  }
  template <class F>
  void for_each_mutable(F&& visit) {
    for (Slot& s : slots_)
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
  void place(std::uintptr_t key, const Value& value) noexcept {
    std::size_t i = index(key);
    while (slots_[i].key != 0) i = (i + 1) & mask();
    slots_[i].key = key;
    slots_[i].value = value;
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old)
      if (s.key != 0) place(s.key, s.value);
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
};

}  // namespace gmem::detail
