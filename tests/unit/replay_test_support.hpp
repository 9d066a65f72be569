// What the replay tests (replay_traces_test.cpp, replay_steps_test.cpp, replay_lag_test.cpp)
// share: the test data, the GPU lag and granule, and a fixture that writes a trace of its own.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <fstream>
#include <optional>
#include <string>

#include "temp_files.hpp"

namespace gmem::trace {

inline constexpr std::size_t kGranule = std::size_t{2} << 20;

inline std::string data_file(const std::string& name) { return std::string(GMEM_TEST_DATA) + "/" + name; }

// Replays model a GPU that runs this far behind the host (gmem replay's default).
inline constexpr double kGpuLagUs = 2000;

// A trace the test writes (a CSV of `rows` under the header line), removed after the test.
class WrittenTrace : public ::testing::Test {
 protected:
  const std::string& write(const std::string& rows) {
    trace_.emplace("trace.csv");
    std::ofstream(trace_->str()) << "action,addr,size,stream,time_us,user_frame,lib_frame\n" << rows;
    return trace_->str();
  }
  const std::string& path() const { return trace_->str(); }

 private:
  std::optional<gmem::testing::TempPath> trace_;
};

}  // namespace gmem::trace
