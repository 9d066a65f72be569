// What the C API's tests (capi_malloc_test.cpp, capi_pools_test.cpp) share: stats and errors
// read through the API, and the fixture that checks each test leaves the shared engine as it was.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "gmem/gmem.h"

namespace gmem::testing {

inline constexpr std::size_t kMiB = std::size_t{1} << 20;
// The simulated device's memory (GMEM_SIM_CAPACITY, set in capi_malloc_test.cpp's main).
inline constexpr std::size_t kSimCapacity = std::size_t{1} << 30;

inline int64_t stat(const char* name) {
  int64_t value = -1;
  EXPECT_EQ(gmem_stat(0, name, &value), GMEM_OK) << gmem_last_error();
  return value;
}

inline std::string last_error() { return gmem_last_error(); }

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// One fixture type for the suite's tests in every file (GoogleTest requires it).
class CApi : public ::testing::Test {
 protected:
  void SetUp() override { allocated_before_ = stat("allocated_bytes.all.current"); }
  void TearDown() override {
    EXPECT_EQ(stat("allocated_bytes.all.current"), allocated_before_) << "test leaked";
    EXPECT_EQ(gmem_set_memory_limit(0, 0), GMEM_OK);
  }
  int64_t allocated_before_ = 0;
};

}  // namespace gmem::testing
