// The engine on a real GPU: CudaDevice (and the CudaSegmentDevice fallback) under kernels that
// write and read back every block. Run on a GPU machine: build/gmem_gpu_tests.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "gmem/cuda_device.hpp"
#include "gmem/engine.hpp"
#include "gpu/checking_device.hpp"
#include "gpu/gpu_kernels.cuh"

namespace gmem {
namespace {

using gpu_test::CheckingDevice;
using gpu_test::delayed_fill;
using gpu_test::fill;
using gpu_test::mismatches;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::uint64_t kDelayNs = 300'000'000;  // keeps a stream busy for 0.3 s

StreamId id(cudaStream_t stream) { return reinterpret_cast<StreamId>(stream); }

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GPU_CHECK(cudaSetDevice(0));
    GPU_CHECK(cudaFree(nullptr));  // initialise the runtime on the primary context
    GPU_CHECK(cudaStreamCreateWithFlags(&a_, cudaStreamNonBlocking));
    GPU_CHECK(cudaStreamCreateWithFlags(&b_, cudaStreamNonBlocking));
    cuda_ = std::make_unique<CudaDevice>(0);
    checking_ = std::make_unique<CheckingDevice>(*cuda_);
  }
  void TearDown() override {
    engine_.reset();
    GPU_CHECK(cudaDeviceSynchronize());
    GPU_CHECK(cudaStreamDestroy(a_));
    GPU_CHECK(cudaStreamDestroy(b_));
  }
  Engine& make_engine(EngineOptions options = {}) {
    engine_ = std::make_unique<Engine>(*checking_, options);
    return *engine_;
  }

  cudaStream_t a_ = nullptr, b_ = nullptr;
  std::unique_ptr<CudaDevice> cuda_;
  std::unique_ptr<CheckingDevice> checking_;
  std::unique_ptr<Engine> engine_;
};

struct Block {
  void* ptr;
  std::size_t size;
  std::uint32_t seed;
};

void expect_intact(const std::vector<Block>& blocks) {
  for (const Block& b : blocks) {
    EXPECT_EQ(mismatches(b.ptr, b.size, b.seed), 0u) << "block at " << b.ptr << " of " << b.size;
  }
}

TEST_F(GpuTest, DeviceReportsVmmAndTwoMiBGranularity) {
  EXPECT_TRUE(CudaDevice::supports_vmm(0));
  EXPECT_EQ(cuda_->granularity(), 2 * kMiB);
  const DeviceMemInfo info = cuda_->mem_info();
  EXPECT_GT(info.total, 0u);
  EXPECT_LE(info.free, info.total);
  std::printf("device: %s, %zu MiB total, %zu MiB free\n", cuda_->name().c_str(),
              info.total / kMiB, info.free / kMiB);
}

TEST_F(GpuTest, BlocksOfAllSizesHoldDistinctPatterns) {
  Engine& engine = make_engine();
  std::mt19937 random(42);
  std::vector<std::size_t> sizes = {512,     1000,          4096,     65536,    kMiB,
                                    kMiB + 512, 3 * kMiB, 17 * kMiB + 4, 64 * kMiB, 200 * kMiB};
  for (int i = 0; i < 300; ++i) sizes.push_back((random() % (3 * kMiB) + 4) & ~std::size_t{3});
  std::vector<Block> blocks;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    void* ptr = engine.malloc(sizes[i], id(a_));
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(ptr) % kAlignment, 0u);
    blocks.push_back({ptr, sizes[i], static_cast<std::uint32_t>(i + 1)});
    fill(ptr, sizes[i], blocks.back().seed, a_);
  }
  std::vector<Block> sorted = blocks;
  std::sort(sorted.begin(), sorted.end(), [](auto& l, auto& r) { return l.ptr < r.ptr; });
  for (std::size_t i = 1; i < sorted.size(); ++i) {
    EXPECT_LE(static_cast<char*>(sorted[i - 1].ptr) + sorted[i - 1].size, sorted[i].ptr)
        << "blocks overlap";
  }
  GPU_CHECK(cudaStreamSynchronize(a_));
  expect_intact(blocks);
  // Free half, allocate again and check that the survivors were not touched.
  std::vector<Block> live;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (i % 2 == 0) engine.free(blocks[i].ptr);
    else live.push_back(blocks[i]);
  }
  for (std::uint32_t i = 0; i < 100; ++i) {
    const std::size_t size = (random() % (8 * kMiB) + 4) & ~std::size_t{3};
    live.push_back({engine.malloc(size, id(a_)), size, 1000 + i});
    fill(live.back().ptr, size, live.back().seed, a_);
  }
  GPU_CHECK(cudaStreamSynchronize(a_));
  expect_intact(live);
  engine.check_invariants();
  for (const Block& b : live) engine.free(b.ptr);
  engine.check_invariants();
}

