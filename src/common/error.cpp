// gmem's exceptions: each builds its one-line message from the facts it carries.
#include "gmem/error.hpp"

#include <array>
#include <cstdio>
#include <utility>

namespace gmem {

const char* errc_name(Errc code) noexcept {
  switch (code) {
    case Errc::invalid_argument: return "invalid_argument";
    case Errc::out_of_memory: return "out_of_memory";
    case Errc::invalid_pointer: return "invalid_pointer";
    case Errc::double_free: return "double_free";
    case Errc::device_error: return "device_error";
    case Errc::bad_input: return "bad_input";
  }
  return "unknown";
}

namespace {

std::string device_message(const std::string& call, int result, const std::string& detail) {
  std::string message = call + " failed (code " + std::to_string(result) + ")";
  if (!detail.empty()) message += ": " + detail;
  return message;
}

// Streams are pointers in CUDA: hex reads better than a long decimal.
std::string format_stream(std::uintptr_t stream) {
  if (stream == 0) return "0";
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "0x%jx", static_cast<std::uintmax_t>(stream));
  return buffer;
}

std::string oom_message(const OomInfo& info) {
  std::string message = "out of memory: tried to allocate " + format_bytes(info.requested) +
                        " on stream " + format_stream(info.stream) + "; gmem holds " +
                        format_bytes(info.reserved) + " reserved (" + format_bytes(info.allocated) +
                        " allocated), largest free range " + format_bytes(info.largest_free_range) +
                        ", limit " + format_bytes(info.limit) + ", device total " +
                        format_bytes(info.device_total) + " with " +
                        format_bytes(info.device_free) + " free";
  if (!info.reason.empty()) message += " (" + info.reason + ")";
  return message;
}

std::string bad_input_message(const std::string& file, std::size_t line,
                              const std::string& problem) {
  std::string where = line == 0 ? file : file + ":" + std::to_string(line);
  return where + ": " + problem;
}

}  // namespace

DeviceError::DeviceError(std::string call, int result, const std::string& detail)
    : Error(Errc::device_error, device_message(call, result, detail)),
      call_(std::move(call)),
      result_(result) {}

DeviceError DeviceError::out_of_memory(std::string call, int result, const std::string& detail) {
  DeviceError error(std::move(call), result, detail);
  error.out_of_memory_ = true;
  return error;
}

OutOfMemoryError::OutOfMemoryError(OomInfo info)
    : Error(Errc::out_of_memory, oom_message(info)), info_(std::move(info)) {}

BadInputError::BadInputError(std::string file, std::size_t line, const std::string& problem)
    : Error(Errc::bad_input, bad_input_message(file, line, problem)),
      file_(std::move(file)),
      line_(line) {}

std::string format_bytes(std::uint64_t bytes) {
  if (bytes < 1024) return std::to_string(bytes) + " B";
  static constexpr std::array<const char*, 6> kUnits = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(bytes) / 1024.0;
  std::size_t unit = 0;
  // Move up while the value would print as 1024.00 or more in this unit.
  while (unit + 1 < kUnits.size() && value >= 1023.995) {
    value /= 1024.0;
    ++unit;
  }
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.2f %s", value, kUnits[unit]);
  return buffer;
}

}  // namespace gmem
