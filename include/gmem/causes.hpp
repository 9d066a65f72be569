// Why memory ran out, or is running out: one decision from the evidence, shared by the OOM report,
// the summary and `gmem leaks`, so that they never disagree about the cause.
//
// The causes, tried in this order (the first that the evidence supports wins):
//   graph kept alive           a leak (below) where most of the kept memory is tensors PyTorch
//                              saved for a backward pass that never used them (graph tracking,
//                              LeakFinding::graph_bytes): outputs kept from inference run without
//                              no_grad, or a loss kept with its graph;
//   leak                       memory kept across steps and still growing (the leak test's
//                              findings) and large enough to matter: it holds at least the
//                              shortfall (without it the request would fit), or a quarter of the
//                              live memory;
//   memory held outside gmem   the device, not gmem's limit, was short, and others (the CUDA
//                              context, NCCL, other processes) hold at least the shortfall;
//   batch too large            live memory plus the request exceed what gmem may use, and this
//                              step's allocations (activations, which grow with the batch) hold at
//                              least the shortfall: a smaller batch fits;
//   model and state too large  the same, but memory kept from earlier steps (weights, optimizer
//                              state) is too large for a smaller batch to make up for;
//   live memory                the same without step markers: a large batch and a leak cannot be
//                              told apart (call gmem.step() each step);
//   fragmentation              live memory plus the request fit under the limit and the leak test
//                              found nothing: the free memory is there but not in one range (with
//                              no failed request, as in a summary: free memory stranded in pages
//                              and slabs shared with live blocks is a tenth of reserved or more);
//   none                       nothing above.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gmem/leaks.hpp"

namespace gmem {

enum class Cause { none, graph_kept, leak, held_outside, batch_too_large, model_too_large, live_memory, fragmentation };

// "graph kept alive", "leak", "memory held outside gmem", ... as in the comment above.
const char* cause_name(Cause cause) noexcept;

// The numbers the decision is made from; 0 where unknown.
struct CauseEvidence {
  std::size_t requested = 0;  // the failed request (0: no failure, as in a summary or `gmem leaks`)
  std::size_t allocated = 0;  // live bytes
  std::size_t reserved = 0;   // bytes gmem holds from the device
  std::size_t limit = 0;      // gmem's memory limit
  std::size_t device_total = 0, device_free = 0;
  std::size_t largest_free_range = 0;
  std::size_t stranded = 0;   // free bytes in pages and slabs shared with live blocks
  // Steps: boundaries seen (0: no step markers), and the live bytes allocated since the last one.
  std::uint64_t steps = 0;
  std::size_t step_bytes = 0;
  std::vector<LeakFinding> leaks;  // the leak test's findings, largest growth first
};

struct Diagnosis {
  Cause cause = Cause::none;
  std::string name;      // cause_name(cause)
  std::string evidence;  // the numbers that decided it, one sentence
  std::size_t held_outside = 0;  // device total - free - gmem's reserved (0 when unknown)
  std::size_t leaked = 0;        // bytes the leak findings keep
  std::size_t graph_kept = 0;    // of those, bytes saved for a backward that never used them
  std::vector<std::string> advice;  // the fix for this cause first, then what else may help
};

Diagnosis diagnose(const CauseEvidence& evidence);

}  // namespace gmem
