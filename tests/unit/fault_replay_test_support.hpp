// What the fault replay tests (fault_replay_traces_test.cpp, fault_replay_threads_test.cpp)
// share: the traces compiled once, the figures tallied for README, what an injected fault looks
// like to the caller, and the suite of every fault kind (instantiated in the traces' file).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "engine_test_support.hpp"
#include "fault_harness.hpp"
#include "gmem/error.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/trace.hpp"

namespace gmem {

inline constexpr std::size_t kGranule = 2 * MiB;
inline constexpr std::size_t kCapacity = std::size_t{80} << 30;  // also each arena's virtual size

inline std::string data_file(const std::string& name) { return std::string(GMEM_TEST_DATA) + "/" + name; }

// Figures for README: per fault kind, summed over traces (printed at the end of the run).
struct Tally {
  std::uint64_t runs = 0, injected = 0, surfaced = 0, survived_runs = 0, ops = 0;
  std::uint64_t waits = 0, retries = 0;  // the engine's num_sync_all_streams, num_alloc_retries
  Tally& operator+=(const Tally& t) {
    runs += t.runs;
    injected += t.injected;
    surfaced += t.surfaced;
    survived_runs += t.survived_runs;
    ops += t.ops;
    waits += t.waits;
    retries += t.retries;
    return *this;
  }
};
inline std::mutex g_tally_mutex;
inline std::map<std::string, Tally> g_replay_tally, g_tight_tally, g_thread_tally;

class PrintTallies : public ::testing::Environment {
 public:
  void TearDown() override {
    auto print = [](const char* title, const std::map<std::string, Tally>& tally) {
      if (tally.empty()) return;
      std::printf("\n%s\n%-24s %6s %9s %9s %9s %10s %8s %8s\n", title, "fault", "runs", "injected",
                  "surfaced", "survived", "ops", "waits", "retries");
      auto row = [](const char* name, const Tally& t) {
        std::printf("%-24s %6llu %9llu %9llu %9llu %10llu %8llu %8llu\n", name,
                    static_cast<unsigned long long>(t.runs), static_cast<unsigned long long>(t.injected),
                    static_cast<unsigned long long>(t.surfaced),
                    static_cast<unsigned long long>(t.survived_runs), static_cast<unsigned long long>(t.ops),
                    static_cast<unsigned long long>(t.waits), static_cast<unsigned long long>(t.retries));
      };
      Tally sum;
      for (const auto& [name, t] : tally) {
        row(name.c_str(), t);
        sum += t;
      }
      row("total", sum);
    };
    std::lock_guard lock(g_tally_mutex);
    print("fault injection on trace replays (injected: failures fired; surfaced: reported to the caller)",
          g_replay_tally);
    print("fault injection on tight devices (two_streams 832 MiB, resnet50 5.6 GiB, gpt2 13 GiB, llama 11.25 GiB)",
          g_tight_tally);
    print("fault injection under 4 threads", g_thread_tally);
  }
};
// Registered once, however many files include this (an inline variable).
inline const auto* const g_print = ::testing::AddGlobalTestEnvironment(new PrintTallies);

// Whether `e` is what the injected fault should look like to the caller.
inline bool reads_as(const std::exception& e, const testing::Fault& f) {
  if (f.oom) {
    const auto* oom = dynamic_cast<const OutOfMemoryError*>(&e);
    return oom != nullptr && oom->info().reason == "device";
  }
  const auto* de = dynamic_cast<const DeviceError*>(&e);
  const std::string name = device_call_name(f.call);
  return de != nullptr && de->call() == name && std::string(e.what()).find(name) != std::string::npos &&
         std::string(e.what()).find("injected failure") != std::string::npos;
}

// The traces, cut to keep the suite quick (the sanitizer builds take a shorter cut).
struct TraceCut {
  const char* file;
  std::size_t max_ops;
};
inline const TraceCut kTraces[] = {
    {"resnet50.trace.csv.gz", 0},                   // 6.7k mallocs and frees, one stream
    {"gpt2.trace.csv.gz", 0},                       // 13.6k, one stream
    {"two_streams.trace.csv.gz", 0},                // two streams taking memory from each other
    {"llama_ckpt_varlen.trace.csv.gz", 0},          // 84k, lengths taking turns: stitching, unmaps
};

inline const std::vector<testing::TraceProgram>& programs() {
  static const std::vector<testing::TraceProgram> all = [] {
    std::vector<testing::TraceProgram> out;
    for (const TraceCut& cut : kTraces) {
      std::size_t max_ops = cut.max_ops;
      if (testing::kSanitized) max_ops = max_ops == 0 ? 6000 : std::min<std::size_t>(max_ops, 6000);
      out.push_back(testing::compile_trace(trace::read_trace(data_file(cut.file)), max_ops));
    }
    return out;
  }();
  return all;
}

inline void add_tally(std::map<std::string, Tally>& tally, const std::string& name, const Tally& t) {
  std::lock_guard lock(g_tally_mutex);
  tally[name] += t;
}

// One fixture type for every file with a TEST_P of the suite (GoogleTest requires it).
class FaultReplay : public ::testing::TestWithParam<testing::Fault> {};

}  // namespace gmem