TEST_F(GpuTest, StitchingUnderALimitKeepsLiveData) {
  EngineOptions options;
  options.memory_limit = 64 * kMiB;
  Engine& engine = make_engine(options);
  std::vector<Block> blocks;
  for (std::uint32_t i = 0; i < 16; ++i) {
    blocks.push_back({engine.malloc(4 * kMiB, id(a_)), 4 * kMiB, i + 1});
    fill(blocks.back().ptr, 4 * kMiB, blocks.back().seed, a_);
  }
  std::vector<Block> live;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (i % 2 == 1) engine.free(blocks[i].ptr);  // 8 holes of 4 MiB, none adjacent
    else live.push_back(blocks[i]);
  }
  // 32 MiB contiguous exists only by remapping the freed chunks.
  const int maps_before = checking_->maps();
  void* big = engine.malloc(32 * kMiB, id(a_));
  EXPECT_GE(engine.stats().num_stitches, 1);
  EXPECT_GT(checking_->aliases(), 0);  // freed chunks mapped here too, not moved
  // 16 pages, of which at most one freed 4 MiB hole (2 pages) was already mapped in place.
  EXPECT_GE(checking_->maps() - maps_before, 14);
  EXPECT_LE(engine.stats().reserved_bytes[kAllPools].current, std::int64_t{64} * 1024 * 1024);
  fill(big, 32 * kMiB, 777, a_);
  GPU_CHECK(cudaStreamSynchronize(a_));
  live.push_back({big, 32 * kMiB, 777});
  expect_intact(live);
  engine.check_invariants();
  for (const Block& b : live) engine.free(b.ptr);
}

// EngineOptions::page_size on the real driver: 8 MiB chunks, created, mapped, aliased and
// unmapped whole. Blocks of every size keep their bytes, and stitching under a limit maps freed
// 8 MiB chunks at a second address.
TEST_F(GpuTest, LargerPagesKeepDataAndStitchWholeChunks) {
  constexpr std::size_t kPage = 8 * kMiB;
  {
    Engine& engine = make_engine(EngineOptions{.page_size = kPage});
    EXPECT_EQ(engine.stats().granularity, static_cast<std::int64_t>(kPage));
    std::mt19937 random(7);
    std::vector<Block> blocks;
    for (std::uint32_t i = 0; i < 80; ++i) {  // 512 B to 20 MiB: many share a page
      const std::size_t size = (random() % (20 * kMiB) >> (random() % 12)) + 4 & ~std::size_t{3};
      blocks.push_back({engine.malloc(size, id(a_)), size, i + 1});
      fill(blocks.back().ptr, size, blocks.back().seed, a_);
    }
    GPU_CHECK(cudaStreamSynchronize(a_));
    expect_intact(blocks);
    EXPECT_EQ(engine.stats().reserved_bytes[kAllPools].current % static_cast<std::int64_t>(kPage), 0);
    engine.check_invariants();
    for (const Block& b : blocks) engine.free(b.ptr);
  }
  Engine& engine = make_engine(EngineOptions{.memory_limit = 16 * kPage, .page_size = kPage});
  std::vector<Block> blocks;
  for (std::uint32_t i = 0; i < 16; ++i) {
    blocks.push_back({engine.malloc(kPage, id(a_)), kPage, i + 1});
    fill(blocks.back().ptr, kPage, blocks.back().seed, a_);
  }
  std::vector<Block> live;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (i % 2 == 1) engine.free(blocks[i].ptr);  // 8 holes of one page, none adjacent
    else live.push_back(blocks[i]);
  }
  const int aliases_before = checking_->aliases();
  void* big = engine.malloc(6 * kPage, id(a_));  // only by mapping freed chunks here too
  EXPECT_GT(checking_->aliases(), aliases_before);
  EXPECT_LE(engine.stats().reserved_bytes[kAllPools].current, static_cast<std::int64_t>(16 * kPage));
  fill(big, 6 * kPage, 4242, a_);
  live.push_back({big, 6 * kPage, 4242});
  GPU_CHECK(cudaStreamSynchronize(a_));
  expect_intact(live);
  engine.check_invariants();
  for (const Block& b : live) engine.free(b.ptr);
}

