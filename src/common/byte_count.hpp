// Byte counts as people write them: "80G", "1.5GiB", "512M", "64k", "4096" (binary units,
// K = 1024, case-insensitive; an optional B or iB). Shared by the CLI's options and the library's
// environment variables (GMEM_PAGE_SIZE), each of which words its own error.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace gmem {

// The count, or nullopt for anything else (negative, fractional bytes, an unknown unit, > 2^64).
inline std::optional<std::uint64_t> parse_byte_count(std::string_view text) {
  double number = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), number);
  if (ec != std::errc{} || end == text.data() || number < 0 || !std::isfinite(number)) return std::nullopt;
  std::string unit(end, text.data() + text.size());
  for (char& c : unit) c = static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
  if (unit.ends_with("IB")) unit.resize(unit.size() - 2);
  else if (unit.size() > 1 && unit.ends_with("B")) unit.pop_back();
  int shift = 0;
  if (unit.empty() || unit == "B") shift = 0;
  else if (unit == "K") shift = 10;
  else if (unit == "M") shift = 20;
  else if (unit == "G") shift = 30;
  else if (unit == "T") shift = 40;
  else return std::nullopt;
  const double bytes = std::ldexp(number, shift);
  if (bytes >= 18446744073709551616.0 || bytes != std::floor(bytes)) return std::nullopt;
  return static_cast<std::uint64_t>(bytes);
}

}  // namespace gmem
