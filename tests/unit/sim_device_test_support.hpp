// What the simulated device's tests (sim_device_memory_test.cpp, sim_device_streams_test.cpp)
// share: sizes, and the check that a call failed as the CUDA call it stands for.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <string>

#include "gmem/error.hpp"

namespace gmem {

inline constexpr std::size_t kMiB = std::size_t{1} << 20;
inline constexpr std::size_t kGranule = 2 * kMiB;

// Runs `f`, expecting a DeviceError from the named CUDA call.
template <class F>
DeviceError expect_device_error(F&& f, const std::string& call) {
  try {
    f();
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.call(), call) << e.what();
    EXPECT_EQ(e.code(), Errc::device_error);
    return e;
  }
  ADD_FAILURE() << "expected a DeviceError from " << call;
  return DeviceError(call, 0, "none thrown");
}

}  // namespace gmem
