// Which Python frames are the user's own program (not torch, not an installed package): the
// frame a report should name, for snapshots read from files and for live tracking alike.
#pragma once

#include <string_view>

namespace gmem::detail {

inline bool is_user_python_file(std::string_view file) {
  const bool python = file.ends_with(".py") || file.starts_with("<");  // "<stdin>": not C++
  return python && file.find("site-packages/") == std::string_view::npos &&
         file.find("dist-packages/") == std::string_view::npos &&
         file.find("/torch/") == std::string_view::npos && !file.starts_with("torch/");
}

}  // namespace gmem::detail
