// The C API's engines as handles and its private pools, through libgmem.so over the simulated
// device (main, in capi_malloc_test.cpp, sets GMEM_DEVICE=sim before the first call).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
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
using gmem::testing::last_error;
using gmem::testing::stat;

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

}  // namespace
