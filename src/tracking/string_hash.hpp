// Transparent string hashing: look up std::string keys by std::string_view without a copy.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace gmem::detail {

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view text) const noexcept {
    return std::hash<std::string_view>{}(text);
  }
  std::size_t operator()(const std::string& text) const noexcept {
    return std::hash<std::string_view>{}(text);
  }
};

}  // namespace gmem::detail
