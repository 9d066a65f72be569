#include "gmem/device_calls.hpp"

namespace gmem {

const char* device_call_name(DeviceCall call) noexcept {
  switch (call) {
    case DeviceCall::reserve_address: return "cuMemAddressReserve";
    case DeviceCall::release_address: return "cuMemAddressFree";
    case DeviceCall::create_chunk: return "cuMemCreate";
    case DeviceCall::release_chunk: return "cuMemRelease";
    case DeviceCall::map: return "cuMemMap";
    case DeviceCall::unmap: return "cuMemUnmap";
    case DeviceCall::set_access: return "cuMemSetAccess";
    case DeviceCall::create_event: return "cuEventCreate";
    case DeviceCall::destroy_event: return "cuEventDestroy";
    case DeviceCall::record_event: return "cuEventRecord";
    case DeviceCall::query_event: return "cuEventQuery";
    case DeviceCall::synchronize_event: return "cuEventSynchronize";
    case DeviceCall::mem_info: return "cuMemGetInfo";
    case DeviceCall::wait_event: return "cuStreamWaitEvent";
    case DeviceCall::count_: break;
  }
  return "unknown";
}

}  // namespace gmem
