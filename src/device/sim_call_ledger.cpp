#include "gmem/sim_call_ledger.hpp"

#include <algorithm>

#include "device/sim_results.hpp"
#include "gmem/error.hpp"

namespace gmem {

namespace {

std::size_t index_of(DeviceCall call) { return static_cast<std::size_t>(call); }

}  // namespace

void SimCallLedger::count(DeviceCall call, std::size_t units, std::size_t granules) {
  std::lock_guard lock(mutex_);
  const std::size_t i = index_of(call);
  const std::uint64_t number = ++calls_[i];
  const DeviceCallPrice& price = kDeviceCallPrices[i];
  units = std::max<std::size_t>(units, 1);  // a call that does nothing costs as one
  call_us_ += price.us * static_cast<double>(units) +
              price.further_us * static_cast<double>(granules > units ? granules - units : 0);
  if (failures_[i].at != 0 && failures_[i].at == number) {
    const bool oom = failures_[i].out_of_memory;
    failures_[i] = {};
    if (oom) throw DeviceError::out_of_memory(device_call_name(call), sim::kOutOfMemory, "injected failure");
    throw DeviceError(device_call_name(call), sim::kUnknown, "injected failure");
  }
}

std::uint64_t SimCallLedger::calls(DeviceCall call) const {
  std::lock_guard lock(mutex_);
  return calls_[index_of(call)];
}

void SimCallLedger::reset_call_counts() {
  std::lock_guard lock(mutex_);
  // Pending failures count from now: keep them the same number of calls away.
  for (std::size_t i = 0; i < calls_.size(); ++i) {
    if (failures_[i].at != 0) failures_[i].at -= calls_[i];
    calls_[i] = 0;
  }
  call_us_ = 0;
}

void SimCallLedger::fail_call(DeviceCall call, std::uint64_t nth, bool out_of_memory) {
  std::lock_guard lock(mutex_);
  const std::size_t i = index_of(call);
  failures_[i] = nth == 0 ? Failure{} : Failure{calls_[i] + nth, out_of_memory};
}

void SimCallLedger::set_host_time(double us) {
  std::lock_guard lock(mutex_);
  host_time_us_ = std::max(host_time_us_, us);
}

void SimCallLedger::advance_host_time(double us) {
  std::lock_guard lock(mutex_);
  if (us > 0) host_time_us_ += us;
}

double SimCallLedger::host_time() const {
  std::lock_guard lock(mutex_);
  return host_time_us_;
}

void SimCallLedger::wait_until(double us) {
  std::lock_guard lock(mutex_);
  if (us > host_time_us_) {
    wait_us_ += us - host_time_us_;
    host_time_us_ = us;
  }
}

double SimCallLedger::modelled_call_us() const {
  std::lock_guard lock(mutex_);
  return call_us_;
}

double SimCallLedger::modelled_wait_us() const {
  std::lock_guard lock(mutex_);
  return wait_us_;
}

Device::CallTimes SimCallLedger::call_times() const {
  std::lock_guard lock(mutex_);
  return {call_us_, wait_us_};
}

}  // namespace gmem
