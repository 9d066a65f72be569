"""Where a Llama step's time goes: train_bench's Llama schedule, timed steps 20-40 under
torch.profiler, printing wall time, the sum of GPU kernel times (equal wall and kernel time: the GPU
was busy; wall above kernel: it waited for the host) and the ops with the most host time of their
own. ALLOC=native runs PyTorch's allocator; otherwise gmem, GMEM_PLAN_STEPS=0|1 without or with
step marks (GMEM_LIBRARY names the library). Used for docs/engine.md ("Plans made in the
background"); results in bench/results/*-llama-profile.txt.
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    allocator = os.environ.get("ALLOC", "gmem")
    sys.path.insert(0, HERE)
    if allocator == "gmem":
        sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
        import gmem.torch

        gmem.torch.enable()
    import torch
    from torch.profiler import ProfilerActivity, profile

    import train_bench

    step = train_bench.llama_step(torch, 0, 60)
    first = step.warmup + 20
    torch.manual_seed(0)
    for i in range(first):
        step(i)
    torch.cuda.synchronize()
    walls = []
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for i in range(first, first + 20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(i)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
    kernel_us = sum(getattr(e, "device_time", 0) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    top = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()),
                 key=lambda r: -r[1])[:25]
    print(json.dumps({"alloc": allocator, "marks": os.environ.get("GMEM_PLAN_STEPS"),
                      "wall_ms": round(sum(walls) * 1e3, 1), "kernel_ms": round(kernel_us / 1e3, 1),
                      "top_cpu": [(k, round(t / 1e3, 1), c) for k, t, c in top]}))


if __name__ == "__main__":
    main()
