// The C API through libgmem.so over the simulated device (GMEM_DEVICE=sim, set in main before
// the first call): malloc and free, errors, stats, limits, the torch entry points, threads.
// Every test leaves the one shared engine as it found it: nothing live, no limit.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "capi_test_support.hpp"
#include "gmem/gmem.h"

namespace {

using gmem::testing::CApi;
using gmem::testing::contains;
using gmem::testing::kMiB;
using gmem::testing::kSimCapacity;
using gmem::testing::last_error;
using gmem::testing::stat;

TEST_F(CApi, MallocAndFreeRoundTripUpdatesStats) {
  void* ptr = nullptr;
  ASSERT_EQ(gmem_malloc(&ptr, 1000, -1, 0), GMEM_OK) << last_error();
  ASSERT_NE(ptr, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(ptr) % 512, 0u);
  EXPECT_EQ(stat("allocated_bytes.all.current"), allocated_before_ + 1024);  // rounded to 512
  EXPECT_GE(stat("requested_bytes.all.current"), 1000);
  ASSERT_EQ(gmem_free(ptr), GMEM_OK) << last_error();
  EXPECT_EQ(stat("allocated_bytes.all.current"), allocated_before_);
}

TEST_F(CApi, LargeAndSmallBlocksDoNotOverlap) {
  std::vector<std::pair<std::uintptr_t, std::size_t>> blocks;
  for (std::size_t size : {std::size_t{512}, std::size_t{4096}, kMiB, kMiB + 1, 5 * kMiB, 64 * kMiB}) {
    void* ptr = nullptr;
    ASSERT_EQ(gmem_malloc(&ptr, size, 0, 0), GMEM_OK) << last_error();
    blocks.emplace_back(reinterpret_cast<std::uintptr_t>(ptr), size);
  }
  for (const auto& [a, a_size] : blocks) {
    for (const auto& [b, b_size] : blocks) {
      if (a != b) EXPECT_TRUE(a + a_size <= b || b + b_size <= a) << a << " and " << b;
    }
  }
  for (const auto& [ptr, size] : blocks) EXPECT_EQ(gmem_free(reinterpret_cast<void*>(ptr)), GMEM_OK);
}

TEST_F(CApi, BadArgumentsAreRejectedWithAMessage) {
  void* ptr = nullptr;
  EXPECT_EQ(gmem_malloc(&ptr, 0, 0, 0), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "gmem_malloc")) << last_error();
  EXPECT_EQ(gmem_malloc(nullptr, 100, 0, 0), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "ptr is NULL")) << last_error();
  EXPECT_EQ(gmem_malloc(&ptr, 100, 1, 0), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "device 1 does not exist")) << last_error();
  EXPECT_EQ(ptr, nullptr);
  EXPECT_EQ(gmem_empty_cache(7), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gmem_mark_step(7), GMEM_ERROR_INVALID_ARGUMENT);
  // -1 is the current device; no other negative number is a device.
  EXPECT_EQ(gmem_malloc(&ptr, 100, -7, 0), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "device -7")) << last_error();
  EXPECT_EQ(gmem_malloc(&ptr, 100, -1, 0), GMEM_OK);
  EXPECT_EQ(gmem_free(ptr), GMEM_OK);
  // Limits that would quietly mean "no limit" are refused.
  EXPECT_EQ(gmem_set_memory_fraction(0, 1e-12), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "less than one")) << last_error();
  EXPECT_EQ(gmem_set_memory_limit(0, SIZE_MAX), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "more than the device")) << last_error();
  int64_t limit = 0;
  EXPECT_EQ(gmem_stat(0, "gmem.memory_limit", &limit), GMEM_OK);
  EXPECT_GT(limit, 0);
}

TEST_F(CApi, ForeignPointerIsAnInvalidPointer) {
  int on_the_stack = 0;
  EXPECT_EQ(gmem_free(&on_the_stack), GMEM_ERROR_INVALID_POINTER);
  EXPECT_TRUE(contains(last_error(), "gmem_free")) << last_error();
  EXPECT_EQ(gmem_record_stream(&on_the_stack, 1), GMEM_ERROR_INVALID_POINTER);
  void* live = nullptr;
  ASSERT_EQ(gmem_malloc(&live, 4096, 0, 0), GMEM_OK);
  EXPECT_EQ(gmem_record_stream(live, UINTPTR_MAX), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "not a CUDA stream handle")) << last_error();
  void* never = nullptr;
  EXPECT_EQ(gmem_malloc(&never, 4096, 0, 0x1234), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(never, nullptr);
  EXPECT_EQ(gmem_free(live), GMEM_OK);
  EXPECT_EQ(gmem_free(live), GMEM_ERROR_DOUBLE_FREE);
  EXPECT_EQ(gmem_record_stream(live, 0), GMEM_ERROR_DOUBLE_FREE);
  EXPECT_TRUE(contains(last_error(), "gmem_record_stream")) << last_error();
}

