// Tests of the engine's map-ahead thread: waiting for it to go quiet.
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>

#include "gmem/engine.hpp"

namespace gmem {

// Waits until the engine's map-ahead thread has made no map for 20 ms (at most two seconds).
inline void let_map_ahead_settle(Engine& engine) {
  std::int64_t seen = -1;
  for (int quiet = 0, k = 0; quiet < 20 && k < 2000; ++k) {
    const std::int64_t now = engine.stats().num_maps_ahead;
    quiet = now == seen ? quiet + 1 : 0;
    seen = now;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace gmem
