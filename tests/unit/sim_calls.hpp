// What the engine asked of the simulated device, for tests that count calls, and the held
// free (record_stream) several of them set up.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"

namespace gmem {

// Every call that creates, maps, unmaps, releases or sets access to memory.
inline std::uint64_t mapping_calls(const SimulatedDevice& d) {
  const SimCallLedger& ledger = d.ledger();
  return ledger.calls(DeviceCall::create_chunk) + ledger.calls(DeviceCall::map) +
         ledger.calls(DeviceCall::unmap) + ledger.calls(DeviceCall::release_chunk) +
         ledger.calls(DeviceCall::set_access);
}

// Every event call (created, recorded, queried, waited for on the host or by a stream): what a
// capture forbids.
inline std::uint64_t event_calls(const SimulatedDevice& d) {
  const SimCallLedger& ledger = d.ledger();
  return ledger.calls(DeviceCall::create_event) + ledger.calls(DeviceCall::record_event) +
         ledger.calls(DeviceCall::query_event) + ledger.calls(DeviceCall::synchronize_event) +
         ledger.calls(DeviceCall::wait_event);
}

// A block of `bytes` that `stream` made, used on `other` too (record_stream) by a kernel still
// running there, then freed: the free is held for `other`. Its address (freed: to compare only)
// and the kernel's work item on `other`.
struct HeldFree {
  void* ptr;
  std::uint64_t kernel;
};
inline HeldFree free_held_by(SimulatedDevice& d, Engine& engine, std::size_t bytes, StreamId stream,
                             StreamId other) {
  void* p = engine.malloc(bytes, stream);
  engine.record_stream(p, other);
  d.streams().submit_work(other);
  const std::uint64_t kernel = d.streams().submitted(other);
  engine.free(p);
  return {p, kernel};
}

}  // namespace gmem
