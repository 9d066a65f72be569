// Mapper: a range's slow path, once PageBacking found pages of it not mapped or not ready for
// its stream: remap the pages whose chunk is busy elsewhere, map the missing ones, then set
// access run by run.
//
// Its device calls (creates, the unmap of a clashing page, a stream wait, the MapJob: up to
// milliseconds) are made with the engine's lock released, so that other threads' mallocs and
// frees from mapped pages go on meanwhile; every decision is still made under the lock. What
// keeps other threads off this malloc's pages meanwhile (its references, and its claims on its
// two boundary pages), what stays under the lock, and the driver's rule on unmaps (MapCalls):
// docs/design.md#device-calls-outside-the-lock.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/accounting.hpp"
#include "engine/arenas.hpp"
#include "engine/chunk_source.hpp"
#include "engine/engine_lock.hpp"
#include "engine/map_ahead.hpp"
#include "engine/map_job.hpp"
#include "engine/page_backing.hpp"
#include "engine/placement.hpp"

namespace gmem::detail {

class Mapper {
 public:
  Mapper(Device& device, Arenas& arenas, const Placement& placement, PageBacking& pages,
         ChunkSource& chunks, MapCalls& calls, MapAhead& ahead, Accounting& accounting,
         const EngineLock& lock)
      : device_(device), arenas_(arenas), placement_(placement), pages_(pages), chunks_(chunks),
        calls_(calls), ahead_(ahead), accounting_(accounting), lock_(lock) {}

  // PageBacking::take's slow path, with every page's reference taken: true once every page is
  // mapped and ready; false on OOM (the references given back, ChunkSource's reason set);
  // a device error is rolled back and rethrown.
  bool map_missing(std::uint32_t arena, DevicePtr addr, std::size_t bytes);

 private:
  // Decide and book every map (the maps go to `job`; false on OOM, with the range's references
  // given back).
  bool plan_maps(std::uint32_t arena, DevicePtr addr, std::size_t bytes, MapJob& job, int& stage);
  // Lands the job's calls: a device failure gives the range's references back and is rethrown.
  void land(MapJob& job, DevicePtr addr, std::size_t bytes);
  // A boundary page is claimed by another slow malloc: give the references back, wait for it to
  // land, take the pages again.
  bool wait_and_take_again(std::uint32_t arena, DevicePtr addr, std::size_t bytes);
  // A page of [first, last] is claimed by another slow malloc, or in a map-ahead batch in flight.
  bool in_flight(std::uint32_t arena, std::size_t first, std::size_t last) const;
  std::uint64_t stamp(std::uint32_t arena) {
    return arenas_.streams().progress.stamp(arenas_[arena].stream);
  }

  Device& device_;
  Arenas& arenas_;
  const Placement& placement_;
  PageBacking& pages_;
  ChunkSource& chunks_;
  MapCalls& calls_;
  MapAhead& ahead_;
  Accounting& accounting_;
  const EngineLock& lock_;
};

}  // namespace gmem::detail
