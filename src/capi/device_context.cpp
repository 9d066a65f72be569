// A device's engine and its private pools, read and reset as one device (capi/registry.hpp).
// Apart from registry.cpp so that a test registry (tests/unit/capi_fault_test.cpp) has it too.
#include <algorithm>
#include <memory>
#include <mutex>

#include "capi/registry.hpp"

namespace gmem::capi {

void DeviceContext::add_pool(Engine& pool) {
  std::lock_guard lock(pools_mutex_);
  if (!group_) {
    group_ = std::make_shared<StatsGroup>();
    engine->join_stats_group(group_);  // with its peaks so far: the device's, until now
  }
  pool.join_stats_group(group_);
  pools_.push_back(&pool);
}

void DeviceContext::remove_pool(Engine& pool) {
  std::lock_guard lock(pools_mutex_);
  std::erase(pools_, &pool);
}

MemoryStats DeviceContext::stats(bool detailed) const {
  std::lock_guard lock(pools_mutex_);
  MemoryStats sum = detailed ? engine->detailed_stats() : engine->stats();
  for (const Engine* pool : pools_) sum.add_engine(detailed ? pool->detailed_stats() : pool->stats());
  if (group_) group_->read(sum);
  return sum;
}

void DeviceContext::reset_peak_stats() {
  std::lock_guard lock(pools_mutex_);
  engine->reset_peak_stats();
  for (Engine* pool : pools_) pool->reset_peak_stats();
  if (group_) group_->reset_peaks();
}

void DeviceContext::reset_accumulated_stats() {
  std::lock_guard lock(pools_mutex_);
  engine->reset_accumulated_stats();
  for (Engine* pool : pools_) pool->reset_accumulated_stats();
  if (group_) group_->reset_accumulated();
}

}  // namespace gmem::capi
