// Hundreds of thousands of random mallocs and frees (1 B to 1 GiB, several streams, a device
// small enough to run out), checking after every step what must always hold.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"

namespace gmem {
namespace {

constexpr std::size_t GiB = std::size_t{1} << 30;

struct Live {
  void* ptr;
  std::size_t size;
  StreamId stream;
};

// Stream order: memory a block used goes to a block of another stream only once that stream's
// work comes after the kernels that may have used it (SimulatedDevice::ordered_after: that work
// done, or the taker made to wait for it). Kept by the physical granule, (chunk, offset): what
// a freed block's kernels may touch up to, by stream.
class StreamOrderCheck {
 public:
  explicit StreamOrderCheck(const SimulatedDevice& device) : device_(device) {}
  template <class F>
  void for_granules(const Live& l, F&& visit) const {
    const std::size_t granule = device_.granularity();
    const auto begin = reinterpret_cast<std::uintptr_t>(l.ptr);
    for (std::uintptr_t pos = begin & ~(granule - 1); pos < begin + l.size; pos += granule)
      visit(device_.physical_at(pos));
  }
  void freed(const Live& l) {  // its kernels: everything submitted to its stream so far
    const std::uint64_t work = device_.submitted(l.stream);
    for_granules(l, [&](std::pair<ChunkHandle, std::size_t> at) {
      std::uint64_t& last = used_[at][l.stream];
      last = std::max(last, work);
    });
  }
  // Returns "" or what broke the order.
  std::string taken(const Live& l) const {
    std::string broken;
    for_granules(l, [&](std::pair<ChunkHandle, std::size_t> at) {
      auto it = used_.find(at);
      if (it == used_.end() || !broken.empty()) return;
      for (const auto& [stream, work] : it->second)
        if (!device_.ordered_after(l.stream, stream, work))
          broken = "chunk " + std::to_string(at.first) + " went to stream " +
                   std::to_string(l.stream) + " before stream " + std::to_string(stream) +
                   " reached work item " + std::to_string(work);
    });
    return broken;
  }