// A malloc maps, creates and unmaps with the engine's lock released (docs/design.md, "Device calls outside the lock"): four
// threads, two to a stream (their blocks share boundary pages), stitch under a limit at once;
// CheckingDevice sees no address mapped twice, and every block keeps its bytes.
TEST_F(GpuTest, ThreadsStitchAtOnceAndKeepTheirData) {
  EngineOptions options;
  options.memory_limit = 384 * kMiB;  // above the ~240 MiB the threads could hold at once
  Engine& engine = make_engine(options);
  const cudaStream_t streams[2] = {a_, b_};
  std::vector<std::thread> threads;
  std::vector<std::vector<Block>> kept(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      GPU_CHECK(cudaSetDevice(0));
      const cudaStream_t stream = streams[t % 2];
      std::mt19937 random(static_cast<unsigned>(t) + 1);
      std::vector<Block> live;
      for (std::uint32_t i = 0; i < 400; ++i) {
        if (live.size() >= 10) {
          engine.free(live.front().ptr);
          live.erase(live.begin());
        }
        const std::size_t size = (random() % (4 * kMiB) + 200 * 1024) & ~std::size_t{3};
        const std::uint32_t seed = (static_cast<std::uint32_t>(t) << 16) + i + 1;
        live.push_back({engine.malloc(size, id(stream)), size, seed});
        fill(live.back().ptr, size, live.back().seed, stream);
      }
      GPU_CHECK(cudaStreamSynchronize(stream));
      kept[t] = live;
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& live : kept) expect_intact(live);
  EXPECT_GE(engine.stats().num_stitches, 1);
  engine.check_invariants();
  for (const auto& live : kept)
    for (const Block& b : live) engine.free(b.ptr);
  engine.check_invariants();
}

TEST_F(GpuTest, AChunkMappedAtTwoAddressesShowsTheSameBytes) {
  // What stitching relies on: the driver maps one physical allocation at several addresses.
  const std::size_t g = cuda_->granularity();
  const DevicePtr first = cuda_->reserve_address(g, g), second = cuda_->reserve_address(g, g);
  const ChunkHandle chunk = cuda_->create_chunk(g);
  cuda_->map(first, g, chunk);
  cuda_->map(second, g, chunk);
  cuda_->set_access(first, g);
  cuda_->set_access(second, g);
  fill(reinterpret_cast<void*>(first), g, 4242, a_);
  GPU_CHECK(cudaStreamSynchronize(a_));
  EXPECT_EQ(mismatches(reinterpret_cast<void*>(second), g, 4242), 0u);
  cuda_->unmap(first, g);  // the other mapping lives on
  fill(reinterpret_cast<void*>(second), g, 4343, a_);
  GPU_CHECK(cudaStreamSynchronize(a_));
  EXPECT_EQ(mismatches(reinterpret_cast<void*>(second), g, 4343), 0u);
  cuda_->unmap(second, g);
  cuda_->release_chunk(chunk);
  cuda_->release_address(first, g);
  cuda_->release_address(second, g);
}

