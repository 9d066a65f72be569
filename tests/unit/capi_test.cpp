// The C API through libgmem.so over the simulated device (GMEM_DEVICE=sim, set in main before
// the first call). Every test leaves the one shared engine as it found it: nothing live, no limit.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gmem/gmem.h"

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kSimCapacity = std::size_t{1} << 30;

int64_t stat(const char* name) {
  int64_t value = -1;
  EXPECT_EQ(gmem_stat(0, name, &value), GMEM_OK) << gmem_last_error();
  return value;
}

std::string last_error() { return gmem_last_error(); }

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class CApi : public ::testing::Test {
 protected:
  void SetUp() override { allocated_before_ = stat("allocated_bytes.all.current"); }
  void TearDown() override {
    EXPECT_EQ(stat("allocated_bytes.all.current"), allocated_before_) << "test leaked";
    EXPECT_EQ(gmem_set_memory_limit(0, 0), GMEM_OK);
  }
  int64_t allocated_before_ = 0;
};

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

// --- Engines as handles and private pools ---------------------------------------------------

gmem_engine_t* device_engine() {
  gmem_engine_t* engine = nullptr;
  EXPECT_EQ(gmem_device_engine(0, &engine), GMEM_OK) << gmem_last_error();
  return engine;
}

gmem_engine_stats_t stats_of(gmem_engine_t* engine, int detailed = 0) {
  gmem_engine_stats_t stats{};
  EXPECT_EQ(gmem_engine_stats(engine, detailed, &stats), GMEM_OK) << gmem_last_error();
  return stats;
}

TEST_F(CApi, DeviceEngineHandleIsTheEngineBehindGmemMalloc) {
  gmem_engine_t* engine = device_engine();
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine, device_engine());  // one handle per device
  EXPECT_EQ(gmem_engine_is_pool(engine), 0);
  EXPECT_EQ(gmem_engine_device(engine), 0);
  void* ptr = nullptr;
  ASSERT_EQ(gmem_engine_malloc(engine, &ptr, 3 * kMiB, 0), GMEM_OK) << last_error();
  // The numbers agree with the named statistics of gmem_stat.
  const gmem_engine_stats_t s = stats_of(engine);
  EXPECT_EQ(s.allocated_bytes[0].current, stat("allocated_bytes.all.current"));
  EXPECT_EQ(s.allocated_bytes[2].current, stat("allocated_bytes.large_pool.current"));
  EXPECT_EQ(s.reserved_bytes[0].peak, stat("reserved_bytes.all.peak"));
  EXPECT_EQ(s.allocation[0].allocated, stat("allocation.all.allocated"));
  EXPECT_EQ(s.num_ooms, stat("num_ooms"));
  EXPECT_EQ(s.granularity, 2 * static_cast<int64_t>(kMiB));
  gmem_block_t block{};
  ASSERT_EQ(gmem_engine_block(engine, ptr, &block), GMEM_OK) << last_error();
  EXPECT_EQ(block.ptr, ptr);
  EXPECT_EQ(block.size, 3 * kMiB);
  EXPECT_EQ(block.requested, 3 * kMiB);
  EXPECT_EQ(gmem_engine_block(engine, static_cast<char*>(ptr) + 512, &block),
            GMEM_ERROR_INVALID_POINTER);
  ASSERT_EQ(gmem_free(ptr), GMEM_OK) << last_error();  // same engine as gmem_malloc's
  EXPECT_EQ(gmem_pool_destroy(engine), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "only pools")) << last_error();
}

