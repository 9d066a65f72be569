// What the engine asked of the simulated device, for tests that count calls.
#pragma once

#include <cstdint>

#include "gmem/sim_device.hpp"

namespace gmem {

// Every call that creates, maps, unmaps, releases or sets access to memory.
inline std::uint64_t mapping_calls(const SimulatedDevice& d) {
  return d.calls(DeviceCall::create_chunk) + d.calls(DeviceCall::map) +
         d.calls(DeviceCall::unmap) + d.calls(DeviceCall::release_chunk) +
         d.calls(DeviceCall::set_access);
}

// Every event call (created, recorded, queried, waited for on the host or by a stream): what a
// capture forbids.
inline std::uint64_t event_calls(const SimulatedDevice& d) {
  return d.calls(DeviceCall::create_event) + d.calls(DeviceCall::record_event) +
         d.calls(DeviceCall::query_event) + d.calls(DeviceCall::synchronize_event) +
         d.calls(DeviceCall::wait_event);
}

}  // namespace gmem
