// What the engine's tests (engine_test.cpp, engine_limits_test.cpp, engine_streams_test.cpp,
// engine_capture_test.cpp) share: sizes, and the simulated device's options. The step plan and
// fault replay tests take their sizes from here too.
#pragma once

#include <cstddef>

#include "gmem/sim_device.hpp"

namespace gmem {

inline constexpr std::size_t MiB = std::size_t{1} << 20;
inline constexpr std::size_t GiB = std::size_t{1} << 30;

inline SimDeviceOptions device_of(std::size_t capacity, bool immediate = true) {
  SimDeviceOptions o;
  o.capacity = capacity;
  o.streams_complete_immediately = immediate;
  return o;
}

}  // namespace gmem