 private:
  const SimulatedDevice& device_;
  std::map<std::pair<ChunkHandle, std::size_t>, std::map<StreamId, std::uint64_t>> used_;
};

int steps_from_env(int fallback) {
  const char* env = std::getenv("GMEM_PROPERTY_STEPS");
  return env ? std::atoi(env) : fallback;
}

// No two live blocks share physical memory: with chunks mapped at several addresses (aliases),
// disjoint addresses are not enough. Checked through the device's own mapping table, a granule
// at a time: (chunk, offset into it) ranges must not overlap.
void expect_physically_disjoint(const SimulatedDevice& device, const std::vector<Live>& live,
                                int step) {
  const std::size_t granule = device.granularity();
  std::map<std::pair<ChunkHandle, std::size_t>, std::size_t> used;  // (chunk, offset) -> end
  for (const Live& l : live) {
    const auto begin = reinterpret_cast<std::uintptr_t>(l.ptr);
    for (std::uintptr_t pos = begin; pos < begin + l.size;) {
      const std::uintptr_t end = std::min<std::uintptr_t>(begin + l.size, (pos | (granule - 1)) + 1);
      const auto [chunk, from] = device.physical_at(pos);
      ASSERT_NE(chunk, 0u) << "step " << step;
      const std::size_t to = from + (end - pos);
      auto next = used.lower_bound({chunk, from});
      ASSERT_TRUE(next == used.end() || next->first.first != chunk || next->first.second >= to)
          << "two live blocks share chunk " << chunk << " at step " << step;
      if (next != used.begin()) {
        auto prev = std::prev(next);
        ASSERT_TRUE(prev->first.first != chunk || prev->second <= from)
            << "two live blocks share chunk " << chunk << " at step " << step;
      }
      used.emplace(std::make_pair(chunk, from), to);
      pos = end;
    }
  }
}

// lagging: streams finish their work only when the test says so (or the engine waits), as on
// a GPU that runs behind the host.
// options: EngineOptions beyond the address space (page size, stable pages). With stable pages
// the device must never see an alias, an unmap or an event before the final empty_cache().
void run_property(std::uint64_t seed, bool lagging, int steps, EngineOptions options = {}) {
  SimDeviceOptions o;
  o.capacity = 3 * GiB;
  o.streams_complete_immediately = !lagging;
  SimulatedDevice device(o);
  options.address_space = 6 * GiB;
  Engine engine(device, options);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_size(0.0, std::log(double(GiB)));
  std::vector<Live> live;
  std::map<std::uintptr_t, std::size_t> by_address;  // to check overlaps
  std::int64_t allocated = 0, ooms = 0;
  StreamOrderCheck order(device);

  for (int step = 0; step < steps; ++step) {
    if (lagging) {
      const StreamId s = rng() % 3;
      device.submit_work(s);  // a kernel on s
      if (rng() % 8 == 0) device.complete_stream(rng() % 3);
    }
    const bool do_free = !live.empty() && (live.size() >= 48 || rng() % 2 == 0);
    if (do_free) {
      const std::size_t i = rng() % live.size();
      if (lagging) order.freed(live[i]);
      engine.free(live[i].ptr);
      by_address.erase(reinterpret_cast<std::uintptr_t>(live[i].ptr));
      allocated -= static_cast<std::int64_t>((live[i].size + 511) / 512 * 512);
      live[i] = live.back();
      live.pop_back();
    } else {
      // Mostly small and medium sizes, with a tail up to 1 GiB (log-uniform).
      const auto size = static_cast<std::size_t>(std::exp(log_size(rng))) + 1;
      const StreamId stream = rng() % 3;
      void* p = nullptr;
      try {
        p = engine.malloc(size, stream);
      } catch (const OutOfMemoryError&) {
        ++ooms;
      }
      if (p) {
        const auto a = reinterpret_cast<std::uintptr_t>(p);
        ASSERT_EQ(a % kAlignment, 0u) << "step " << step;
        ASSERT_TRUE(device.is_accessible(a) && device.is_accessible(a + size - 1))
            << "block not inside mapped memory at step " << step;
        auto next = by_address.lower_bound(a);
        ASSERT_TRUE(next == by_address.end() || next->first >= a + size) << "overlap at step " << step;
        if (next != by_address.begin()) {
          auto prev = std::prev(next);
          ASSERT_LE(prev->first + prev->second, a) << "overlap at step " << step;
        }
        by_address.emplace(a, size);
        live.push_back({p, size, stream});
        if (lagging) ASSERT_EQ(order.taken(live.back()), "") << "step " << step;
        allocated += static_cast<std::int64_t>((size + 511) / 512 * 512);
      }
    }
    ASSERT_NO_THROW(engine.check_invariants()) << "step " << step;  // includes a stats recount
    if (step % 16 == 0) expect_physically_disjoint(device, live, step);
    if (options.stable_pages && step % 16 == 0) {
      ASSERT_LE(device.max_chunk_maps(), 1u) << "a chunk mapped at two pages at step " << step;
      ASSERT_EQ(device.calls(DeviceCall::unmap), 0u) << "a page lost its chunk at step " << step;
      ASSERT_EQ(device.calls(DeviceCall::record_event) + device.calls(DeviceCall::query_event) +
                    device.calls(DeviceCall::synchronize_event) +
                    device.calls(DeviceCall::wait_event),
                0u)
          << "a stream was waited for at step " << step;
    }
    if (step % 64 == 0) {
      const MemoryStats s = engine.stats();
      ASSERT_EQ(s.allocated_bytes[kAllPools].current, allocated);
      ASSERT_GE(s.reserved_bytes[kAllPools].current, s.allocated_bytes[kAllPools].current);
      ASSERT_EQ(s.reserved_bytes[kAllPools].current, static_cast<std::int64_t>(device.chunk_bytes()));
      ASSERT_EQ(s.reserved_bytes[kAllPools].current - s.allocated_bytes[kAllPools].current,
                s.free_mapped_bytes + s.free_unmapped_bytes + s.partial_page_bytes +
                    s.small_slack_bytes);
    }
  }
  EXPECT_GT(ooms, 0) << "the device never ran out: the pressure paths went untested";
  for (const Live& l : live) engine.free(l.ptr);
  engine.empty_cache();
  EXPECT_EQ(device.chunk_bytes(), 0u);
  engine.check_invariants();
}

TEST(EngineProperty, RandomOpsKeepEveryInvariant) { run_property(1, false, steps_from_env(150000)); }

TEST(EngineProperty, RandomOpsKeepEveryInvariantWithLaggingStreams) {
  run_property(2, true, steps_from_env(50000));
}

// Pages of four granules: every chunk is created, mapped and unmapped whole, 8 MiB at a time.
TEST(EngineProperty, RandomOpsKeepEveryInvariantWithLargerPages) {
  run_property(3, true, steps_from_env(50000), EngineOptions{.page_size = std::size_t{8} << 20});
}

// Stable pages (private pools for CUDA graphs): the same invariants, and no page ever aliased,
// remapped or waited for, with streams behind the host.
TEST(EngineProperty, RandomOpsKeepEveryInvariantWithStablePages) {
  run_property(4, true, steps_from_env(50000), EngineOptions{.stable_pages = true});
}

}  // namespace
}  // namespace gmem