TEST_F(CApi, DoubleFreeIsReported) {
  for (std::size_t size : {std::size_t{256}, 3 * kMiB}) {
    void* ptr = nullptr;
    ASSERT_EQ(gmem_malloc(&ptr, size, 0, 0), GMEM_OK) << last_error();
    ASSERT_EQ(gmem_free(ptr), GMEM_OK);
    EXPECT_EQ(gmem_free(ptr), GMEM_ERROR_DOUBLE_FREE) << "size " << size;
    EXPECT_TRUE(contains(last_error(), "gmem_free")) << last_error();
  }
  EXPECT_EQ(gmem_free(nullptr), GMEM_OK);  // like free(NULL)
}

TEST_F(CApi, LastErrorIsKeptPerThread) {
  int foreign = 0;
  ASSERT_EQ(gmem_free(&foreign), GMEM_ERROR_INVALID_POINTER);
  const std::string mine = last_error();
  std::string theirs;
  std::thread([&] {
    theirs = last_error();
    void* ptr = nullptr;
    EXPECT_EQ(gmem_malloc(&ptr, 0, 0, 0), GMEM_ERROR_INVALID_ARGUMENT);
  }).join();
  EXPECT_EQ(theirs, "");
  EXPECT_EQ(last_error(), mine);
}

TEST_F(CApi, StatByNameAndUnknownNames) {
  void* ptr = nullptr;
  ASSERT_EQ(gmem_malloc(&ptr, 3 * kMiB, 0, 0), GMEM_OK) << last_error();
  EXPECT_EQ(stat("allocated_bytes.large_pool.current") - 0, stat("allocated_bytes.all.current") -
                                                                stat("allocated_bytes.small_pool.current"));
  EXPECT_GE(stat("reserved_bytes.all.current"), static_cast<int64_t>(3 * kMiB));
  EXPECT_EQ(stat("gmem.granularity"), static_cast<int64_t>(2 * kMiB));
  int64_t value = 0;
  EXPECT_EQ(gmem_stat(0, "no_such_stat", &value), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "no_such_stat")) << last_error();
  EXPECT_EQ(gmem_stat(0, nullptr, &value), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gmem_stat(0, "num_ooms", nullptr), GMEM_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(gmem_free(ptr), GMEM_OK);
}

TEST_F(CApi, StatsTextListsEveryStatAndReportsTheSizeNeeded) {
  size_t needed = 0;
  ASSERT_EQ(gmem_stats_text(0, nullptr, 0, &needed), GMEM_OK) << last_error();
  ASSERT_GT(needed, 1u);
  std::string text(needed, 'x');
  size_t needed_again = 0;
  ASSERT_EQ(gmem_stats_text(0, text.data(), text.size(), &needed_again), GMEM_OK);
  EXPECT_EQ(needed_again, needed);
  EXPECT_EQ(text.back(), '\0');
  EXPECT_EQ(text.find('\0'), needed - 1);
  const std::string line =
      "\nallocated_bytes.all.current " + std::to_string(stat("allocated_bytes.all.current")) + "\n";
  EXPECT_TRUE(contains("\n" + text, line)) << text;
  EXPECT_TRUE(contains(text, "\ngmem.num_stitches ")) << text;

  char small[10];
  ASSERT_EQ(gmem_stats_text(0, small, sizeof small, &needed_again), GMEM_OK);
  EXPECT_EQ(std::string(small), text.substr(0, 9));  // truncated, terminated
  EXPECT_EQ(needed_again, needed);
  EXPECT_EQ(gmem_stats_text(0, nullptr, 5, &needed_again), GMEM_ERROR_INVALID_ARGUMENT);
}

