// Helpers for parsing command line arguments, shared by the gmem subcommands.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace gmem::cli {

// Wrong arguments: main prints "gmem: <message>" and exits 1.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "80G", "1.5GiB", "512M", "64k", "4096": binary units (K = 1024), case-insensitive.
inline std::uint64_t parse_bytes(std::string_view text) {
  auto bad = [&] {
    return UsageError("bad byte count '" + std::string(text) + "' (expected e.g. 80G, 512M or 1048576)");
  };
  double number = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), number);
  if (ec != std::errc{} || end == text.data() || number < 0 || !std::isfinite(number)) throw bad();
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
  else throw bad();
  const double bytes = std::ldexp(number, shift);
  if (bytes >= 18446744073709551616.0 || bytes != std::floor(bytes)) throw bad();
  return static_cast<std::uint64_t>(bytes);
}

// Takes the value of an option such as `--capacity 80G` (args[i] is the option).
inline const std::string& option_value(const std::vector<std::string>& args, std::size_t& i) {
  if (i + 1 >= args.size()) throw UsageError("option " + args[i] + " needs a value");
  return args[++i];
}

}  // namespace gmem::cli
