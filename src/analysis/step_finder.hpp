// Finding the steps of a training loop in a trace that has no step markers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gmem::analysis {

// Step ends from the live-memory curve (`live[i]`: bytes live after event i). A training step
// returns to its baseline (parameters, optimizer state), so step ends are the minima of the curve
// whose prominence (how far the curve climbs on both sides before coming lower) is large compared
// with the deepest one's; shallow dips inside a step (between forward and backward) are left out.
// Returns the indices i after which a step ends, ascending.
std::vector<std::size_t> step_ends_from_live_minima(const std::vector<std::int64_t>& live);

// Step starts from recurrence, for programs whose memory never falls back (inference that keeps
// its outputs): the occurrences of the most frequent key among those seen at least 3 times (ties:
// the key seen first). Returns the indices before which a step begins, ascending.
std::vector<std::size_t> step_starts_from_recurrence(const std::vector<std::uint64_t>& keys);

}  // namespace gmem::analysis
