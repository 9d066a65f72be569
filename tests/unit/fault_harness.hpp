// Test helpers for fault injection on real work and for the large concurrency runs: a trace
// compiled into malloc/free operations on numbered slots (as src/trace/replay.cpp does, without
// its measurements), what kind of build this is (sanitizers make runs slower), and the checks
// that every fault test makes after a failure.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <unordered_map>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/error.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/trace.hpp"

namespace gmem::testing {

// True in ASan/UBSan/TSan builds (scripts/test builds them with GMEM_SANITIZE, which defines
// GMEM_SANITIZED everywhere), where the long runs are scaled down.
constexpr bool kSanitized =
#if defined(GMEM_SANITIZED) || defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
    true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
    true;
#else
    false;
#endif
#else
    false;
#endif

// A count from the environment (for longer or shorter runs by hand), else `fallback`.
inline std::uint64_t count_from_env(const char* name, std::uint64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  return std::strtoull(value, nullptr, 10);
}

struct TraceOp {
  std::uint64_t size = 0;      // malloc only
  StreamId stream = 0;         // malloc only
  double host_advance_us = 0;  // trace time since the previous op
  std::uint32_t slot = 0;      // which live block
  bool malloc = false;
};

struct TraceProgram {
  std::string name;
  std::vector<TraceOp> ops;
  std::size_t slots = 0;
  std::vector<StreamId> streams;  // distinct streams the mallocs use, in order of first use
};

// The trace's first `max_ops` allocations and frees (0: all), blocks numbered by slot.
inline TraceProgram compile_trace(const trace::Trace& t, std::size_t max_ops = 0) {
  TraceProgram p;
  p.name = t.name;
  std::unordered_map<std::uint64_t, std::uint32_t> live;  // trace address -> slot
  std::vector<std::uint32_t> free_slots;
  std::int64_t last_us = 0;
  bool first = true;
  for (const trace::Event& e : t.events) {
    if (max_ops != 0 && p.ops.size() >= max_ops) break;
    if (e.action != trace::Action::alloc && e.action != trace::Action::free_completed) continue;
    TraceOp op;
    op.host_advance_us = first ? 0.0 : static_cast<double>(std::max<std::int64_t>(e.time_us - last_us, 0));
    last_us = first ? e.time_us : std::max(last_us, e.time_us);
    first = false;
    if (e.action == trace::Action::alloc) {
      std::uint32_t slot;
      if (free_slots.empty()) {
        slot = static_cast<std::uint32_t>(p.slots++);
      } else {
        slot = free_slots.back();
        free_slots.pop_back();
      }
      live[e.addr] = slot;
      op.malloc = true;
      op.size = e.size;
      op.stream = static_cast<StreamId>(e.stream);
      op.slot = slot;
      bool seen = false;
      for (StreamId s : p.streams) seen |= s == op.stream;
      if (!seen) p.streams.push_back(op.stream);
    } else {
      auto it = live.find(e.addr);
      if (it == live.end()) continue;  // freed before the prefix we keep: not ours
      op.slot = it->second;
      free_slots.push_back(it->second);
      live.erase(it);
    }
    p.ops.push_back(op);
  }
  return p;
}

// One kind of device call to fail: every DeviceCall, and create_chunk failing as the device out
// of memory.
struct Fault {
  DeviceCall call;
  bool oom = false;  // create_chunk failing as the device out of memory
};

inline std::string fault_name(const Fault& f) {
  return std::string(device_call_name(f.call)) + (f.oom ? "_OOM" : "");
}

inline std::vector<Fault> all_faults() {
  std::vector<Fault> faults;
  for (int i = 0; i < static_cast<int>(DeviceCall::count_); ++i)
    faults.push_back(Fault{static_cast<DeviceCall>(i), false});
  faults.push_back(Fault{DeviceCall::create_chunk, true});
  return faults;
}

// The engine and the device agree on the memory held: every chunk the device has is one the
// engine counts as reserved, and nothing more.
inline void expect_no_chunk_lost(const SimulatedDevice& device, const Engine& engine,
                                 const std::string& where) {
  EXPECT_EQ(static_cast<std::int64_t>(device.memory().chunk_bytes()),
            engine.stats().reserved_bytes[kAllPools].current)
      << where;
}

}  // namespace gmem::testing
