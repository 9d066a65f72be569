"""What polling torch.cuda.memory_stats() costs a training loop, as Lightning's DeviceStatsMonitor
polls it after every step: models.fabric_train_step (which reads it after every step), timed with
the poll as it is and with it replaced by a no-op, in one process; then the poll's own host time,
called back to back and between a step's launches. ALLOC=gmem (the default) or native.

    ALLOC=gmem python3 bench/torch/poll_cost.py

Used for docs/notes/2026-11-25-held-out-traces-a-ninth-batch-rollouts-ema-a-static-cache-under-cuda.md ("a ninth batch": fabric_train); results in
bench/results/*-poll-cost.jsonl.
"""
import json
import os
import time

from profile_steps import enable_allocator


def main():
    allocator = enable_allocator()
    import torch

    import models

    warm, timed = 6, 10
    # Every step's length the same (512): the step's time compares across the two halves.
    step = models.fabric_train_step(torch, warm + 3 * timed, lengths=(512,))
    for i in range(warm):
        step(i)
    torch.cuda.synchronize()
    polled = torch.cuda.memory_stats

    def run(first):
        walls = []
        for i in range(first, first + timed):
            t0 = time.perf_counter()
            step(i)
            walls.append((time.perf_counter() - t0) * 1e3)
        return sorted(walls)[len(walls) // 2]

    with_poll = run(warm)
    torch.cuda.memory_stats = lambda device=None: {}
    without_poll = run(warm + timed)
    torch.cuda.memory_stats = polled
    with_poll_again = run(warm + 2 * timed)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        polled()
    idle_us = (time.perf_counter() - t0) * 1e4
    # While the GPU is busy: a matmul queue ahead of the poll.
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        x @ x
    t0 = time.perf_counter()
    polled()
    busy_us = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    print(json.dumps({"alloc": allocator, "median_step_ms_polling": round(with_poll, 2),
                      "median_step_ms_no_poll": round(without_poll, 2),
                      "median_step_ms_polling_again": round(with_poll_again, 2),
                      "poll_us_idle": round(idle_us, 1), "poll_us_gpu_busy": round(busy_us, 1),
                      "stats": len(polled())}), flush=True)


if __name__ == "__main__":
    main()
