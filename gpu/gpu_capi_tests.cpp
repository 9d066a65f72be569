// libgmem.so's C API on a real GPU: the registry opens a CudaDevice for the current device and
// every pointer it returns is real device memory.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "gmem/gmem.h"
#include "gpu/gpu_kernels.cuh"

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

class GpuCApi : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Before the registry's first use: the real device, or the fallback when asked for.
    const char* device = std::getenv("GMEM_DEVICE");
    if (device == nullptr || std::string(device) != "segment") setenv("GMEM_DEVICE", "cuda", 1);
    GPU_CHECK(cudaSetDevice(0));
    GPU_CHECK(cudaFree(nullptr));
  }
};

TEST_F(GpuCApi, MallocReturnsDeviceMemoryThatHoldsData) {
  void* ptr = nullptr;
  ASSERT_EQ(gmem_malloc(&ptr, 3 * kMiB + 100, -1, 0), GMEM_OK) << gmem_last_error();
  cudaPointerAttributes attributes{};
  GPU_CHECK(cudaPointerGetAttributes(&attributes, ptr));
  EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
  EXPECT_EQ(attributes.device, 0);
  std::vector<unsigned char> host(3 * kMiB + 100, 0);
  GPU_CHECK(cudaMemset(ptr, 0xAB, host.size()));
  GPU_CHECK(cudaMemcpy(host.data(), ptr, host.size(), cudaMemcpyDeviceToHost));
  for (unsigned char byte : host) ASSERT_EQ(byte, 0xAB);
  ASSERT_EQ(gmem_free(ptr), GMEM_OK) << gmem_last_error();
  EXPECT_EQ(gmem_free(ptr), GMEM_ERROR_DOUBLE_FREE);
}

TEST_F(GpuCApi, ForeignPointerIsRejected) {
  void* foreign = nullptr;
  GPU_CHECK(cudaMalloc(&foreign, kMiB));
  EXPECT_EQ(gmem_free(foreign), GMEM_ERROR_INVALID_POINTER);
  EXPECT_NE(std::string(gmem_last_error()).find("gmem_free"), std::string::npos);
  GPU_CHECK(cudaFree(foreign));
}

TEST_F(GpuCApi, LimitGivesOutOfMemoryWithNumbersAndTorchMallocThrows) {
  ASSERT_EQ(gmem_set_memory_limit(0, 64 * kMiB), GMEM_OK) << gmem_last_error();
  void* ptr = nullptr;
  EXPECT_EQ(gmem_malloc(&ptr, 128 * kMiB, 0, 0), GMEM_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(ptr, nullptr);
  EXPECT_NE(std::string(gmem_last_error()).find("64.00 MiB"), std::string::npos)
      << gmem_last_error();
  EXPECT_THROW(gmem_torch_malloc(128 * kMiB, 0, 0), std::exception);
  EXPECT_EQ(gmem_torch_malloc(0, 0, 0), nullptr);
  ASSERT_EQ(gmem_set_memory_limit(0, 0), GMEM_OK);
  void* fits = gmem_torch_malloc(128 * kMiB, 0, 0);
  ASSERT_NE(fits, nullptr);
  gmem_torch_free(fits, 128 * kMiB, 0, 0);
}

TEST_F(GpuCApi, EmptyCacheLowersReservedBytes) {
  void* ptr = nullptr;
  ASSERT_EQ(gmem_malloc(&ptr, 256 * kMiB, 0, 0), GMEM_OK) << gmem_last_error();
  ASSERT_EQ(gmem_free(ptr), GMEM_OK);
  int64_t reserved = 0;
  ASSERT_EQ(gmem_stat(0, "reserved_bytes.all.current", &reserved), GMEM_OK) << gmem_last_error();
  EXPECT_GE(reserved, static_cast<int64_t>(256 * kMiB));
  gmem_torch_empty_cache();
  ASSERT_EQ(gmem_stat(0, "reserved_bytes.all.current", &reserved), GMEM_OK);
  EXPECT_EQ(reserved, 0);
}

TEST_F(GpuCApi, SecondDeviceGetsItsOwnEngineAndFreeFindsIt) {
  int count = 0;
  GPU_CHECK(cudaGetDeviceCount(&count));
  if (count < 2) GTEST_SKIP() << "needs two GPUs; this machine has " << count;
  void* on0 = nullptr;
  void* on1 = nullptr;
  ASSERT_EQ(gmem_malloc(&on0, 8 * kMiB, 0, 0), GMEM_OK) << gmem_last_error();
  ASSERT_EQ(gmem_malloc(&on1, 8 * kMiB, 1, 0), GMEM_OK) << gmem_last_error();
  cudaPointerAttributes attributes{};
  GPU_CHECK(cudaPointerGetAttributes(&attributes, on1));
  EXPECT_EQ(attributes.device, 1);
  int64_t allocated = 0;
  ASSERT_EQ(gmem_stat(1, "allocated_bytes.all.current", &allocated), GMEM_OK);
  EXPECT_EQ(allocated, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(gmem_free(on1), GMEM_OK) << gmem_last_error();  // no device given: found by address
  EXPECT_EQ(gmem_free(on0), GMEM_OK) << gmem_last_error();
  ASSERT_EQ(gmem_stat(1, "allocated_bytes.all.current", &allocated), GMEM_OK);
  EXPECT_EQ(allocated, 0);
}

}  // namespace
