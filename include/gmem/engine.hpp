// gmem's caching engine: a fragmentation-free allocator over a Device.
//
//   Physical memory is held in chunks of the device's granularity (2 MiB) that can be mapped at
//   any virtual address, so a large request can be stitched from chunks freed anywhere instead of
//   failing for want of a contiguous range. Small requests (<= 1 MiB) come from size-classed
//   slabs. Mappings are cached: a steady training loop makes no device calls. Thread-safe.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "gmem/device.hpp"
#include "gmem/error.hpp"
#include "gmem/memory_resource.hpp"
#include "gmem/stats.hpp"

namespace gmem {

inline constexpr std::size_t kAlignment = 512;               // every block is aligned to this
inline constexpr std::size_t kSmallLimit = std::size_t{1} << 20;  // <= this: size-classed

struct EngineOptions {
  std::size_t memory_limit = 0;  // bytes gmem may hold; 0 = the device's total memory
  // Reserved memory may grow freely up to the allocated high-water mark times (1 + cache_slack);
  // beyond that, free chunks whose stream work has finished are reused (unmapped and remapped:
  // stitching) before new ones are created. The default (1/8) lets loops whose layout shifts
  // every step (GPT-2's logits) settle into a steady state with no device calls; 1/64 keeps
  // reserved within 2% of the peak but remaps pages every step. Under the memory limit gmem
  // always stitches rather than fail.
  // reuse_before_grow = false: no budget, grow until the limit and stitch only then.
  bool reuse_before_grow = true;
  double cache_slack = 1.0 / 8;
  // When stitching within the budget keeps moving pages (a quarter of the high-water mark's
  // worth), double cache_slack, up to 0.5: on a GPU every stitched page costs ~60 us.
  bool adaptive_slack = true;
  std::size_t address_space = 0;  // virtual bytes reserved per arena; 0 = 2x device total
};

// Reads a cache_slack from text ("0.125"; GMEM_CACHE_SLACK, gmem replay --cache-slack);
// throws Error(invalid_argument) naming `what` unless it is a number in [0, 16].
double parse_cache_slack(const std::string& text, const std::string& what);

// A live allocation as the engine sees it (for checks, tracking and snapshots).
struct BlockInfo {
  void* ptr = nullptr;
  std::size_t size = 0;       // rounded size handed out
  std::size_t requested = 0;  // size asked for
  StreamId stream = 0;
  bool small = false;
};

class Tracker;  // gmem/tracker.hpp

class Engine final : public MemoryResource {
 public:
  explicit Engine(Device& device, EngineOptions options = {});
  ~Engine() override;  // releases every chunk and address range back to the device
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Throws Error(invalid_argument) for 0 or absurd sizes, OutOfMemoryError when it cannot serve.
  void* malloc(std::size_t size, StreamId stream = 0);
  // Throws Error(invalid_pointer) for pointers gmem did not return, Error(double_free) when freed twice.
  void free(void* ptr);
  // `ptr` is also used on `stream`: when freed, it is reused only after `stream` has caught up.
  void record_stream(void* ptr, StreamId stream);

  void* allocate(std::size_t bytes, StreamId stream = 0) override { return malloc(bytes, stream); }
  void deallocate(void* ptr) override { free(ptr); }

  // Gives every free chunk back to the device (waits for streams where needed).
  void empty_cache();
  void set_memory_limit(std::size_t bytes);  // 0 = the device's total
  void set_memory_fraction(double fraction);  // of the device's total, in (0, 1]
  std::size_t memory_limit() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  MemoryStats stats() const;

  // The live allocation at `ptr` (its start); throws Error(invalid_pointer) when there is none.
  BlockInfo block_info(const void* ptr) const;
  // Calls `visit` for every live allocation, under the engine's lock.
  void for_each_block(const std::function<void(const BlockInfo&)>& visit) const;
  // Verifies every internal invariant (no overlaps, mapping and stats consistent); throws
  // std::logic_error describing the first violation. Slow: for tests.
  void check_invariants() const;

  Device& device() const;

 private:
  friend class Tracker;  // records into the engine's own block records, under its lock
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gmem
