// Files that tests write, named after the process and the test (ctest runs tests in parallel),
// and removed when the test is done with them: a fixture's directory, or one path.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <utility>

#include <unistd.h>

namespace gmem::testing {

// A fresh directory per test, removed with the fixture.
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

// A path in the temp directory for the running test, whose file goes when the path does.
class TempPath {
 public:
  explicit TempPath(const std::string& name)
      : path_((std::filesystem::temp_directory_path() /
               ("gmem_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) +
                "_" + std::to_string(::getpid()) + "_" + name))
                  .string()) {}
  TempPath(TempPath&& other) noexcept : path_(std::exchange(other.path_, {})) {}
  TempPath& operator=(TempPath&&) = delete;
  ~TempPath() {
    std::error_code ignored;  // never written, or already gone
    if (!path_.empty()) std::filesystem::remove(path_, ignored);
  }
  const std::string& str() const { return path_; }
  operator const std::string&() const { return path_; }

 private:
  std::string path_;
};

}  // namespace gmem::testing
