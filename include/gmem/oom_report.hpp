// The report a failed malloc deserves: what was asked, what was there, why it did not fit, who
// holds the memory, and what to do about it. As text for people and as JSON for tools.
//
// The cause is decided by diagnose() (gmem/causes.hpp), as in the summary and `gmem leaks`: a
// leak, memory held outside gmem, a batch too large, a model and state too large, live memory (no
// step markers to tell those apart), or fragmentation; the explanation gives the evidence, and the
// advice starts with the fix for that cause.
#pragma once

#include <cstddef>
#include <cstdint>
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
  std::string cause;             // cause_name() of diagnose()'s cause: "leak", "fragmentation", ...
  std::string explanation;       // the evidence that decided it, one sentence
  std::uint64_t steps = 0;       // step boundaries seen (0: no step markers)
  std::size_t step_bytes = 0;    // live bytes allocated in the current step
  bool tracked = false;          // a tracker supplied the breakdowns
  std::vector<UsageGroup> by_scope;           // live memory, largest first
  std::vector<UsageGroup> by_site;
  std::vector<OomAllocation> largest;         // the largest live allocations
  std::vector<LeakFinding> leak_suspects;
  std::vector<std::string> advice;            // what to try, most likely first
};

// The report for `info`. `live` are the live allocations (from Tracker::state(), or the engine's
// blocks made into LiveAllocations); `leaks` the tracker's leak suspects, if any; `steps` the
// tracker's current step (0: no step markers), whose live allocations are the batch's.
OomReport build_oom_report(const OomInfo& info, const std::vector<LiveAllocation>& live,
                           const std::vector<LeakFinding>& leaks = {}, bool tracked = true,
                           std::uint64_t steps = 0);
// The same from a tracker's state and suspects (nullptr: numbers and advice only).
OomReport build_oom_report(const OomInfo& info, const Tracker* tracker);

std::string to_text(const OomReport& report);
std::string to_json(const OomReport& report);

}  // namespace gmem
