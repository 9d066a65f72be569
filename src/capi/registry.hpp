// One engine per device for the C API, created on first use and kept for the life of the
// process (never destroyed: PyTorch frees tensors during interpreter shutdown, after static
// destructors, and the CUDA driver may already be gone by then).
//
// The device behind each engine comes from the environment:
//   GMEM_DEVICE unset or "cuda": a CudaDevice, or a CudaSegmentDevice where VMM is unsupported
//   GMEM_DEVICE=segment:         a CudaSegmentDevice (to exercise the fallback on any GPU)
//   GMEM_DEVICE=sim:             one SimulatedDevice (device 0); GMEM_SIM_CAPACITY=bytes sizes it
#pragma once

#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "gmem/device.hpp"
#include "gmem/engine.hpp"
#include "gmem/error.hpp"
#include "gmem/stats_group.hpp"

namespace gmem {
class Tracker;  // include/gmem/tracker.hpp (H6)
namespace capi {
struct DeviceContext;
}
}  // namespace gmem

// An engine as the C API hands it out (gmem_engine_t, include/gmem/gmem.h): a device's own
// engine, or a private pool, an engine of its own over the device.
struct gmem_engine {
  gmem::capi::DeviceContext* context = nullptr;
  gmem::Engine* engine = nullptr;        // context->engine, or `owned`
  std::unique_ptr<gmem::Device> view;    // a pool's view of the device (capi::pool_view)
  std::unique_ptr<gmem::Engine> owned;   // a pool's engine, destroyed before its view; null for
                                         // a device's own
};

namespace gmem::capi {

struct DeviceContext {
  int index = 0;
  std::unique_ptr<Device> device;  // the device itself
  std::unique_ptr<Device> view;    // `device` as its own engine uses it: ranges recorded as engine's
  std::unique_ptr<Engine> engine;
  gmem_engine handle;              // the device's own engine as a handle: {this, engine}
  // Observability hook: when set, the C API reports allocations and frees to it (H6 wires this
  // up from include/gmem/tracker.hpp). Null means no tracking.
  Tracker* tracker = nullptr;

  // Private pools made on the device (gmem_pool_create) count as the device's, as PyTorch counts
  // its graph pools: a pool added here joins the device's StatsGroup (made with the first pool,
  // with the device's engine in it), so that the device's peaks are those of the engines' sum.
  void add_pool(Engine& pool);
  void remove_pool(Engine& pool);  // before the pool is destroyed
  // The device's engine and its pools as one: what gmem_stat, gmem_device_stats and the summary
  // report. O(1) per engine unless `detailed`.
  MemoryStats stats(bool detailed) const;
  void reset_peak_stats();
  void reset_accumulated_stats();

 private:
  mutable std::mutex pools_mutex_;  // taken before any engine's lock
  std::vector<Engine*> pools_;
  std::shared_ptr<StatsGroup> group_;
};

// The context of `device` (-1 = the calling thread's current CUDA device, 0 when simulated),
// created on first use; thread-safe. Throws Error(invalid_argument) for an ordinal that does not
// exist and DeviceError when the device cannot be opened.
DeviceContext& context(int device);

// The engine, a device's own or a pool, whose address space holds `ptr`: one lookup from a
// pointer to its device (->context) and pool; the block is then the engine's to find. nullptr
// when `ptr` lies outside every engine's address space (a foreign pointer).
gmem_engine* owner(const void* ptr);
// The engine to ask about `ptr`: owner(ptr), but without a lookup while one engine is in use (one
// device, no pool), whose own block lookup then tells a foreign pointer apart. gmem_free's path.
gmem_engine* likely_owner(const void* ptr);

// What gmem_free and gmem_engine_of say of a pointer no engine owns.
inline Error foreign_pointer(const void* ptr) {
  char text[96];
  std::snprintf(text, sizeof text, "%p was not allocated by gmem (no engine owns this address)",
                ptr);
  return Error(Errc::invalid_pointer, text);
}

// A view of `context`'s device for the pool `pool`: the address ranges the pool's engine reserves
// through it are recorded as the pool's, so that owner() finds the pool.
std::unique_ptr<Device> pool_view(DeviceContext& context, gmem_engine& pool);

// Every context created so far, in creation order.
void for_each_context(const std::function<void(DeviceContext&)>& visit);

}  // namespace gmem::capi
