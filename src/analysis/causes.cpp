// diagnose(): the cause from the evidence, in the order of include/gmem/causes.hpp, and advice
// ordered by it.
#include "gmem/causes.hpp"

#include <algorithm>

#include "gmem/error.hpp"

namespace gmem {
namespace {

std::size_t minus(std::size_t a, std::size_t b) { return a > b ? a - b : 0; }

std::string bytes(std::size_t n) { return format_bytes(n); }
std::string bytes(std::int64_t n) { return format_bytes(static_cast<std::uint64_t>(std::max<std::int64_t>(n, 0))); }

std::string percent_of(std::size_t part, std::size_t whole) {
  if (whole == 0) return "";
  return " (" + std::to_string(static_cast<unsigned>(100.0 * static_cast<double>(part) /
                                                      static_cast<double>(whole) + 0.5)) +
         "% of live memory)";
}

// What gmem could have held at most: its limit where that binds, else what the device could give.
struct Capacity {
  std::size_t bytes = 0;  // 0: unknown
  bool device_binds = false;
};

Capacity capacity_of(const CauseEvidence& e) {
  const bool device_known = e.device_total > 0;
  const std::size_t device_room = e.reserved + e.device_free;
  if (e.limit > 0 && (!device_known || e.limit <= device_room)) return {e.limit, false};
  if (device_known) return {device_room, true};
  return {e.limit, false};
}

std::string leak_fix(const LeakFinding& leak) {
  return "Stop keeping tensors from " + leak.site + " across steps (+" + bytes(leak.bytes_per_step) +
         " a step): for inference, run it under torch.no_grad() or torch.inference_mode(); to keep "
         "a loss or a metric, keep loss.item() or tensor.detach(), not the tensor with its graph.";
}

// The fix for a graph kept alive: what keeps it follows from whether the program runs backward.
std::string graph_fix(const LeakFinding& leak) {
  const std::string kept = "+" + bytes(leak.bytes_per_step) + " a step of activations saved at " + leak.site;
  if (!leak.backward_runs)
    return "Run inference under torch.no_grad() or torch.inference_mode(): no backward pass runs "
           "in this program, yet the outputs it keeps hold their autograd graph (" + kept + ").";
  return "Keep loss.item() or tensor.detach(), not the tensor: a value kept across steps (as in "
         "losses.append(loss)) holds the autograd graph it was computed with (" + kept +
         "), and no backward pass uses it. Compute values that are only logged or evaluated under "
         "torch.no_grad().";
}

// A finding is a graph kept alive when most of what it keeps was saved for a backward.
bool is_graph(const LeakFinding& leak) {
  return leak.graph_bytes > 0 && 2 * leak.graph_bytes >= leak.surviving_bytes;
}

const char* kSmallerBatch = "Use a smaller batch (or shorter sequences): activations grow with it.";
const char* kSmallerBatchFit =
    "Use a smaller batch (or shorter sequences): activations grow with it. To find the largest "
    "batch that fits by measurement, with no crash: gmem.fit_batch_size(step) (docs/fit.md).";
const char* kNoGrad =
    "For inference, run under torch.no_grad() or torch.inference_mode(), so that no activations "
    "are kept for a backward pass.";
const char* kCheckpointing =
    "Use activation checkpointing (torch.utils.checkpoint) to recompute activations in backward "
    "instead of keeping them.";
const char* kDropReferences =
    "Drop references you no longer need (outputs or losses kept in lists, caches); del them "
    "before the next step.";
const char* kMarkSteps =
    "Mark steps, so that gmem can tell a leak from a large batch: gmem.step() at the end of each "
    "step, or gmem.torch.watch(optimizer).";

void add_outside_advice(Diagnosis& d) {
  d.advice.push_back("Other users of the device hold " + bytes(d.held_outside) +
                     ": check nvidia-smi for other processes on this GPU.");
  d.advice.push_back("On a shared GPU, give each process its share with gmem.set_memory_limit() or "
                     "set_memory_fraction(), so that no process starves the others.");
  d.advice.push_back("NCCL reserves buffers per communicator: fewer process groups or a smaller "
                     "NCCL_BUFFSIZE give some back.");
}

void add_fragmentation_advice(Diagnosis& d) {
  d.advice.push_back("Free memory is scattered over pages partly used by small, long-lived tensors: "
                     "create persistent buffers (parameters, optimizer state) before the training "
                     "loop, and free short-lived ones promptly.");
  d.advice.push_back("Leave some headroom: a slightly higher limit (set_memory_limit) absorbs the "
                     "partly used pages.");
}

}  // namespace

const char* cause_name(Cause cause) noexcept {
  switch (cause) {
    case Cause::none: return "none";
    case Cause::graph_kept: return "graph kept alive";
    case Cause::leak: return "leak";
    case Cause::held_outside: return "memory held outside gmem";
    case Cause::batch_too_large: return "batch too large";
    case Cause::model_too_large: return "model and state too large";
    case Cause::live_memory: return "live memory";
    case Cause::fragmentation: return "fragmentation";
  }
  return "?";
}

Diagnosis diagnose(const CauseEvidence& e) {
  Diagnosis d;
  if (e.device_total > 0) d.held_outside = minus(e.device_total, e.device_free + e.reserved);
  for (const LeakFinding& leak : e.leaks) {
    const auto kept = static_cast<std::size_t>(std::max<std::int64_t>(leak.surviving_bytes, 0));
    d.leaked += kept;
    if (is_graph(leak)) d.graph_kept += kept;
  }

  const bool failed = e.requested > 0;
  const Capacity capacity = capacity_of(e);
  const std::size_t need = e.allocated + e.requested;
  const bool over = failed && capacity.bytes > 0 && need > capacity.bytes;
  const std::size_t shortfall = over ? need - capacity.bytes : 0;
  const std::string needs = "live allocations (" + bytes(e.allocated) + ") plus the request (" +
                            bytes(e.requested) + ") need " + bytes(need);
  const std::string where = capacity.device_binds
                                ? "the device can give gmem (" + bytes(e.reserved) + " held + " +
                                      bytes(e.device_free) + " free)"
                                : "gmem's memory limit (" + bytes(capacity.bytes) + ")";

  // 1. A leak, where it is large enough to have made the difference.
  const bool leak_matters = !e.leaks.empty() && (!failed || (d.leaked > 0 && (d.leaked >= shortfall || 4 * d.leaked >= e.allocated)));
  if (leak_matters) {
    // A graph kept alive when graphs hold most of the leaked bytes; its own findings come first.
    const bool graph = 2 * d.graph_kept >= d.leaked && d.graph_kept > 0;
    const LeakFinding& top = graph ? *std::find_if(e.leaks.begin(), e.leaks.end(), is_graph)
                                   : e.leaks.front();
    d.cause = graph ? Cause::graph_kept : Cause::leak;
    d.evidence = top.site + " keeps +" + bytes(top.bytes_per_step) + " a step (grew in " +
                 std::to_string(top.growing_periods) + " of " + std::to_string(top.periods) +
                 " steps)";
    if (graph)
      d.evidence = "tensors saved for a backward pass that never used them are kept across steps (" +
                   bytes(d.graph_kept) + " of the " + bytes(d.leaked) + " kept; " +
                   (top.backward_runs ? "backward passes run, but not for these"
                                      : "no backward pass has run") + "): " + d.evidence;
    if (e.leaks.size() > 1)
      d.evidence += ", " + std::to_string(e.leaks.size() - 1) + " more site" + (e.leaks.size() > 2 ? "s" : "") + " too";
    d.evidence += "; " + bytes(d.leaked) + (failed ? " kept" + percent_of(d.leaked, e.allocated)
                                                   : " kept by the last step");
    if (over) d.evidence += ", more than the " + bytes(shortfall) + " the request was short";
    else if (failed) d.evidence += "; " + needs + ", which fits under " + where;
    d.advice.push_back(graph ? graph_fix(top) : leak_fix(top));
    // The other sites in one line: their fix is the same sentence.
    std::string others;
    std::size_t listed = 0;
    for (const LeakFinding& leak : e.leaks) {
      if (&leak == &top || listed == 3) continue;
      others += std::string(listed++ ? ", " : "") + leak.site + " (+" + bytes(leak.bytes_per_step) +
                " a step" + (is_graph(leak) ? ", with its graph)" : ")");
    }
    if (listed < e.leaks.size() - 1)
      others += " and " + std::to_string(e.leaks.size() - 1 - listed) + " more";
    if (listed > 0) d.advice.push_back("Also kept across steps: " + others + ".");
    d.advice.push_back(graph ? "To keep outputs on purpose, keep out.detach() (or out.cpu()): the "
                               "values stay, their graph goes."
                             : "If the kept tensors are meant to stay (a cache, an EMA of weights), "
                               "bound the cache, or keep it on the CPU.");
    if (failed) d.advice.push_back(kSmallerBatch);
  } else if (over && capacity.device_binds && need <= e.device_total && d.held_outside >= shortfall &&
             d.held_outside > e.device_total / 20) {
    // 2. The device was short because others hold part of it. (The CUDA context alone holds a few
    // hundred MiB: it is blamed only where it is large enough to matter.)
    d.cause = Cause::held_outside;
    d.evidence = needs + ", which fits in the device's " + bytes(e.device_total) + ", but " +
                 bytes(d.held_outside) +
                 " of it is held outside gmem (CUDA context, NCCL, other processes)";
    add_outside_advice(d);
    d.advice.push_back(kSmallerBatch);
  } else if (over) {
    // 3. Live memory does not fit: this step's (the batch's) or earlier steps' (the model's).
    if (e.steps == 0) {
      d.cause = Cause::live_memory;
      d.evidence = needs + ", more than " + where +
                   "; no step markers, so a large batch cannot be told from a leak";
      d.advice.push_back(kSmallerBatch);
      d.advice.push_back(kMarkSteps);
    } else if (e.step_bytes >= shortfall) {
      d.cause = Cause::batch_too_large;
      d.evidence = needs + ", more than " + where + "; this step's allocations hold " +
                   bytes(e.step_bytes) + ", more than the " + bytes(shortfall) +
                   " short, and " +
                   (e.steps == 1 ? std::string("this is the first step: nothing can have leaked yet")
                                 : "no leak grows across the " + std::to_string(e.steps) + " steps");
      d.advice.push_back(kSmallerBatchFit);
    } else {
      d.cause = Cause::model_too_large;
      d.evidence = needs + ", more than " + where + "; memory kept from earlier steps holds " +
                   bytes(minus(e.allocated, e.step_bytes)) + ", and this step's " +
                   bytes(e.step_bytes) + " is less than the " + bytes(shortfall) + " short";
      d.advice.push_back("The model and its state do not fit: use mixed precision (bf16 weights), "
                         "shard the optimizer state (ZeRO, FSDP), or offload it to the CPU.");
      d.advice.push_back(kSmallerBatch);
    }
    d.advice.push_back(kNoGrad);
    d.advice.push_back(kCheckpointing);
    d.advice.push_back(kDropReferences);
    if (!capacity.device_binds && e.device_total > 0 && e.limit < e.device_total)
      d.advice.push_back("gmem's limit (" + bytes(e.limit) + ") is below the device's memory (" +
                         bytes(e.device_total) +
                         "): raise it with set_memory_limit() if this process may use more.");
  } else if (failed) {
    // 4. It fitted, and no leak: the free memory was not in one piece.
    d.cause = Cause::fragmentation;
    d.evidence = "there was room under the limit (" + needs + " of " + bytes(capacity.bytes) +
                 "), but the " + bytes(minus(e.reserved, e.allocated)) +
                 " free inside gmem is split across partly used pages and slabs (largest free "
                 "range " + bytes(e.largest_free_range) + "), and the leak test found nothing";
    if (e.steps == 0) d.evidence += " (no step markers: it could not run)";
    add_fragmentation_advice(d);
    d.advice.push_back(kSmallerBatch);
    if (e.steps == 0) d.advice.push_back(kMarkSteps);
  } else if (e.reserved > 0 && 10 * e.stranded >= e.reserved) {
    // No failure (a summary): free memory stranded next to live blocks.
    d.cause = Cause::fragmentation;
    d.evidence = bytes(e.stranded) + " of the " + bytes(e.reserved) +
                 " reserved is free but in pages and slabs shared with live blocks";
    add_fragmentation_advice(d);
  } else {
    d.evidence = e.steps > 0 ? "no site keeps more memory alive step after step" : "no leak found";
    if (e.reserved > 0)
      d.evidence += ", and " + bytes(e.stranded) + " of the " + bytes(e.reserved) +
                    " reserved is stranded in shared pages and slabs";
  }
  // A leak too small to be the cause still wants fixing: right after this cause's own fix.
  if (d.cause != Cause::leak && d.cause != Cause::graph_kept && !e.leaks.empty())
    d.advice.insert(d.advice.begin() + (d.advice.empty() ? 0 : 1),
                    is_graph(e.leaks.front()) ? graph_fix(e.leaks.front()) : leak_fix(e.leaks.front()));
  d.name = cause_name(d.cause);
  return d;
}

}  // namespace gmem
