// What the fuzz targets share: read limits low enough that libFuzzer's memory limit (2 GB) and
// its per-input timeout are never the reason an input stops, and the one exception a reader may
// throw. Any other exception, a crash or a sanitizer report is a bug.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gmem/error.hpp"
#include "gmem/trace.hpp"

namespace gmem::fuzz {

inline trace::ReadLimits fuzz_limits() {
  trace::ReadLimits limits;
  limits.max_bytes = 8 << 20;
  limits.max_line = 64 << 10;
  limits.max_fields = 256;
  limits.max_events = 200'000;
  limits.max_frames = 1000;
  limits.max_memo_refs = 100'000;
  limits.max_objects = 1'000'000;
  return limits;
}

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// Runs `read`; malformed input must end in BadInputError naming the file.
template <class Read>
int run_reader(Read read) {
  try {
    read();
  } catch (const BadInputError& e) {
    if (e.file() != "fuzz") __builtin_trap();
  }
  return 0;
}

}  // namespace gmem::fuzz
