// Interns frame strings ("file:line:function") so that each event carries a small index.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace gmem::trace::detail {

class FrameTable {
 public:
  // Appends to `frames`, which starts as {""}: index 0 means "no frame".
  explicit FrameTable(std::vector<std::string>& frames) : frames_(frames) {
    if (frames_.empty()) frames_.emplace_back();
    for (std::uint32_t i = 0; i < frames_.size(); ++i) index_.emplace(frames_[i], i);
  }

  std::uint32_t intern(std::string_view frame) {
    if (frame.empty()) return 0;
    auto it = index_.find(frame);
    if (it != index_.end()) return it->second;
    const auto id = static_cast<std::uint32_t>(frames_.size());
    frames_.emplace_back(frame);
    index_.emplace(std::string(frame), id);
    return id;
  }

 private:
  struct Hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::vector<std::string>& frames_;
  std::unordered_map<std::string, std::uint32_t, Hash, std::equal_to<>> index_;
};

}  // namespace gmem::trace::detail