TEST_F(CApi, PoolMemoryIsNeverHandedToTheDeviceEngine) {
  gmem_engine_t* pool = nullptr;
  ASSERT_EQ(gmem_pool_create(0, &pool), GMEM_OK) << last_error();
  EXPECT_EQ(gmem_engine_is_pool(pool), 1);
  // 600 MiB of the simulated 1 GiB: taken by the pool, freed there, cached there.
  void* in_pool = nullptr;
  ASSERT_EQ(gmem_engine_malloc(pool, &in_pool, 600 * kMiB, 0), GMEM_OK) << last_error();
  EXPECT_EQ(stats_of(pool).allocated_bytes[0].current, static_cast<int64_t>(600 * kMiB));
  EXPECT_EQ(stats_of(device_engine()).allocated_bytes[0].current, allocated_before_);
  ASSERT_EQ(gmem_engine_free(pool, in_pool), GMEM_OK) << last_error();
  EXPECT_GE(stats_of(pool).reserved_bytes[0].current, static_cast<int64_t>(600 * kMiB));

  // The device engine cannot reuse the pool's cached memory: with it held there, 600 MiB more
  // does not fit. (Its own cache from earlier tests is emptied first.)
  ASSERT_EQ(gmem_empty_cache(0), GMEM_OK);
  void* outside = nullptr;
  EXPECT_EQ(gmem_malloc(&outside, 600 * kMiB, 0, 0), GMEM_ERROR_OUT_OF_MEMORY);

  // The pool reuses its own memory.
  void* again = nullptr;
  ASSERT_EQ(gmem_engine_malloc(pool, &again, 600 * kMiB, 0), GMEM_OK) << last_error();
  gmem_block_t block{};
  EXPECT_EQ(gmem_engine_block(device_engine(), again, &block), GMEM_ERROR_INVALID_POINTER);
  ASSERT_EQ(gmem_engine_block(pool, again, &block), GMEM_OK) << last_error();

  // Destroying a pool with live blocks is refused; once they are freed its memory goes back.
  EXPECT_EQ(gmem_pool_destroy(pool), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "1 live block(s)")) << last_error();
  ASSERT_EQ(gmem_engine_free(pool, again), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_pool_destroy(pool), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_malloc(&outside, 600 * kMiB, 0, 0), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_free(outside), GMEM_OK);
  ASSERT_EQ(gmem_empty_cache(0), GMEM_OK);
}

TEST_F(CApi, APointerFindsItsEngineDeviceOrPoolInOneLookup) {
  gmem_engine_t* pool = nullptr;
  ASSERT_EQ(gmem_pool_create(0, &pool), GMEM_OK) << last_error();
  void *on_device = nullptr, *in_pool = nullptr;
  ASSERT_EQ(gmem_malloc(&on_device, 3 * kMiB, 0, 0), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_engine_malloc(pool, &in_pool, 3 * kMiB, 0), GMEM_OK) << last_error();

  gmem_engine_t* found = nullptr;
  ASSERT_EQ(gmem_engine_of(on_device, &found), GMEM_OK) << last_error();
  EXPECT_EQ(found, device_engine());
  ASSERT_EQ(gmem_engine_of(in_pool, &found), GMEM_OK) << last_error();
  EXPECT_EQ(found, pool);
  EXPECT_EQ(gmem_engine_device(found), 0);
  // Any address in the engine's space, a block's inside included.
  ASSERT_EQ(gmem_engine_of(static_cast<char*>(in_pool) + kMiB + 7, &found), GMEM_OK);
  EXPECT_EQ(found, pool);
  int on_stack = 0;
  EXPECT_EQ(gmem_engine_of(&on_stack, &found), GMEM_ERROR_INVALID_POINTER);
  EXPECT_EQ(found, nullptr);
  EXPECT_TRUE(contains(last_error(), "not allocated by gmem")) << last_error();
  EXPECT_EQ(gmem_engine_of(in_pool, nullptr), GMEM_ERROR_INVALID_ARGUMENT);

  // gmem_free finds the pool too: the block leaves the pool, not the device's engine.
  const int64_t device_allocated = stats_of(device_engine()).allocated_bytes[0].current;
  ASSERT_EQ(gmem_free(in_pool), GMEM_OK) << last_error();
  EXPECT_EQ(stats_of(pool).allocated_bytes[0].current, 0);
  EXPECT_EQ(stats_of(device_engine()).allocated_bytes[0].current, device_allocated);
  EXPECT_EQ(gmem_free(in_pool), GMEM_ERROR_DOUBLE_FREE);
  ASSERT_EQ(gmem_pool_destroy(pool), GMEM_OK) << last_error();
  // With the pool gone, its addresses are no engine's; the device's still are.
  EXPECT_EQ(gmem_engine_of(in_pool, &found), GMEM_ERROR_INVALID_POINTER);
  ASSERT_EQ(gmem_engine_of(on_device, &found), GMEM_OK) << last_error();
  EXPECT_EQ(found, device_engine());
  ASSERT_EQ(gmem_free(on_device), GMEM_OK) << last_error();
}

