// libgmem.so's C API on a real GPU: the registry opens a CudaDevice for the current device and
// every pointer it returns is real device memory.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "device/cuda_copy.hpp"
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

TEST_F(GpuCApi, CopyAsyncCopiesEveryByteWhateverTheAlignment) {
  // gmem_copy_async by gmem's kernel (its PTX loads on this driver): 16-byte words where both
  // ends are aligned, 4-byte words, or bytes, and a tail; the bytes around the target untouched;
  // on a stream of the caller's, between two gmem blocks of several 2 MiB chunks each.
  if (std::getenv("GMEM_COPY_KERNEL") == nullptr) EXPECT_TRUE(gmem::cuda::copy_kernel_loaded());
  const std::size_t room = 64 * kMiB + 64;
  void* src = nullptr;
  void* dst = nullptr;
  ASSERT_EQ(gmem_malloc(&src, room, -1, 0), GMEM_OK) << gmem_last_error();
  ASSERT_EQ(gmem_malloc(&dst, room, -1, 0), GMEM_OK) << gmem_last_error();
  std::vector<unsigned char> pattern(room), back(room);
  for (std::size_t i = 0; i < room; ++i) pattern[i] = static_cast<unsigned char>(i * 7 + i / 251);
  GPU_CHECK(cudaMemcpy(src, pattern.data(), room, cudaMemcpyHostToDevice));
  cudaStream_t stream = nullptr;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Case {
    std::size_t bytes, to, from;
  };
  const Case cases[] = {{1, 0, 0},        {15, 0, 0},          {16, 0, 0},      {17, 16, 32},
                        {4095, 4, 8},     {4096, 1, 0},        {1000, 3, 7},    {2 * kMiB + 3, 16, 0},
                        {64 * kMiB, 0, 0}, {64 * kMiB + 5, 32, 48}, {5 * kMiB, 2, 2}};
  for (const Case& c : cases) {
    GPU_CHECK(cudaMemset(dst, 0xEE, room));
    auto* to = static_cast<unsigned char*>(dst) + c.to;
    const auto* from = static_cast<const unsigned char*>(src) + c.from;
    ASSERT_EQ(gmem_copy_async(to, from, c.bytes, reinterpret_cast<std::uintptr_t>(stream)), GMEM_OK)
        << gmem_last_error();
    GPU_CHECK(cudaStreamSynchronize(stream));
    GPU_CHECK(cudaMemcpy(back.data(), dst, room, cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < room; ++i) {
      const bool copied = i >= c.to && i < c.to + c.bytes;
      const unsigned char want = copied ? pattern[c.from + (i - c.to)] : 0xEE;
      ASSERT_EQ(back[i], want) << c.bytes << " bytes from +" << c.from << " to +" << c.to
                               << ": byte " << i;
    }
  }
  GPU_CHECK(cudaStreamDestroy(stream));
  ASSERT_EQ(gmem_free(src), GMEM_OK);
  ASSERT_EQ(gmem_free(dst), GMEM_OK);
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
