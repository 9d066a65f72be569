"""Where a held-out program's step time goes: models.<MODEL>_step, WARM steps run, then
STEPS steps under torch.profiler, printing wall time and the sum of GPU kernel times (wall above
kernel time: the GPU waited for the host), and the ops with the most host time of their own.
ALLOC=gmem (the default) runs gmem (GMEM_LIBRARY names the library); any other value, PyTorch's
own allocator.

    MODEL=llama_generate WARM=2 STEPS=2 ALLOC=gmem python3 bench/torch/profile_steps.py

Used for docs/notes/2026-11-24-generation-ran-slower-under-gmem-its-time-is-the-hosts-cudnn-attention.md ("Generation ran slower under gmem"). profile_llama_steps.py profiles
train_bench's Llama schedule with the two functions here.
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def enable_allocator(allocator=None):
    """`allocator` ("gmem" or "native"; by default ALLOC from the environment, else gmem);
    enables gmem.torch for gmem, before torch is imported. Returns the allocator's name."""
    allocator = allocator or os.environ.get("ALLOC", "gmem")
    sys.path.insert(0, HERE)
    if allocator == "gmem":
        sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
        import gmem.torch

        gmem.torch.enable()
    return allocator


def profile_steps(torch, step, first, count, top_n):
    """Runs step(first) .. step(first + count - 1) under torch.profiler, each between two syncs.
    Returns the wall time of each step in s, the GPU kernels' time in all in us, and the top_n
    ops by their own host time as (name, ms, calls)."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for i in range(first, first + count):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(i)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
    kernel_us = sum(getattr(e, "device_time", 0) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    top = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()),
                 key=lambda r: -r[1])[:top_n]
    return walls, kernel_us, [(k, round(t / 1e3, 1), c) for k, t, c in top]


def main():
    allocator = enable_allocator()
    name = os.environ.get("MODEL", "llama_generate")
    warm, steps = int(os.environ.get("WARM", "2")), int(os.environ.get("STEPS", "2"))
    import torch

    import models

    step = getattr(models, name + "_step")(torch, warm + steps)
    for i in range(warm):
        step(i)
    torch.cuda.synchronize()
    walls, kernel_us, top = profile_steps(torch, step, warm, steps, 12)
    print(json.dumps({"model": name, "alloc": allocator, "steps": [warm, warm + steps],
                      "wall_ms": [round(w * 1e3, 1) for w in walls],
                      "kernel_ms": round(kernel_us / 1e3, 1), "top_cpu": top}), flush=True)


if __name__ == "__main__":
    main()
