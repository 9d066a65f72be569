// Strings from outside (file names, symbols, annotations) may not be valid UTF-8; JSON readers
// and Python's unpickler reject such bytes. Invalid sequences become U+FFFD.
#pragma once

#include <string>
#include <string_view>

namespace gmem::detail {

inline bool valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (std::size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    if (n == 2 && c < 0xC2) return false;  // overlong
    if (n == 3) {
      const auto c1 = static_cast<unsigned char>(s[i + 1]);
      if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 >= 0xA0)) return false;  // overlong, surrogate
    }
    if (n == 4) {
      const auto c1 = static_cast<unsigned char>(s[i + 1]);
      if ((c == 0xF0 && c1 < 0x90) || c > 0xF4 || (c == 0xF4 && c1 >= 0x90)) return false;
    }
    i += n;
  }
  return true;
}

// `s` itself when valid, else with each byte of an invalid sequence replaced.
inline std::string to_utf8(std::string_view s) {
  if (valid_utf8(s)) return std::string(s);
  std::string out;
  for (std::size_t i = 0; i < s.size();) {
    std::size_t n = 1;
    for (std::size_t len = 4; len >= 1; --len)
      if (i + len <= s.size() && valid_utf8(s.substr(i, len))) {
        n = len;
        break;
      }
    if (n == 1 && static_cast<unsigned char>(s[i]) >= 0x80) out += "\xEF\xBF\xBD";
    else out.append(s.substr(i, n));
    i += n;
  }
  return out;
}

}  // namespace gmem::detail
