// The device layer: what the engine needs from a GPU, one-to-one with CUDA's virtual memory API
// (cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess / cuMemUnmap / cuMemRelease) plus
// events for stream ordering. Implementations: SimulatedDevice (tests, replay) and CudaDevice; a
// device that wraps another derives from ForwardingDevice (forwarding_device.hpp).
//
// Every method reports failure by throwing gmem::DeviceError; create_chunk throws one with
// device_out_of_memory() set when the device has no memory left.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace gmem {

using DevicePtr = std::uintptr_t;   // a device virtual address
using ChunkHandle = std::uint64_t;  // a physical allocation (CUmemGenericAllocationHandle)
using StreamId = std::uintptr_t;    // a cudaStream_t as an integer; 0 is the default stream
using EventHandle = std::uintptr_t; // a cudaEvent_t as an integer

struct DeviceMemInfo {
  std::size_t free = 0;
  std::size_t total = 0;
};

class Device {
 public:
  virtual ~Device() = default;

  // Physical allocation granularity: every chunk size and every mapping is a multiple of it.
  virtual std::size_t granularity() const = 0;
  virtual DeviceMemInfo mem_info() = 0;
  virtual std::string name() const = 0;
  virtual int index() const { return 0; }

  // Virtual address space: reserve a range (no memory behind it) and give it back.
  virtual DevicePtr reserve_address(std::size_t size, std::size_t alignment) = 0;
  virtual void release_address(DevicePtr base, std::size_t size) = 0;

  // Physical memory: create a chunk of `size` bytes (a multiple of granularity) and release it.
  virtual ChunkHandle create_chunk(std::size_t size) = 0;
  virtual void release_chunk(ChunkHandle chunk) = 0;

  // Map a whole chunk at `va` (inside a reserved range), unmap a mapped range, and make a mapped
  // range readable and writable by the device (cuMemSetAccess; may span several mappings).
  virtual void map(DevicePtr va, std::size_t size, ChunkHandle chunk) = 0;
  virtual void unmap(DevicePtr va, std::size_t size) = 0;
  virtual void set_access(DevicePtr va, std::size_t size) = 0;

  // Stream ordering. An event recorded on a stream completes when all work submitted to that
  // stream before the record has finished.
  virtual EventHandle create_event() = 0;
  virtual void destroy_event(EventHandle event) = 0;
  virtual void record_event(EventHandle event, StreamId stream) = 0;
  virtual bool query_event(EventHandle event) = 0;        // true when complete; never blocks
  virtual void synchronize_event(EventHandle event) = 0;  // blocks until complete
  // Makes `stream`'s work submitted from now on wait, on the GPU, for `event` as last recorded
  // (cuStreamWaitEvent): the host does not wait. A later record of the event does not change
  // what the stream waits for; an event never recorded is no wait. The engine asks it to hand
  // memory another stream freed to `stream` before that stream has reached the free, as
  // cudaMallocAsync's pools do (docs/notes/2026-11-25-memory-handed-between-streams.md). The default
  // waits on the host instead: slower, as safe.
  virtual void wait_event(StreamId stream, EventHandle event) {
    (void)stream;
    synchronize_event(event);
  }
  // Whether a CUDA graph is being captured on `stream` now (cuStreamIsCapturing): an event
  // recorded there would be a node of the graph, not the stream's progress, and querying it
  // would invalidate the capture. Asked only while the engine is told that a capture is under
  // way (Engine::set_capturing); the event calls above stay legal on the other streams, from any
  // thread (CudaDevice makes them in relaxed capture mode). A device that wraps another
  // forwards it.
  virtual bool stream_capturing(StreamId stream) {
    (void)stream;
    return false;
  }

  // The host's clock in microseconds, what the engine weighs the cost of its remaps against (is
  // buying memory worth it?): the steady clock for a real GPU; SimulatedDevice keeps a modelled
  // one. A device that wraps another forwards it. Called from any thread, with or without the
  // engine's lock.
  virtual double host_time() const {
    return std::chrono::duration<double, std::micro>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  // What the device's memory calls cost the host since it was made, in microseconds: the time
  // spent in create_chunk, release_chunk, map, unmap and set_access, and blocked in
  // synchronize_event (the engine waits for a stream before it unmaps or reuses a page the stream
  // may still use). Measured by CudaDevice, modelled by SimulatedDevice, zero where a device does
  // not keep them; a device that wraps another forwards it. The engine's stats report them as
  // gmem.device_call_us and gmem.stream_wait_us. Called from any thread.
  struct CallTimes {
    double calls_us = 0;
    double waits_us = 0;
  };
  virtual CallTimes call_times() const { return {}; }
};

}  // namespace gmem
