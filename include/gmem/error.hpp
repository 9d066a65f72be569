// Errors raised by gmem. One exception hierarchy; the C API turns each into a status code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace gmem {

enum class Errc {
  invalid_argument,  // malloc(0), absurd sizes, bad options
  out_of_memory,     // the request cannot be served under the limit / by the device
  invalid_pointer,   // free of a pointer gmem never returned (foreign pointer)
  double_free,       // free of a pointer already freed
  device_error,      // a driver call failed for another reason
  bad_input,         // malformed file (trace, snapshot): carries file and line
};

const char* errc_name(Errc code) noexcept;

class Error : public std::runtime_error {
 public:
  Error(Errc code, const std::string& message) : std::runtime_error(message), code_(code) {}
  Errc code() const noexcept { return code_; }

 private:
  Errc code_;
};

// A driver call failed. `call` names it ("cuMemMap"), `result` is the driver's code.
class DeviceError : public Error {
 public:
  DeviceError(std::string call, int result, const std::string& detail);
  const std::string& call() const noexcept { return call_; }
  int result() const noexcept { return result_; }
  // True when the device itself reported out-of-memory (cuMemCreate → CUDA_ERROR_OUT_OF_MEMORY).
  bool device_out_of_memory() const noexcept { return out_of_memory_; }
  static DeviceError out_of_memory(std::string call, int result, const std::string& detail);

 private:
  std::string call_;
  int result_;
  bool out_of_memory_ = false;
};

// Everything a user needs to know about a failed malloc, captured at the moment it failed.
struct OomInfo {
  std::size_t requested = 0;           // bytes asked for
  std::uintptr_t stream = 0;
  std::size_t limit = 0;               // gmem's memory limit in force
  std::size_t device_total = 0;        // device memory in total
  std::size_t device_free = 0;         // free on the device, as the driver says
  std::size_t reserved = 0;            // physical memory gmem holds
  std::size_t allocated = 0;           // bytes handed out and live
  std::size_t largest_free_range = 0;  // largest free virtual range already backed by gmem's memory
  std::size_t reclaimable = 0;         // free physical memory gmem could still have stitched
  std::string reason;                  // "limit" or "device"
};

class OutOfMemoryError : public Error {
 public:
  explicit OutOfMemoryError(OomInfo info);
  const OomInfo& info() const noexcept { return info_; }

 private:
  OomInfo info_;
};

// Malformed input file: names the file and 1-based line (0 when not line-oriented).
class BadInputError : public Error {
 public:
  BadInputError(std::string file, std::size_t line, const std::string& problem);
  const std::string& file() const noexcept { return file_; }
  std::size_t line() const noexcept { return line_; }

 private:
  std::string file_;
  std::size_t line_;
};

// Formats a byte count for people: "1.50 GiB", "512 B".
std::string format_bytes(std::uint64_t bytes);

}  // namespace gmem