TEST_F(CApi, PoolPagesKeepTheirChunks) {
  // A pool is where CUDA graphs are captured: it never stitches a block from chunks mapped
  // elsewhere (a replay would run the kernels captured on the old page against them), so a
  // block that fits no free range gets chunks of its own, and the freed page keeps its chunk.
  gmem_engine_t* pool = nullptr;
  ASSERT_EQ(gmem_pool_create(0, &pool), GMEM_OK) << last_error();
  void *a = nullptr, *fence = nullptr, *b = nullptr, *again = nullptr;
  ASSERT_EQ(gmem_engine_malloc(pool, &a, 2 * kMiB, 0), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_engine_malloc(pool, &fence, 2 * kMiB, 0), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_engine_free(pool, a), GMEM_OK);
  ASSERT_EQ(gmem_engine_malloc(pool, &b, 4 * kMiB, 0), GMEM_OK) << last_error();
  EXPECT_EQ(stats_of(pool).reserved_bytes[0].current, static_cast<int64_t>(8 * kMiB));
  ASSERT_EQ(gmem_engine_malloc(pool, &again, 2 * kMiB, 0), GMEM_OK) << last_error();
  EXPECT_EQ(again, a);
  EXPECT_EQ(stats_of(pool).reserved_bytes[0].current, static_cast<int64_t>(8 * kMiB));
  for (void* p : {again, fence, b}) ASSERT_EQ(gmem_engine_free(pool, p), GMEM_OK);
  ASSERT_EQ(gmem_pool_destroy(pool), GMEM_OK) << last_error();
}

TEST_F(CApi, APoolHoldsABlockUsedElsewhereUntilTheCaptureEnds) {
  // gmem.torch sets every engine of the device capturing while a CUDA graph is captured: a
  // block used on a side stream and freed meanwhile is not reused before the capture ends.
  gmem_engine_t* pool = nullptr;
  ASSERT_EQ(gmem_pool_create(0, &pool), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_engine_set_capturing(pool, 1), GMEM_OK) << last_error();
  void *a = nullptr, *b = nullptr, *c = nullptr;
  ASSERT_EQ(gmem_engine_malloc(pool, &a, 2 * kMiB, 0), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_engine_record_stream(pool, a, 0x51de), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_engine_free(pool, a), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_engine_malloc(pool, &b, 2 * kMiB, 0), GMEM_OK) << last_error();
  EXPECT_NE(b, a);
  ASSERT_EQ(gmem_engine_set_capturing(pool, 0), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_engine_free(pool, b), GMEM_OK);
  ASSERT_EQ(gmem_engine_empty_cache(pool), GMEM_OK);  // waits for the side stream: a goes too
  EXPECT_EQ(stats_of(pool).reserved_bytes[0].current, 0);
  ASSERT_EQ(gmem_engine_malloc(pool, &c, 2 * kMiB, 0), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_engine_free(pool, c), GMEM_OK);
  ASSERT_EQ(gmem_pool_destroy(pool), GMEM_OK) << last_error();
  EXPECT_EQ(gmem_engine_set_capturing(nullptr, 1), GMEM_ERROR_INVALID_ARGUMENT);
}

