// A fixed-capacity ring of events: pushing never allocates; when full, the oldest is overwritten
// and counted as dropped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace gmem::detail {

template <class Event>
class HistoryRing {
 public:
  explicit HistoryRing(std::size_t capacity)
      : events_(capacity ? std::make_unique<Event[]>(capacity) : nullptr), capacity_(capacity) {}

  std::size_t capacity() const noexcept { return capacity_; }
  std::size_t size() const noexcept { return laps_ ? capacity_ : head_; }
  std::uint64_t dropped() const noexcept { return laps_ ? (laps_ - 1) * capacity_ + head_ : 0; }

  // On the engine's hot path: a store and one counter.
  void push(const Event& event) noexcept {
    if (capacity_ == 0) return;
    events_[head_] = event;
    if (++head_ == capacity_) head_ = 0, ++laps_;
  }

  // Oldest first.
  template <class Visit>
  void for_each(Visit&& visit) const {
    const std::size_t n = size();
    std::size_t i = laps_ ? head_ : 0;
    for (std::size_t k = 0; k < n; ++k) {
      visit(events_[i]);
      if (++i == capacity_) i = 0;
    }
  }

 private:
  std::unique_ptr<Event[]> events_;  // not a vector: its size() divides on every push
  std::size_t capacity_;
  std::size_t head_ = 0;     // where the next event goes
  std::uint64_t laps_ = 0;   // times the ring was filled: laps_ * capacity_ + head_ were pushed
};

}  // namespace gmem::detail