TEST_F(CApi, MemorySummaryShowsTheLiveAllocation) {
  void* ptr = nullptr;
  ASSERT_EQ(gmem_malloc(&ptr, 300 * kMiB, 0, 0), GMEM_OK) << last_error();
  size_t needed = 0;
  ASSERT_EQ(gmem_memory_summary(-1, nullptr, 0, &needed), GMEM_OK) << last_error();
  std::string summary(needed, '\0');
  ASSERT_EQ(gmem_memory_summary(-1, summary.data(), summary.size(), nullptr), GMEM_OK);
  summary.resize(needed - 1);
  EXPECT_TRUE(contains(summary, "memory summary, device 0")) << summary;
  EXPECT_TRUE(contains(summary, "Allocated memory")) << summary;
  EXPECT_TRUE(contains(summary, "307200 KiB")) << summary;  // the live 300 MiB, PyTorch-style
  ASSERT_EQ(gmem_free(ptr), GMEM_OK);
  EXPECT_EQ(gmem_memory_summary(3, nullptr, 0, &needed), GMEM_ERROR_INVALID_ARGUMENT);
}

TEST_F(CApi, LimitGivesOutOfMemoryWithTheNumbersInTheMessage) {
  const int64_t ooms = stat("num_ooms");
  ASSERT_EQ(gmem_set_memory_limit(0, 64 * kMiB), GMEM_OK) << last_error();
  EXPECT_EQ(stat("gmem.memory_limit"), static_cast<int64_t>(64 * kMiB));
  void* ptr = reinterpret_cast<void*>(1);
  EXPECT_EQ(gmem_malloc(&ptr, 100 * kMiB, 0, 0), GMEM_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(ptr, nullptr);
  const std::string message = last_error();
  EXPECT_TRUE(contains(message, "100.00 MiB")) << message;  // requested
  EXPECT_TRUE(contains(message, "64.00 MiB")) << message;   // limit
  EXPECT_TRUE(contains(message, "1.00 GiB")) << message;    // device total
  EXPECT_EQ(stat("num_ooms"), ooms + 1);
  // Recovery: lift the limit and the same request succeeds.
  ASSERT_EQ(gmem_set_memory_limit(0, 0), GMEM_OK);
  ASSERT_EQ(gmem_malloc(&ptr, 100 * kMiB, 0, 0), GMEM_OK) << last_error();
  EXPECT_EQ(gmem_free(ptr), GMEM_OK);
}

TEST_F(CApi, MemoryFractionSetsTheLimitFromTheDeviceTotal) {
  ASSERT_EQ(gmem_set_memory_fraction(0, 0.25), GMEM_OK) << last_error();
  EXPECT_EQ(stat("gmem.memory_limit"), static_cast<int64_t>(kSimCapacity / 4));
  void* ptr = nullptr;
  EXPECT_EQ(gmem_malloc(&ptr, kSimCapacity / 4 + 2 * kMiB, 0, 0), GMEM_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(gmem_set_memory_fraction(0, 1.5), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gmem_set_memory_fraction(0, 0.0), GMEM_ERROR_INVALID_ARGUMENT);
}

TEST_F(CApi, EmptyCacheReleasesFreeMemory) {
  void* ptr = nullptr;
  ASSERT_EQ(gmem_malloc(&ptr, 16 * kMiB, 0, 0), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_free(ptr), GMEM_OK);
  EXPECT_GE(stat("reserved_bytes.all.current"), static_cast<int64_t>(16 * kMiB));  // cached
  const int64_t released_before = stat("num_device_free");
  ASSERT_EQ(gmem_empty_cache(0), GMEM_OK) << last_error();
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0);
  EXPECT_GT(stat("num_device_free"), released_before);
}

TEST_F(CApi, ResetPeakAndAccumulatedStats) {
  void* ptr = nullptr;
  ASSERT_EQ(gmem_malloc(&ptr, 8 * kMiB, 0, 0), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_free(ptr), GMEM_OK);
  EXPECT_GE(stat("allocated_bytes.all.peak"), static_cast<int64_t>(8 * kMiB));
  EXPECT_GT(stat("allocated_bytes.all.freed"), 0);
  ASSERT_EQ(gmem_reset_peak_stats(0), GMEM_OK);
  EXPECT_EQ(stat("allocated_bytes.all.peak"), stat("allocated_bytes.all.current"));
  ASSERT_EQ(gmem_reset_accumulated_stats(0), GMEM_OK);
  EXPECT_EQ(stat("allocated_bytes.all.freed"), 0);
  EXPECT_EQ(stat("allocated_bytes.all.allocated"), 0);
}

TEST_F(CApi, TorchEntryPoints) {
  void* ptr = gmem_torch_malloc(4096, 0, 0);
  ASSERT_NE(ptr, nullptr) << last_error();
  EXPECT_EQ(stat("allocated_bytes.all.current"), allocated_before_ + 4096);
  gmem_torch_record_stream(ptr, 0x1230);
  gmem_torch_free(ptr, 4096, 0, 0);
  EXPECT_EQ(stat("allocated_bytes.all.current"), allocated_before_);

  EXPECT_EQ(gmem_torch_malloc(0, 0, 0), nullptr);  // empty tensors

  gmem_torch_memory_fraction(0.125, 0);
  EXPECT_EQ(stat("gmem.memory_limit"), static_cast<int64_t>(kSimCapacity / 8));
  try {
    gmem_torch_malloc(static_cast<ssize_t>(kSimCapacity / 4), 0, 0);
    ADD_FAILURE() << "no exception past the limit";
  } catch (const std::exception& e) {
    EXPECT_TRUE(contains(e.what(), "out of memory")) << e.what();
    EXPECT_TRUE(contains(e.what(), "128.00 MiB")) << e.what();
    EXPECT_EQ(last_error(), e.what());
  }

  // Failures in free never throw (torch calls it from destructors); they are reported.
  int foreign = 0;
  testing::internal::CaptureStderr();
  gmem_torch_free(&foreign, 4, 0, 0);
  const std::string warning = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(contains(warning, "gmem: gmem_free")) << warning;
  EXPECT_TRUE(contains(last_error(), "gmem_free")) << last_error();

  ptr = gmem_torch_malloc(6 * kMiB, 0, 0);
  gmem_torch_free(ptr, 6 * kMiB, 0, 0);
  EXPECT_GT(stat("reserved_bytes.all.current"), 0);
  gmem_torch_empty_cache();
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0);
  gmem_torch_reset_peak(0);
  EXPECT_EQ(stat("allocated_bytes.all.peak"), stat("allocated_bytes.all.current"));
}

