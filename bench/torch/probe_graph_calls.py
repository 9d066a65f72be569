"""What a CUDA-graph program asks of the allocator, step by step: models.<MODEL>_step run
for STEPS steps, counting the calls cudagraph trees and torch.cuda.graph make into the allocator
(graph captures, pool handles, checkpoint reads and restores, pool releases) and, under gmem, the
maps and creates of every step, with the step's wall time.

    python3 bench/torch/probe_graph_calls.py {native|gmem} [MODEL] [STEPS]   (default static_generate 10)

Used for docs/notes/2026-11-25-held-out-traces-a-ninth-batch-rollouts-ema-a-static-cache-under-cuda.md ("a ninth batch": static_generate)."""
import collections
import json
import sys
import time

from profile_steps import enable_allocator


def main():
    allocator = enable_allocator(sys.argv[1])
    name = sys.argv[2] if len(sys.argv) > 2 else "static_generate"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    import torch

    counts = collections.Counter()

    def counted(owner, attr, key):
        original = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        setattr(owner, attr, wrapper)

    for attr in ("_cuda_getCheckpointState", "_cuda_setCheckpointPoolState", "_cuda_releasePool",
                 "_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool"):
        if hasattr(torch._C, attr):
            counted(torch._C, attr, attr.replace("_cuda_", ""))
    counted(torch.cuda, "graph_pool_handle", "graph_pool_handle")
    counted(torch.cuda.CUDAGraph, "capture_begin", "capture_begin")
    counted(torch.cuda.CUDAGraph, "replay", "replay")
    counted(torch.cuda, "empty_cache", "empty_cache")

    import models

    step = getattr(models, name + "_step")(torch, steps)

    def gmem_counters():
        if allocator != "gmem":
            return {}
        s = torch.cuda.memory_stats()
        return {k: s.get(k, 0) for k in ("gmem.num_maps", "gmem.num_unmaps", "gmem.num_stitches",
                                           "num_device_alloc", "num_device_free",
                                           "reserved_bytes.all.current")}

    for i in range(steps):
        before, calls = gmem_counters(), dict(counts)
        t0 = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        after = gmem_counters()
        delta = {k: counts[k] - calls.get(k, 0) for k in counts if counts[k] != calls.get(k, 0)}
        print(json.dumps({"alloc": allocator, "step": i, "ms": round(wall, 1), "calls": delta,
                          "gmem": {k: after[k] - before[k] for k in after}}), flush=True)


if __name__ == "__main__":
    main()
