// A fixture for tests that write files: a fresh directory per test, named after the process and
// the test (ctest runs tests in parallel), removed with the fixture.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include <unistd.h>

namespace gmem::testing {

class TempFiles : public ::testing::Test {
 protected:
  explicit TempFiles(std::string prefix = "gmem_trace_test_") : prefix_(std::move(prefix)) {}
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           (prefix_ + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // Writes `content` to `name` in the directory; returns its path.
  std::string write(const std::string& name, const std::string& content) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << content;
    return path;
  }

  std::string prefix_;
  std::filesystem::path dir_;
};

}  // namespace gmem::testing
