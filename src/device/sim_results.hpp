// What the simulated device and its parts (sim_memory.cpp, sim_streams.cpp, ...) share in their
// checks and errors: the CUDA driver result codes they raise, addresses in hex, powers of two.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace gmem::sim {

constexpr int kInvalidValue = 1;     // CUDA_ERROR_INVALID_VALUE
constexpr int kOutOfMemory = 2;      // CUDA_ERROR_OUT_OF_MEMORY
constexpr int kInvalidHandle = 400;  // CUDA_ERROR_INVALID_HANDLE
constexpr int kUnknown = 999;        // CUDA_ERROR_UNKNOWN

inline std::string hex(std::uintptr_t value) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "0x%jx", static_cast<std::uintmax_t>(value));
  return buffer;
}

inline bool is_power_of_two(std::size_t value) { return value != 0 && (value & (value - 1)) == 0; }

}  // namespace gmem::sim
