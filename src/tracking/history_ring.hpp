// A fixed-capacity ring of events: pushing never allocates; when full, the oldest is overwritten
// and counted as dropped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gmem::detail {

template <class Event>
class HistoryRing {
 public:
  explicit HistoryRing(std::size_t capacity) : events_(capacity) {}

  std::size_t capacity() const noexcept { return events_.size(); }
  std::size_t size() const noexcept { return size_; }
  std::uint64_t dropped() const noexcept { return dropped_; }

  void push(const Event& event) noexcept {
    if (events_.empty()) return;
    events_[head_] = event;
    if (++head_ == events_.size()) head_ = 0;
    if (size_ < events_.size()) ++size_;
    else ++dropped_;
  }

  // Oldest first.
  template <class Visit>
  void for_each(Visit&& visit) const {
    std::size_t i = size_ < events_.size() ? 0 : head_;
    for (std::size_t n = 0; n < size_; ++n) {
      visit(events_[i]);
      if (++i == events_.size()) i = 0;
    }
  }

 private:
  std::vector<Event> events_;
  std::size_t head_ = 0;
  std::size_t size_ = 0;
  std::uint64_t dropped_ = 0;
};

}  // namespace gmem::detail
