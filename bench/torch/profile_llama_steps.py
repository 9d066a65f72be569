"""Where a Llama step's time goes: train_bench's Llama schedule, timed steps 20-40 under
torch.profiler, printing wall time, the sum of GPU kernel times (equal wall and kernel time: the GPU
was busy; wall above kernel: it waited for the host) and the ops with the most host time of their
own. ALLOC=gmem (the default) runs gmem, GMEM_PLAN_STEPS=0|1 without or with step marks
(GMEM_LIBRARY names the library); any other value, PyTorch's own allocator. Used for docs/notes/2026-11-24-plans-made-in-the-background.md ("Plans made in the
background"); results in bench/results/*-llama-profile.txt.
"""
import json
import os

from profile_steps import enable_allocator, profile_steps


def main():
    allocator = enable_allocator()
    import torch

    import train_bench

    step = train_bench.llama_step(torch, 0, 60)
    first = step.warmup + 20
    torch.manual_seed(0)
    for i in range(first):
        step(i)
    torch.cuda.synchronize()
    walls, kernel_us, top = profile_steps(torch, step, first, 20, 25)
    print(json.dumps({"alloc": allocator, "marks": os.environ.get("GMEM_PLAN_STEPS"),
                      "wall_ms": round(sum(walls) * 1e3, 1), "kernel_ms": round(kernel_us / 1e3, 1),
                      "top_cpu": top}))


if __name__ == "__main__":
    main()