TEST_F(GpuTest, RepeatedStepsKeepTheirDataAndStopMapping) {
  // A training loop in miniature, its kernels queued behind the host: after the first steps
  // every page its layout needs stays mapped (aliases included), and no data is ever mixed up.
  Engine& engine = make_engine();
  const std::size_t sizes[] = {64 * kMiB, 3 * kMiB + 512, 100 * 1024, 33 * kMiB, 4096, 9 * kMiB};
  int maps_after_warmup = 0;
  std::int64_t call_us_after_warmup = 0;
  for (int step = 0; step < 6; ++step) {
    if (step == 2) {
      maps_after_warmup = checking_->maps();
      call_us_after_warmup = engine.stats().device_call_us;
    }
    std::vector<Block> live;
    for (std::size_t i = 0; i < std::size(sizes); ++i) {
      live.push_back({engine.malloc(sizes[i], id(a_)), sizes[i], static_cast<std::uint32_t>(step * 100 + i)});
      delayed_fill(live.back().ptr, sizes[i], live.back().seed, a_, i == 0 ? 20'000'000 : 0);
      if (i % 2 == 1) {  // a temporary: freed while its kernel may still be queued
        GPU_CHECK(cudaStreamSynchronize(a_));
        EXPECT_EQ(mismatches(live.back().ptr, sizes[i], live.back().seed), 0u);
        engine.free(live.back().ptr);
        live.pop_back();
      }
    }
    GPU_CHECK(cudaStreamSynchronize(a_));
    expect_intact(live);
    for (const Block& b : live) engine.free(b.ptr);
  }
  EXPECT_EQ(checking_->maps(), maps_after_warmup);
  // The driver's time was measured while mapping (each map and set-access takes microseconds),
  // and the settled steps added none.
  EXPECT_GT(call_us_after_warmup, 0);
  EXPECT_EQ(engine.stats().device_call_us, call_us_after_warmup);
  engine.check_invariants();
}

// A block freed while its stream still works on it must not be handed to another stream before
// that work finishes: a different address, the engine waited, or the taker's stream waits for
// it on the GPU (a handover); whichever, the taker's data must come out whole.
class CrossStream : public GpuTest, public ::testing::WithParamInterface<std::size_t> {};

TEST_P(CrossStream, FreedBlockIsNotReusedOnAnotherStreamBeforeItsWorkEnds) {
  const std::size_t size = GetParam();
  Engine& engine = make_engine();
  void* first = engine.malloc(size, id(a_));
  delayed_fill(first, size, 1, a_, kDelayNs);
  engine.free(first);
  void* second = engine.malloc(size, id(b_));
  if (second == first) {
    EXPECT_EQ(cudaStreamQuery(a_), cudaSuccess) << "reused before stream A finished";
  }
  fill(second, size, 2, b_);
  GPU_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(mismatches(second, size, 2), 0u) << "stream A's late write landed in B's block";
  engine.free(second);
}

TEST_P(CrossStream, RecordStreamDefersReuseUntilTheRecordedStreamCatchesUp) {
  const std::size_t size = GetParam();
  Engine& engine = make_engine();
  void* first = engine.malloc(size, id(a_));
  fill(first, size, 1, a_);
  GPU_CHECK(cudaStreamSynchronize(a_));
  delayed_fill(first, size, 3, b_, kDelayNs);  // B uses A's block
  engine.record_stream(first, id(b_));
  engine.free(first);
  void* second = engine.malloc(size, id(a_));
  if (second == first) {
    EXPECT_EQ(cudaStreamQuery(b_), cudaSuccess) << "reused before stream B finished";
  }
  fill(second, size, 4, a_);
  GPU_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(mismatches(second, size, 4), 0u) << "stream B's late write landed in the new block";
  engine.free(second);
}

TEST_P(CrossStream, SameStreamReusesAtOnceAndDataStaysOrdered) {
  const std::size_t size = GetParam();
  Engine& engine = make_engine();
  void* first = engine.malloc(size, id(a_));
  delayed_fill(first, size, 5, a_, kDelayNs / 3);
  engine.free(first);
  void* second = engine.malloc(size, id(a_));  // stream order makes reuse safe without waiting
  fill(second, size, 6, a_);
  GPU_CHECK(cudaStreamSynchronize(a_));
  EXPECT_EQ(mismatches(second, size, 6), 0u);
  engine.free(second);
}

