// No host allocation on the malloc and free paths in steady state: once a program's sizes have
// been seen, gmem_malloc / gmem_free and gmem_engine_malloc / gmem_engine_free make no call to
// operator new, nor does the engine's planned path (steps marked, plans followed: what
// gmem.torch runs). Counted by replacing global operator new in this test binary (its own
// executable: the replacement covers libgmem.so's calls too).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/gmem.h"
#include "gmem/sim_device.hpp"

namespace {
std::atomic<long> g_allocations{0};
}  // namespace

void* operator new(std::size_t size) {
  ++g_allocations;
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void* operator new[](std::size_t size) { return operator new(size); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
// Every other form counts too (std::stable_sort's buffer is a nothrow new; a memory resource's
// upstream may ask for alignment), and each is freed the way it was allocated, so that a
// sanitizer's allocator never sees one half of a pair.
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  ++g_allocations;
  return std::malloc(size == 0 ? 1 : size);
}
void* operator new[](std::size_t size, const std::nothrow_t& tag) noexcept { return operator new(size, tag); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void* operator new(std::size_t size, std::align_val_t align) {
  ++g_allocations;
  const auto a = static_cast<std::size_t>(align);
  if (void* p = std::aligned_alloc(a, (size + a - 1) / a * a + (size == 0 ? a : 0))) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size, std::align_val_t align) { return operator new(size, align); }
void* operator new(std::size_t size, std::align_val_t align, const std::nothrow_t&) noexcept {
  try {
    return operator new(size, align);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, std::align_val_t align, const std::nothrow_t& tag) noexcept {
  return operator new(size, align, tag);
}
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

namespace {

// A mix like a training step's: small tensors (slabs) and large ones (pages), two streams.
constexpr std::size_t kSizes[] = {512, 4096, 70000, 1u << 20, 3u << 20, 40u << 20};

template <class Malloc, class Free>
long allocations_in_steady_steps(Malloc malloc_fn, Free free_fn) {
  std::vector<void*> blocks;
  blocks.reserve(64);
  auto step = [&] {
    for (int i = 0; i < 4; ++i) {
      for (std::size_t size : kSizes) {
        void* p = nullptr;
        EXPECT_EQ(malloc_fn(&p, size, static_cast<uintptr_t>(i % 2 == 0 ? 0 : 8)), GMEM_OK);
        blocks.push_back(p);
      }
    }
    for (void* p : blocks) EXPECT_EQ(free_fn(p), GMEM_OK);
    blocks.clear();
  };
  for (int warm = 0; warm < 3; ++warm) step();  // the engine's structures for these sizes
  const long before = g_allocations.load();
  for (int i = 0; i < 20; ++i) step();
  return g_allocations.load() - before;
}

TEST(CApiHostAllocation, GmemMallocAndFreeAllocateNothingInSteadyState) {
  const long n = allocations_in_steady_steps(
      [](void** p, std::size_t size, uintptr_t stream) { return gmem_malloc(p, size, 0, stream); },
      [](void* p) { return gmem_free(p); });
  EXPECT_EQ(n, 0) << n << " operator new calls over 20 steps of 24 mallocs and frees";
}

TEST(CApiHostAllocation, EngineMallocAndFreeAllocateNothingInSteadyState) {
  gmem_engine_t* engine = nullptr;
  ASSERT_EQ(gmem_device_engine(0, &engine), GMEM_OK);
  const long n = allocations_in_steady_steps(
      [engine](void** p, std::size_t size, uintptr_t stream) {
        return gmem_engine_malloc(engine, p, size, stream);
      },
      [engine](void* p) { return gmem_engine_free(engine, p); });
  EXPECT_EQ(n, 0) << n << " operator new calls over 20 steps of 24 mallocs and frees";
}

// Marked steps of six layers at `length(i)` MiB a step; the operator new calls over the 20 steps
// after `warm` ones, and (through `plan_hits`) how many mallocs of those took a planned offset.
long allocations_in_marked_steps(int warm, std::size_t (*length)(int), std::int64_t* plan_hits) {
  gmem::SimulatedDevice device;
  gmem::Engine engine(device);
  constexpr std::size_t MiB = std::size_t{1} << 20;
  std::vector<void*> blocks;
  blocks.reserve(64);
  auto step = [&](std::size_t mib) {
    for (int layer = 0; layer < 6; ++layer) {
      blocks.push_back(engine.malloc(mib * MiB));          // activations, kept for backward
      void* scratch = engine.malloc(2 * mib * MiB);        // a temporary
      blocks.push_back(engine.malloc(512 * 1024 + 4096));  // a small range block
      engine.free(scratch);
    }
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) engine.free(*it);
    blocks.clear();
    engine.mark_step();
  };
  engine.mark_step();
  for (int i = 0; i < warm; ++i) step(length(i));
  const std::int64_t hits_before = engine.stats().plan_hits;
  const long before = g_allocations.load();
  for (int i = 0; i < 20; ++i) step(length(i));
  const long n = g_allocations.load() - before;
  *plan_hits = engine.stats().plan_hits - hits_before;
  return n;
}

TEST(EngineHostAllocation, MarkedStepsFollowingPlansAllocateNothingInSteadyState) {
  // Two sequence lengths taking turns, steps marked: once both shapes are planned, every range
  // malloc takes its planned offset (the step's record, the plan region's used ranges) and
  // every free tells the planner; none of it may allocate.
  std::int64_t hits = 0;
  const long n = allocations_in_marked_steps(
      6, [](int i) -> std::size_t { return i % 2 == 0 ? 3 : 5; }, &hits);
  EXPECT_EQ(hits, 20 * 18) << "every malloc took its planned offset";
  EXPECT_EQ(n, 0) << n << " operator new calls over 20 planned steps of 18 mallocs and frees";
}

TEST(EngineHostAllocation, MarkedStepsOfOneShapeAllocateNothingInSteadyState) {
  // One shape, steps marked (what gmem.torch does by default): each mark closes the step's
  // record and weighs it (its peak, for one-shape planning); that may not allocate either.
  std::int64_t hits = 0;
  const long n = allocations_in_marked_steps(6, [](int) -> std::size_t { return 4; }, &hits);
  EXPECT_EQ(n, 0) << n << " operator new calls over 20 marked steps of 18 mallocs and frees";
}

}  // namespace

int main(int argc, char** argv) {
  setenv("GMEM_DEVICE", "sim", 1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
