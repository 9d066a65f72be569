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
  unsigned also = 0;  // record_stream: the other streams it is used on, a bit each
};

// Stream order: memory a block used goes to a block of another stream only once that stream's
// work comes after the kernels that may have used it (SimStreams::ordered_after: that work
// done, or the taker made to wait for it). Kept by the physical bytes, (chunk, granule, bytes in
// it): what a freed block's kernels may touch up to, by stream (its own and those record_stream
// added). Bytes, not granules: a page holds a slab of its stream beside a block freed there.
class StreamOrderCheck {
 public:
  explicit StreamOrderCheck(const SimulatedDevice& device) : device_(device) {}
  // visit((chunk, granule's offset in it), first byte, end) for each granule the block covers.
  template <class F>
  void for_pieces(const Live& l, F&& visit) const {
    const std::size_t granule = device_.granularity();
    const auto begin = reinterpret_cast<std::uintptr_t>(l.ptr);
    const std::uintptr_t end = begin + l.size;
    for (std::uintptr_t pos = begin & ~(granule - 1); pos < end; pos += granule) {
      const std::size_t lo = pos < begin ? begin - pos : 0;
      const std::size_t hi = std::min<std::uintptr_t>(end - pos, granule);
      visit(device_.memory().physical_at(pos), lo, hi);
    }
  }
  void freed(const Live& l) {  // its kernels: everything submitted to its streams so far
    for_pieces(l, [&](std::pair<ChunkHandle, std::size_t> at, std::size_t lo, std::size_t hi) {
      std::vector<Use>& uses = used_[at];
      if (uses.size() >= 64) prune(uses);
      for (StreamId s = 0; s < kStreams; ++s)
        if (s == l.stream || (l.also >> s & 1u))
          uses.push_back({lo, hi, s, device_.streams().submitted(s)});
    });
  }
  // Returns "" or what broke the order.
  std::string taken(const Live& l) const {
    std::string broken;
    for_pieces(l, [&](std::pair<ChunkHandle, std::size_t> at, std::size_t lo, std::size_t hi) {
      auto it = used_.find(at);
      if (it == used_.end() || !broken.empty()) return;
      for (const Use& u : it->second)
        if (u.lo < hi && lo < u.hi && !device_.streams().ordered_after(l.stream, u.stream, u.work))
          broken = "chunk " + std::to_string(at.first) + " went to stream " +
                   std::to_string(l.stream) + " before stream " + std::to_string(u.stream) +
                   " reached work item " + std::to_string(u.work);
    });
    return broken;
  }

  static constexpr StreamId kStreams = 3;

 private:
  struct Use {
    std::size_t lo, hi;  // bytes of the granule
    StreamId stream;
    std::uint64_t work;
  };
  // Forgets the uses every stream's work now comes after.
  void prune(std::vector<Use>& uses) const {
    std::erase_if(uses, [&](const Use& u) {
      for (StreamId s = 0; s < kStreams; ++s)
        if (!device_.streams().ordered_after(s, u.stream, u.work)) return false;
      return true;
    });
  }
  const SimulatedDevice& device_;
  std::map<std::pair<ChunkHandle, std::size_t>, std::vector<Use>> used_;
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
      const auto [chunk, from] = device.memory().physical_at(pos);
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
      device.streams().submit_work(s);  // a kernel on s
      if (rng() % 8 == 0) device.streams().complete_stream(rng() % 3);
    }
    // A block used on another stream too (not in stable pools' runs: their events would count
    // as waits below).
    if (lagging && !options.stable_pages && !live.empty() && rng() % 16 == 0) {
      Live& l = live[rng() % live.size()];
      const StreamId other = (l.stream + 1 + rng() % 2) % 3;
      engine.record_stream(l.ptr, other);
      l.also |= 1u << other;
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
        ASSERT_TRUE(device.memory().is_accessible(a) && device.memory().is_accessible(a + size - 1))
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
      ASSERT_LE(device.memory().max_chunk_maps(), 1u)
          << "a chunk mapped at two pages at step " << step;
      ASSERT_EQ(device.ledger().calls(DeviceCall::unmap), 0u)
          << "a page lost its chunk at step " << step;
      ASSERT_EQ(device.ledger().calls(DeviceCall::record_event) +
                    device.ledger().calls(DeviceCall::query_event) +
                    device.ledger().calls(DeviceCall::synchronize_event) +
                    device.ledger().calls(DeviceCall::wait_event),
                0u)
          << "a stream was waited for at step " << step;
    }
    if (step % 64 == 0) {
      const MemoryStats s = engine.stats();
      ASSERT_EQ(s.allocated_bytes[kAllPools].current, allocated);
      ASSERT_GE(s.reserved_bytes[kAllPools].current, s.allocated_bytes[kAllPools].current);
      ASSERT_EQ(s.reserved_bytes[kAllPools].current,
                static_cast<std::int64_t>(device.memory().chunk_bytes()));
      ASSERT_EQ(s.reserved_bytes[kAllPools].current - s.allocated_bytes[kAllPools].current,
                s.free_mapped_bytes + s.free_unmapped_bytes + s.partial_page_bytes +
                    s.small_slack_bytes + s.pending_free_bytes);
    }
  }
  EXPECT_GT(ooms, 0) << "the device never ran out: the pressure paths went untested";
  for (const Live& l : live) engine.free(l.ptr);
  engine.empty_cache();
  EXPECT_EQ(device.memory().chunk_bytes(), 0u);
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