// An 8 MiB block was freed while `busy`'s 0.3 s kernel still writes it, and the limit (8 MiB)
// leaves no other memory: `taker`'s malloc is handed that block, made to wait for the kernel on
// the GPU (cuStreamWaitEvent). The malloc returns while the kernel still runs, and the taker's
// write lands after the kernel's.
void expect_handed_over_without_a_host_wait(Engine& engine, cudaStream_t busy,
                                            cudaStream_t taker) {
  void* second = engine.malloc(8 * kMiB, id(taker));
  EXPECT_EQ(cudaStreamQuery(busy), cudaErrorNotReady) << "the host waited for the busy stream";
  EXPECT_GT(engine.stats().num_stream_handovers, 0);
  EXPECT_EQ(engine.stats().num_sync_all_streams, 0);
  fill(second, 8 * kMiB, 2, taker);
  GPU_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(mismatches(second, 8 * kMiB, 2), 0u)
      << "the busy stream's late write landed in the taker's block";
  engine.free(second);
  engine.check_invariants();
}

// Memory a stream freed while its kernel still runs, needed by another stream.
TEST_F(GpuTest, MemoryAStreamMayStillUseIsHandedOverWithoutAHostWait) {
  Engine& engine = make_engine(EngineOptions{.memory_limit = 8 * kMiB});
  void* first = engine.malloc(8 * kMiB, id(a_));
  delayed_fill(first, 8 * kMiB, 1, a_, kDelayNs);
  engine.free(first);
  expect_handed_over_without_a_host_wait(engine, a_, b_);
}

// A block stream A made and stream B still writes (record_stream), freed, and A needs memory:
// A is made to wait for B and takes the block back.
TEST_F(GpuTest, AHeldFreeGoesBackToItsStreamWithoutAHostWait) {
  Engine& engine = make_engine(EngineOptions{.memory_limit = 8 * kMiB});
  void* first = engine.malloc(8 * kMiB, id(a_));
  engine.record_stream(first, id(b_));
  delayed_fill(first, 8 * kMiB, 1, b_, kDelayNs);
  engine.free(first);
  expect_handed_over_without_a_host_wait(engine, b_, a_);
  EXPECT_EQ(engine.stats().pending_free_bytes, 0);
}

INSTANTIATE_TEST_SUITE_P(SmallAndLarge, CrossStream,
                         ::testing::Values(std::size_t{4096}, 8 * kMiB));

