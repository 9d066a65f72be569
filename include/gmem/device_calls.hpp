// The device's calls by kind (DeviceCall), each with the CUDA call it stands for and what it
// costs the host (kDeviceCallPrices): what the simulated device counts, prices and fails
// (SimCallLedger), and the name its errors carry.
#pragma once

#include <cstddef>
#include <iterator>

namespace gmem {

enum class DeviceCall : int {
  reserve_address,
  release_address,
  create_chunk,
  release_chunk,
  map,
  unmap,
  set_access,
  create_event,
  destroy_event,
  record_event,
  query_event,
  synchronize_event,
  mem_info,
  wait_event,
  count_  // number of kinds
};
// The CUDA driver call a kind stands for ("cuMemMap"): DeviceError::call() of its errors.
const char* device_call_name(DeviceCall call) noexcept;

// What each device call costs the host, in modelled microseconds. The driver prices a memory call
// per chunk it creates or releases and per mapping it maps, sets access on or unmaps, almost
// whatever the chunk's size (gpu/chunk_size_calls.cu, H100, driver 580: cuMemSetAccess took
// 28 us for a 2 MiB chunk and 31 us for a 128 MiB one; one call over 2,048 mappings of 2 MiB
// took as long as 2,048 calls). So a call costs `us` per unit (a chunk created or released, a
// map call, each mapping a set-access or unmap covers), as measured for 2 MiB, plus `further_us`
// for each further granule of those chunks or mappings: cuMemRelease of a 1 GiB chunk 16 + 511 x
// 0.76 = 404 us (measured 399), cuMemCreate 35 (36). The event calls were not measured alone:
// 1 us for record, create, destroy and synchronize (the call; the wait is counted apart) and
// 0.5 us for a query are estimates of a driver call that does no memory management. Address
// reservations and cuMemGetInfo are made a few times a run and are not priced.
struct DeviceCallPrice {
  DeviceCall call;
  double us;          // per chunk, map call or mapping covered (one per call for the others)
  double further_us;  // per granule of those beyond each one's first
};
inline constexpr DeviceCallPrice kDeviceCallPrices[] = {
    {DeviceCall::reserve_address, 0.0, 0.0},    // cuMemAddressReserve: not priced
    {DeviceCall::release_address, 0.0, 0.0},    // cuMemAddressFree: not priced
    {DeviceCall::create_chunk, 15.0, 0.04},     // cuMemCreate, per chunk
    {DeviceCall::release_chunk, 16.0, 0.76},    // cuMemRelease, per chunk
    {DeviceCall::map, 2.0, 0.0},                // cuMemMap, per call (one chunk)
    {DeviceCall::unmap, 22.0, 0.01},            // cuMemUnmap, per mapping in the range
    {DeviceCall::set_access, 38.0, 0.04},       // cuMemSetAccess, per mapping in the range
    {DeviceCall::create_event, 1.0, 0.0},       // cuEventCreate: estimated
    {DeviceCall::destroy_event, 1.0, 0.0},      // cuEventDestroy: estimated
    {DeviceCall::record_event, 1.0, 0.0},       // cuEventRecord: estimated
    {DeviceCall::query_event, 0.5, 0.0},        // cuEventQuery: estimated
    {DeviceCall::synchronize_event, 1.0, 0.0},  // cuEventSynchronize, the wait apart: estimated
    {DeviceCall::mem_info, 0.0, 0.0},           // cuMemGetInfo: not priced
    {DeviceCall::wait_event, 1.0, 0.0},         // cuStreamWaitEvent: estimated
};
// The table is indexed by DeviceCall: one row per kind, in the enum's order.
constexpr bool device_call_prices_in_order() {
  constexpr auto kinds = static_cast<std::size_t>(DeviceCall::count_);
  if (std::size(kDeviceCallPrices) != kinds) return false;
  for (std::size_t i = 0; i < kinds; ++i)
    if (static_cast<std::size_t>(kDeviceCallPrices[i].call) != i) return false;
  return true;
}
static_assert(device_call_prices_in_order(), "kDeviceCallPrices: one row per DeviceCall, in order");

}  // namespace gmem