// PyTorch counts a graph's pool as the device's memory, and its peaks as those of the whole:
// a pool that held 40 MiB during a capture and the device engine that holds 30 MiB later make a
// peak of 40, not 70.
TEST_F(CApi, TheDeviceCountsItsPoolsWithPeaksOfTheSum) {
  ASSERT_EQ(gmem_reset_peak_stats(0), GMEM_OK) << last_error();
  const int64_t base = stat("allocated_bytes.all.current");
  const int64_t allocations = stat("allocation.all.allocated");
  gmem_engine_t* pool = nullptr;
  ASSERT_EQ(gmem_pool_create(0, &pool), GMEM_OK) << last_error();
  void *in_pool = nullptr, *outside = nullptr, *again = nullptr;
  ASSERT_EQ(gmem_engine_malloc(pool, &in_pool, 40 * kMiB, 0), GMEM_OK) << last_error();
  EXPECT_EQ(stat("allocated_bytes.all.current"), base + static_cast<int64_t>(40 * kMiB));
  ASSERT_EQ(gmem_engine_free(pool, in_pool), GMEM_OK);
  ASSERT_EQ(gmem_malloc(&outside, 30 * kMiB, 0, 0), GMEM_OK) << last_error();
  gmem_engine_stats_t s{};
  ASSERT_EQ(gmem_device_stats(0, 0, &s), GMEM_OK) << last_error();
  EXPECT_EQ(s.allocated_bytes[0].current, base + static_cast<int64_t>(30 * kMiB));
  EXPECT_EQ(s.allocated_bytes[0].peak, base + static_cast<int64_t>(40 * kMiB));
  EXPECT_EQ(stat("allocated_bytes.all.peak"), base + static_cast<int64_t>(40 * kMiB));
  EXPECT_EQ(s.reserved_bytes[0].current, stats_of(device_engine()).reserved_bytes[0].current +
                                              stats_of(pool).reserved_bytes[0].current);

  ASSERT_EQ(gmem_engine_malloc(pool, &again, 20 * kMiB, 0), GMEM_OK) << last_error();
  EXPECT_EQ(stat("allocated_bytes.all.peak"), base + static_cast<int64_t>(50 * kMiB));
  ASSERT_EQ(gmem_engine_free(pool, again), GMEM_OK);
  ASSERT_EQ(gmem_free(outside), GMEM_OK);

  // Resetting the device resets its pools too; a destroyed pool's blocks stay in the totals.
  ASSERT_EQ(gmem_reset_peak_stats(0), GMEM_OK) << last_error();
  EXPECT_EQ(stat("allocated_bytes.all.peak"), base);
  EXPECT_EQ(stats_of(pool).allocated_bytes[0].peak, 0);
  ASSERT_EQ(gmem_pool_destroy(pool), GMEM_OK) << last_error();
  EXPECT_EQ(stat("allocation.all.allocated"), allocations + 3);
  EXPECT_EQ(stat("reserved_bytes.all.current"),
            stats_of(device_engine()).reserved_bytes[0].current);
  EXPECT_EQ(gmem_device_stats(0, 0, nullptr), GMEM_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(gmem_empty_cache(0), GMEM_OK);
}

// What gmem.torch's setCheckpointPoolState does for cudagraph trees: a block freed since the
// checkpoint is allocated again at its address; a range in use, or a device's engine, refused.
TEST_F(CApi, APoolPutsABlockBackAtItsAddress) {
  gmem_engine_t* pool = nullptr;
  ASSERT_EQ(gmem_pool_create(-1, &pool), GMEM_OK) << last_error();
  void *a = nullptr, *b = nullptr;
  ASSERT_EQ(gmem_engine_malloc(pool, &a, 3 * kMiB, 0), GMEM_OK);
  ASSERT_EQ(gmem_engine_malloc(pool, &b, 100, 0), GMEM_OK);
  ASSERT_EQ(gmem_engine_free(pool, a), GMEM_OK);
  ASSERT_EQ(gmem_pool_malloc_at(pool, a, 3 * kMiB), GMEM_OK) << last_error();
  gmem_block_t block{};
  ASSERT_EQ(gmem_engine_block(pool, a, &block), GMEM_OK);
  EXPECT_EQ(block.requested, 3 * kMiB);
  EXPECT_EQ(gmem_pool_malloc_at(pool, b, 100), GMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("not free"), std::string::npos) << last_error();
  EXPECT_EQ(gmem_pool_malloc_at(device_engine(), a, 512), GMEM_ERROR_INVALID_ARGUMENT);
  for (void* p : {a, b}) ASSERT_EQ(gmem_engine_free(pool, p), GMEM_OK);
  ASSERT_EQ(gmem_pool_destroy(pool), GMEM_OK) << last_error();
}

TEST_F(CApi, PoolListsItsBlocksAndEmptiesItsCache) {
  gmem_engine_t* pool = nullptr;
  ASSERT_EQ(gmem_pool_create(-1, &pool), GMEM_OK) << last_error();
  std::vector<void*> ptrs(3);
  for (std::size_t i = 0; i < ptrs.size(); ++i)
    ASSERT_EQ(gmem_engine_malloc(pool, &ptrs[i], (i + 1) * kMiB + 100, 0), GMEM_OK);
  struct Seen {
    std::vector<gmem_block_t> blocks;
  } seen;
  ASSERT_EQ(gmem_engine_for_each_block(
                pool,
                [](void* user, const gmem_block_t* b) {
                  static_cast<Seen*>(user)->blocks.push_back(*b);
                },
                &seen),
            GMEM_OK);
  ASSERT_EQ(seen.blocks.size(), 3u);
  std::size_t requested = 0;
  for (const gmem_block_t& b : seen.blocks) requested += b.requested;
  EXPECT_EQ(requested, 6 * kMiB + 300);
  for (void* ptr : ptrs) ASSERT_EQ(gmem_engine_free(pool, ptr), GMEM_OK);
  EXPECT_EQ(gmem_engine_free(pool, ptrs[0]), GMEM_ERROR_DOUBLE_FREE);
  EXPECT_GT(stats_of(pool).reserved_bytes[0].current, 0);
  ASSERT_EQ(gmem_engine_empty_cache(pool), GMEM_OK);
  EXPECT_EQ(stats_of(pool).reserved_bytes[0].current, 0);
  EXPECT_EQ(stats_of(pool).allocation[0].allocated, 3);
  ASSERT_EQ(gmem_engine_reset_accumulated_stats(pool), GMEM_OK);
  EXPECT_EQ(stats_of(pool).allocation[0].allocated, 0);
  ASSERT_EQ(gmem_pool_destroy(pool), GMEM_OK) << last_error();
  EXPECT_EQ(gmem_engine_is_pool(nullptr), -1);
  EXPECT_EQ(gmem_engine_malloc(nullptr, &ptrs[0], 10, 0), GMEM_ERROR_INVALID_ARGUMENT);
}

TEST_F(CApi, PoolsAndTheDeviceEngineServeThreadsAtOnce) {
  // Engines share the device object: allocate from two pools and the device engine at once.
  std::vector<gmem_engine_t*> engines{device_engine(), nullptr, nullptr};
  ASSERT_EQ(gmem_pool_create(0, &engines[1]), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_pool_create(0, &engines[2]), GMEM_OK) << last_error();
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (gmem_engine_t* engine : engines) {
    threads.emplace_back([engine, &failures] {
      std::mt19937 random(7);
      std::vector<void*> live;
      for (int i = 0; i < 400; ++i) {
        void* ptr = nullptr;
        const std::size_t size = std::size_t{1} << (9 + random() % 14);  // 512 B .. 4 MiB
        if (gmem_engine_malloc(engine, &ptr, size, 0) != GMEM_OK) ++failures;
        else live.push_back(ptr);
        if (live.size() > 8) {
          if (gmem_engine_free(engine, live.front()) != GMEM_OK) ++failures;
          live.erase(live.begin());
        }
      }
      for (void* ptr : live)
        if (gmem_engine_free(engine, ptr) != GMEM_OK) ++failures;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(gmem_pool_destroy(engines[1]), GMEM_OK) << last_error();
  EXPECT_EQ(gmem_pool_destroy(engines[2]), GMEM_OK) << last_error();
  ASSERT_EQ(gmem_empty_cache(0), GMEM_OK);
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
