// What the replay tests (replay_traces_test.cpp, replay_steps_test.cpp, replay_lag_test.cpp)
// share: the test data, the GPU lag and granule, and a fixture that writes a trace of its own.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

namespace gmem::trace {

inline constexpr std::size_t kGranule = std::size_t{2} << 20;

inline std::string data_file(const std::string& name) { return std::string(GMEM_TEST_DATA) + "/" + name; }

// Replays model a GPU that runs this far behind the host (gmem replay's default).
inline constexpr double kGpuLagUs = 2000;

// A trace the test writes (a CSV of `rows` under the header line), removed after the test.
class WrittenTrace : public ::testing::Test {
 protected:
  void TearDown() override { std::filesystem::remove(path_); }
  const std::string& write(const std::string& rows) {
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = (std::filesystem::temp_directory_path() /
             ("gmem_replay_test_" + std::string(test->name()) + "_" + std::to_string(::getpid()) + ".csv"))
                .string();
    std::ofstream(path_) << "action,addr,size,stream,time_us,user_frame,lib_frame\n" << rows;
    return path_;
  }
  std::string path_;
};

}  // namespace gmem::trace