TEST_F(CApi, ManyThreadsAllocateAndFree) {
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([t, &failures] {
      std::mt19937 random(static_cast<unsigned>(t));
      std::vector<void*> live;
      for (int i = 0; i < 2000; ++i) {
        if (live.size() < 16 && random() % 2 == 0) {
          void* ptr = nullptr;
          const std::size_t size = random() % 2 ? random() % 4096 + 1 : random() % (4 * kMiB) + 1;
          if (gmem_malloc(&ptr, size, 0, static_cast<uintptr_t>(t) * 16) != GMEM_OK) ++failures;
          else live.push_back(ptr);
        } else if (!live.empty()) {
          if (gmem_free(live.back()) != GMEM_OK) ++failures;
          live.pop_back();
        }
      }
      for (void* ptr : live) {
        if (gmem_free(ptr) != GMEM_OK) ++failures;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0) << last_error();
}

// Run alone (as ctest does, one process per test) this is the process's first use of gmem:
// the threads race to create the engine, and all must get the same one.
TEST(CApiFirstUse, ThreadsRacingToCreateTheEngineShareOne) {
  std::atomic<bool> go{false};
  std::vector<void*> ptrs(8, nullptr);
  std::vector<gmem_status_t> status(8, GMEM_ERROR_DEVICE);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < ptrs.size(); ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      status[t] = gmem_malloc(&ptrs[t], kMiB, -1, 0);
    });
  }
  go = true;
  for (auto& thread : threads) thread.join();
  for (std::size_t t = 0; t < ptrs.size(); ++t) ASSERT_EQ(status[t], GMEM_OK) << last_error();
  // One engine: it counts every thread's block, and each pointer frees through it.
  EXPECT_GE(stat("allocated_bytes.all.current"), static_cast<int64_t>(ptrs.size() * kMiB));
  for (void* ptr : ptrs) EXPECT_EQ(gmem_free(ptr), GMEM_OK) << last_error();
}

TEST(CApiLibrary, ExportsOnlyTheCApi) {
  EXPECT_NE(dlsym(RTLD_DEFAULT, "gmem_malloc"), nullptr);
  EXPECT_NE(dlsym(RTLD_DEFAULT, "gmem_torch_malloc"), nullptr);
  EXPECT_EQ(dlsym(RTLD_DEFAULT, "_ZN4gmem9errc_nameENS_4ErrcE"), nullptr);  // gmem::errc_name
  EXPECT_EQ(dlsym(RTLD_DEFAULT, "_ZN4gmem4capi7contextEi"), nullptr);      // gmem::capi::context
}

}  // namespace

int main(int argc, char** argv) {
  setenv("GMEM_DEVICE", "sim", 1);
  setenv("GMEM_SIM_CAPACITY", std::to_string(kSimCapacity).c_str(), 1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
