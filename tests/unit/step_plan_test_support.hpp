// What the planned step layout tests (step_plan_engine_test.cpp, step_plan_threads_test.cpp)
// share: a training loop of steps by length, and rounds of lengths that settle.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "engine_test_support.hpp"
#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"

namespace gmem {

// A training step of "length" `len`: a long-lived block from the last step is freed, then
// activations are made (forward) and freed in reverse (backward), with temporaries between,
// and a new long-lived block is left for the next step. Returns the step's transient addresses.
struct Loop {
  Engine& engine;
  bool mark = true;
  void* carried = nullptr;
  std::function<void()> after_first_malloc;  // called once a step, after its first malloc
  std::vector<void*> step(std::size_t len) {
    std::vector<void*> transient;
    std::vector<void*> acts;
    for (int layer = 0; layer < 8; ++layer) {
      void* tmp = engine.malloc((3 + layer % 3) * len * MiB / 2);
      if (layer == 0 && after_first_malloc) after_first_malloc();
      acts.push_back(engine.malloc(len * MiB + (layer % 2) * 512 * 1024));
      transient.push_back(tmp);
      transient.push_back(acts.back());
      engine.free(tmp);
    }
    if (carried) engine.free(carried);
    while (!acts.empty()) {
      void* grad = engine.malloc(2 * len * MiB);
      transient.push_back(grad);
      engine.free(acts.back());
      acts.pop_back();
      engine.free(grad);
    }
    carried = engine.malloc(6 * MiB);  // outlives the step: placed online
    if (mark) engine.mark_step();
    return transient;
  }
};

inline std::uint64_t device_calls(const SimulatedDevice& d) {
  const SimCallLedger& ledger = d.ledger();
  return ledger.calls(DeviceCall::create_chunk) + ledger.calls(DeviceCall::map) +
         ledger.calls(DeviceCall::unmap);
}

// Five rounds of lengths 3, 7, 5 and 4, each a step(len) that returns its transient blocks: from
// round 3 on each length's blocks are where they were the round before, and no round calls the
// device. Returns each length's blocks of the last round.
inline std::map<std::size_t, std::vector<void*>> expect_rounds_settle(
    SimulatedDevice& device, Engine& engine, const std::function<std::vector<void*>(std::size_t)>& step) {
  const std::size_t lengths[] = {3, 7, 5, 4};
  std::map<std::size_t, std::vector<void*>> last;
  for (int round = 0; round < 5; ++round) {
    const std::uint64_t before = device_calls(device);
    for (const std::size_t len : lengths) {
      const std::vector<void*> addrs = step(len);
      if (round >= 3) EXPECT_EQ(addrs, last[len]) << "length " << len << " moved in round " << round;
      last[len] = addrs;
      engine.check_invariants();
    }
    if (round >= 3) EXPECT_EQ(device_calls(device) - before, 0u) << "round " << round;
  }
  return last;
}

}  // namespace gmem