// While the main thread captures a graph in global mode, another thread's malloc that must wait
// for a stream (memory freed there, its kernel still running) makes its event calls in relaxed
// capture mode: the capture survives and the graph replays. Made in the thread's default mode,
// the same calls fail and invalidate the capture (gpu/unmap_in_capture.cu).
TEST_F(GpuTest, AnotherThreadWaitsForAStreamWhileAGraphIsCaptured) {
  Engine& engine = make_engine(EngineOptions{.memory_limit = 64 * kMiB});
  void* first = engine.malloc(48 * kMiB, id(a_));
  delayed_fill(first, 48 * kMiB, 1, a_, kDelayNs);
  engine.free(first);
  cudaStream_t captured = nullptr;
  GPU_CHECK(cudaStreamCreateWithFlags(&captured, cudaStreamNonBlocking));
  void* scratch = nullptr;  // the graph's own buffer, outside gmem
  GPU_CHECK(cudaMalloc(&scratch, 4096));
  GPU_CHECK(cudaStreamBeginCapture(captured, cudaStreamCaptureModeGlobal));
  engine.set_capturing(true);
  fill(scratch, 4096, 3, captured);
  void* second = nullptr;
  std::string failure;
  std::thread other([&] {
    try {
      second = engine.malloc(48 * kMiB, id(b_));  // needs stream a_'s memory: waits for it
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  other.join();
  fill(scratch, 4096, 4, captured);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(captured, &graph);
  engine.set_capturing(false);
  EXPECT_EQ(failure, "");
  EXPECT_EQ(ended, cudaSuccess) << cudaGetErrorName(ended);
  if (ended == cudaSuccess) {
    cudaGraphExec_t exec = nullptr;
    GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    GPU_CHECK(cudaGraphLaunch(exec, captured));
    GPU_CHECK(cudaStreamSynchronize(captured));
    EXPECT_EQ(mismatches(scratch, 4096, 4), 0u) << "the replay did not run";
    GPU_CHECK(cudaGraphExecDestroy(exec));
    GPU_CHECK(cudaGraphDestroy(graph));
  }
  cudaGetLastError();
  if (second != nullptr) {
    fill(second, 48 * kMiB, 5, b_);
    GPU_CHECK(cudaStreamSynchronize(b_));
    EXPECT_EQ(mismatches(second, 48 * kMiB, 5), 0u) << "stream a_'s late write landed in it";
    engine.free(second);
  }
  GPU_CHECK(cudaFree(scratch));
  GPU_CHECK(cudaStreamDestroy(captured));
}

TEST_F(GpuTest, OutOfMemoryUnderALimitThenRecoveryAfterFrees) {
  EngineOptions options;
  options.memory_limit = 64 * kMiB;
  Engine& engine = make_engine(options);
  std::vector<void*> blocks;
  try {
    for (int i = 0; i < 100; ++i) blocks.push_back(engine.malloc(4 * kMiB, id(a_)));
    FAIL() << "no OutOfMemoryError under a 64 MiB limit";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(blocks.size(), 16u);
    EXPECT_EQ(e.info().requested, 4 * kMiB);
    EXPECT_EQ(e.info().limit, 64 * kMiB);
    EXPECT_EQ(e.info().reason, "limit");
    EXPECT_NE(std::string(e.what()).find("64.00 MiB"), std::string::npos) << e.what();
  }
  engine.free(blocks[3]);
  engine.free(blocks[9]);
  blocks.erase(blocks.begin() + 9);
  blocks.erase(blocks.begin() + 3);
  void* recovered = engine.malloc(8 * kMiB, id(a_));
  fill(recovered, 8 * kMiB, 9, a_);
  GPU_CHECK(cudaStreamSynchronize(a_));
  EXPECT_EQ(mismatches(recovered, 8 * kMiB, 9), 0u);
  engine.free(recovered);
  for (void* p : blocks) engine.free(p);
  EXPECT_EQ(engine.stats().num_ooms, 1);
}

TEST_F(GpuTest, EmptyCacheGivesMemoryBackToTheDriver) {
  Engine& engine = make_engine();
  constexpr std::size_t kSize = std::size_t{1} << 30;
  std::size_t free_before = 0, free_held = 0, free_after = 0, total = 0;
  GPU_CHECK(cudaMemGetInfo(&free_before, &total));
  void* block = engine.malloc(kSize, id(a_));
  fill(block, kSize, 11, a_);
  GPU_CHECK(cudaStreamSynchronize(a_));
  engine.free(block);
  GPU_CHECK(cudaMemGetInfo(&free_held, &total));
  EXPECT_LE(free_held + kSize - 64 * kMiB, free_before) << "freed memory should stay cached";
  engine.empty_cache();
  GPU_CHECK(cudaMemGetInfo(&free_after, &total));
  EXPECT_GE(free_after, free_held + kSize - 64 * kMiB) << "empty_cache released too little";
  EXPECT_EQ(engine.stats().reserved_bytes[kAllPools].current, 0);
}

TEST_F(GpuTest, TwoDevicesEachServeTheirOwnMemory) {
  if (CudaDevice::device_count() < 2) {
    GTEST_SKIP() << "needs two GPUs; this machine has " << CudaDevice::device_count();
  }
  CudaDevice second_device(1);
  Engine engine0(*cuda_);
  Engine engine1(second_device);
  void* p0 = engine0.malloc(64 * kMiB);
  void* p1 = engine1.malloc(64 * kMiB);
  cudaPointerAttributes attributes{};
  GPU_CHECK(cudaPointerGetAttributes(&attributes, p1));
  EXPECT_EQ(attributes.device, 1);
  GPU_CHECK(cudaSetDevice(0));
  fill(p0, 64 * kMiB, 21, nullptr);
  EXPECT_EQ(mismatches(p0, 64 * kMiB, 21), 0u);
  GPU_CHECK(cudaSetDevice(1));
  fill(p1, 64 * kMiB, 22, nullptr);
  EXPECT_EQ(mismatches(p1, 64 * kMiB, 22), 0u);
  GPU_CHECK(cudaSetDevice(0));
  engine0.free(p0);
  engine1.free(p1);
}

TEST_F(GpuTest, SegmentFallbackServesRealMemory) {
  CudaSegmentDevice segments(0);
  EngineOptions options;
  options.memory_limit = 256 * kMiB;
  options.address_space = CudaSegmentDevice::kArenaSize;
  Engine engine(segments, options);
  std::vector<Block> blocks;
  std::uint32_t seed = 31;
  for (std::size_t size : {std::size_t{4096}, kMiB, 6 * kMiB, 40 * kMiB, 512 + 3 * kMiB}) {
    blocks.push_back({engine.malloc(size, id(a_)), size, seed++});
    fill(blocks.back().ptr, size, blocks.back().seed, a_);
  }
  GPU_CHECK(cudaStreamSynchronize(a_));
  expect_intact(blocks);
  engine.free(blocks[2].ptr);
  blocks.erase(blocks.begin() + 2);
  blocks.push_back({engine.malloc(10 * kMiB, id(a_)), 10 * kMiB, 99});
  fill(blocks.back().ptr, 10 * kMiB, 99, a_);
  GPU_CHECK(cudaStreamSynchronize(a_));
  expect_intact(blocks);
  engine.check_invariants();
  for (const Block& b : blocks) engine.free(b.ptr);
  EXPECT_LE(segments.committed_bytes(), 256 * kMiB);
}

// A CUDA graph's pool served by the fallback: its first malloc inside the capture (global mode, as
// torch.cuda.graph captures) reserves its arena with cuMemAlloc, which the driver refuses in global
// mode (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, invalidating the capture) unless made in relaxed
// mode, as PyTorch makes its cudaMalloc.
TEST_F(GpuTest, SegmentFallbackPoolReservesInsideACapture) {
  CudaSegmentDevice segments(0);
  EngineOptions options;
  options.address_space = CudaSegmentDevice::kArenaSize;
  options.stable_pages = true;
  Engine pool(segments, options);
  cudaStream_t captured = nullptr;
  GPU_CHECK(cudaStreamCreateWithFlags(&captured, cudaStreamNonBlocking));
  pool.set_capturing(true);
  GPU_CHECK(cudaStreamBeginCapture(captured, cudaStreamCaptureModeGlobal));
  void* block = nullptr;
  std::string failure;
  try {
    block = pool.malloc(6 * kMiB, id(captured));
    fill(block, 6 * kMiB, 61, captured);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(captured, &graph);
  pool.set_capturing(false);
  EXPECT_EQ(failure, "");
  EXPECT_EQ(ended, cudaSuccess) << cudaGetErrorName(ended);
  if (ended == cudaSuccess && block != nullptr) {
    cudaGraphExec_t exec = nullptr;
    GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    GPU_CHECK(cudaGraphLaunch(exec, captured));
    GPU_CHECK(cudaStreamSynchronize(captured));
    EXPECT_EQ(mismatches(block, 6 * kMiB, 61), 0u) << "the replay did not write the block";
    GPU_CHECK(cudaGraphExecDestroy(exec));
    GPU_CHECK(cudaGraphDestroy(graph));
  }
  cudaGetLastError();
  if (block != nullptr) pool.free(block);
  GPU_CHECK(cudaStreamDestroy(captured));
}

}  // namespace
}  // namespace gmem
