// Leak detection: allocations that survive step boundaries, grouped by site (a "file:line:function"
// frame, or a scope or module name), and a site flagged when the bytes it keeps alive grow step
// after step.
//
// Fed a stream of events, either online (the in-process tracker calls on_alloc / on_free / on_step)
// or from a trace (find_leaks below, which infers the steps when the trace has no markers).
//
// How a site is judged: at every step boundary k the detector records S(k), the bytes the site
// holds that were allocated at least one whole step earlier (so a batch prefetched across one
// boundary does not count). A leak makes S grow at most boundaries up to the last one; optimizer
// state created once makes a single jump (not flagged); a cache that grows and then stops is not
// flagged either, because its growth does not reach the last boundaries.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gmem/trace.hpp"

namespace gmem {

// One of the leaked allocations, still live, for people to recognise the leak by.
struct LeakSample {
  std::uint64_t addr = 0;
  std::uint64_t size = 0;
  std::int64_t time_us = 0;
  std::string stack;  // frames, innermost first, one a line
};

struct LeakFinding {
  std::string site;
  std::int64_t bytes_per_step = 0;   // average growth per step (or detected period) while leaking
  std::int64_t surviving_bytes = 0;  // bytes the site accumulated while leaking (one-off jumps excluded)
  std::int64_t first_seen_us = 0;    // allocation time of the first leaked block still live
  std::size_t first_step = 0;        // the step (period) whose allocations began to survive
  std::size_t periods = 0;           // steps from first_step to the last boundary
  std::size_t growing_periods = 0;   // of those, how many grew
  // Graph tracking (PyTorch, gmem.torch.track_graphs): of the leak's blocks still live, the bytes
  // PyTorch saved for a backward pass that has not used them: a graph kept alive. 0 without it.
  std::int64_t graph_bytes = 0;
  // A backward pass has run in this program: a graph kept alive is then a value kept with its
  // graph (losses.append(loss)), not inference run without torch.no_grad().
  bool backward_runs = false;
  LeakSample sample;
};

struct LeakOptions {
  std::size_t min_growing_periods = 3;  // fewer growth steps than this is not a trend
  // Of the steps since the leak began, counted at the site's rhythm (a site growing every fourth
  // step has a quarter as many chances), how many must grow.
  double min_growing_fraction = 0.5;
  // A step that grows this many times more than the site's median growth is a one-off (a
  // workspace created on first use, say): it neither counts as growth nor breaks the trend.
  double one_off_factor = 4.0;
  // A drop of at most this fraction of what the site holds does not end a trend (a leak that
  // sometimes drops an old block is still a leak).
  double drop_tolerance = 0.05;
};

// Not thread-safe: callers serialise (the tracker calls it under its own lock).
class LeakDetector {
 public:
  explicit LeakDetector(LeakOptions options = {});
  ~LeakDetector();
  LeakDetector(LeakDetector&&) noexcept;
  LeakDetector& operator=(LeakDetector&&) noexcept;

  // An allocation at `site`. An address allocated again without a free in between replaces the
  // old allocation (its free was missed).
  void on_alloc(std::uint64_t addr, std::uint64_t size, std::string_view site, std::int64_t time_us,
                std::string_view stack = {});
  // Frees of addresses never seen (allocated before tracking began) are ignored.
  void on_free(std::uint64_t addr);
  // The live block at `addr` holds a tensor saved for a backward pass (or no more: the backward
  // used it). Unknown addresses are ignored.
  void on_saved(std::uint64_t addr, bool saved);
  // A backward pass ran in the program.
  void on_backward();
  // A step boundary: the step counter advances. Steps are numbered from 0 (before the first marker).
  void on_step(std::int64_t time_us);

  std::size_t steps() const;      // boundaries seen
  std::size_t live_count() const;  // allocations live now
  // The sites whose surviving bytes grow, largest bytes_per_step first.
  std::vector<LeakFinding> findings() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};


// The leak analysis of a whole trace.
struct LeakReport {
  std::string trace_name;
  std::vector<LeakFinding> leaks;
  std::size_t periods = 0;    // steps (step boundaries) used
  // Where the steps came from: the trace's markers (Trace::steps_source: "gmem.step() markers",
  // "annotation '...'") or, inferred, "live-memory minima", "recurring allocation"; "none".
  std::string period_source;
  bool steps_marked = false;  // from the trace's markers, not inferred
  std::vector<std::int64_t> step_times_us;  // each boundary's time, as the detector saw it (reports)
  std::int64_t start_us = 0;  // time of the trace's first event: reports give times from it
  // Where the file's history began: mid-run (a ring that wrapped) it starts with blocks already
  // live, counted as older than the history and never as its leaks (trace::HistoryWindow).
  trace::HistoryWindow window;
  // What was looked at, for a report that finds nothing ("1234 allocations"; live: since when).
  std::string looked_at;
};

// Runs the detector over a trace. Steps are the trace's step markers where it has them (gmem's
// snapshots carry gmem.step(); PyTorch's may carry annotations, see Trace::steps_us); else they are
// inferred from the deep minima of live memory (a training loop returns to its baseline between
// steps) or, when live memory never falls back (inference keeping its outputs), from the most
// frequent allocation. Only events up to the last boundary count: the teardown after the loop frees
// everything. Throws BadInputError for a malformed trace, as replay() does (trace/replay.hpp).
LeakReport find_leaks(const trace::Trace& trace, LeakOptions options = {});

// For people: one paragraph a finding ("no leaks found" when none).
std::string format_leaks(const LeakReport& report);
// One JSON object: {"trace", "periods", "period_source", "steps_marked", "start_us", "cause",
// "evidence", "leaks":[{...}]}; times in "leaks" are microseconds from start_us.
std::string leaks_json(const LeakReport& report);

}  // namespace gmem
