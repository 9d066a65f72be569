// The report a failed malloc deserves: what was asked, what was there, why it did not fit, who
// holds the memory, and what to do about it. As text for people and as JSON for tools.
//
// The cause, from the numbers at the moment of failure:
//   "live memory"               live allocations plus the request exceed the memory gmem may use
//                               (its limit, or the device's memory);
//   "memory held outside gmem"  it would fit in the device's memory, but others hold part of it
//                               (the CUDA context, NCCL, other processes);
//   "fragmentation"             the limit had room for it, but the free memory could not be
//                               formed into a range for it.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "gmem/error.hpp"
#include "gmem/leaks.hpp"
#include "gmem/tracker.hpp"

namespace gmem {

struct OomAllocation {  // one of the largest live allocations
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::uint64_t step = 0;
  std::string scope;
  std::string site;
};

struct OomReport {
  OomInfo info;
  std::size_t held_outside = 0;  // device total - device free - gmem's reserved (0 when unknown)
  std::size_t free_in_gmem = 0;  // reserved - allocated
  std::string cause;             // "live memory", "memory held outside gmem", "fragmentation"
  std::string explanation;       // one sentence with the numbers behind the cause
  bool tracked = false;          // a tracker supplied the breakdowns
  std::vector<UsageGroup> by_scope;           // live memory, largest first
  std::vector<UsageGroup> by_site;
  std::vector<OomAllocation> largest;         // the largest live allocations
  std::vector<LeakFinding> leak_suspects;
  std::vector<std::string> advice;            // what to try, most likely first
};

// The report for `info`. `live` are the live allocations (from Tracker::state(), or the engine's
// blocks made into LiveAllocations); `leaks` the tracker's leak suspects, if any.
OomReport build_oom_report(const OomInfo& info, const std::vector<LiveAllocation>& live,
                           const std::vector<LeakFinding>& leaks = {}, bool tracked = true);
// The same from a tracker's state and suspects (nullptr: numbers and advice only).
OomReport build_oom_report(const OomInfo& info, const Tracker* tracker);

std::string to_text(const OomReport& report);
std::string to_json(const OomReport& report);

}  // namespace gmem
