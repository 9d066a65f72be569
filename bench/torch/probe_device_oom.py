"""Fills the GPU to its own limit (no cap): how much a program gets under each allocator, what it
is told when the device is full, and whether it recovers. One JSON line per allocator, each run
in its own process (an allocator is chosen before CUDA starts).

    python3 bench/torch/probe_device_oom.py [--allocators native,expandable,gmem] [--out FILE]

A small matmul loop runs once first, so that its kernels and cuBLAS's workspace are loaded.
Stages, each until the first out-of-memory error: 1 GiB tensors, then 32 MiB, then 2 MiB, then
(at most 4,096 of them) 512 KiB. Then every tensor is freed, and a program that caught the error
(a batch-size search, say) goes on: the loop again; a kernel not run before (loading it takes
device memory from the driver, outside any allocator); the same after torch.cuda.empty_cache();
one tensor of 90% of what it held, written and read back. Exits 1 when an allocator's fill ends
in anything but torch.OutOfMemoryError, or the loop or the 90% tensor fails after it; the new
kernels are reported, not judged (on the H100 they fail under every allocator: docs/notes/2026-11-25-the-device-filled-to-its-own-limit-vmm-calls-on-several-threads-and.md).
"""

import argparse
import json
import os
import subprocess
import sys
import time

from common import HERE, PYTHON_DIR, emit

MiB = 1 << 20
GiB = 1 << 30
STAGES = ((GiB, None), (32 * MiB, None), (2 * MiB, None), (512 * 1024, 4096))


def fill(torch):
    held, stages = [], []
    error_type = error_head = None
    started = time.perf_counter()
    for size, most in STAGES:
        count = 0
        while most is None or count < most:
            try:
                held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
                count += 1
            except torch.cuda.OutOfMemoryError as e:
                error_type = "torch.OutOfMemoryError"
                error_head = str(e).splitlines()[0][:300]
                break
            except RuntimeError as e:  # anything else is a failure to report, not to hide
                error_type = "RuntimeError"
                error_head = str(e).splitlines()[0][:300]
                break
        stages.append({"block": size, "count": count})
        if error_type == "RuntimeError":
            break
    torch.cuda.synchronize()
    return held, stages, error_type, error_head, time.perf_counter() - started


def try_(what):
    try:
        return bool(what())
    except RuntimeError as e:
        return "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:200])


def matmul_loop(torch):
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        x = torch.tanh(x @ x / 64)
    return torch.isfinite(x).all().item()


def run_one(allocator):
    if allocator == "gmem":
        import gmem.torch

        gmem.torch.enable()
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    matmul_loop(torch)
    held, stages, error_type, error_head, fill_s = fill(torch)
    got = sum(t.numel() for t in held)
    reserved_full = torch.cuda.memory_reserved()
    del held
    started = time.perf_counter()
    loop_again = try_(lambda: matmul_loop(torch))
    new_kernel = try_(lambda: torch.special.bessel_j0(torch.ones(1024, device="cuda")).sum().item() > 0)
    torch.cuda.empty_cache()
    reserved_emptied = torch.cuda.memory_reserved()
    new_kernel_emptied = try_(lambda: torch.special.bessel_j1(torch.ones(1024, device="cuda")).sum().item() > 0)

    def ninety():
        big = torch.empty(int(got * 0.9) // MiB * MiB, dtype=torch.uint8, device="cuda")
        big.fill_(7)
        return big[::4096].eq(7).all().item()

    ninety_again = try_(ninety)
    return {"allocator": allocator, "device_total_gib": total / GiB, "obtained_gib": got / GiB,
            "reserved_when_full_gib": reserved_full / GiB, "stages": stages,
            "error_type": error_type, "error": error_head, "fill_s": round(fill_s, 3),
            "loop_again": loop_again, "new_kernel": new_kernel,
            "reserved_after_empty_cache_gib": reserved_emptied / GiB,
            "new_kernel_after_empty_cache": new_kernel_emptied, "ninety_percent_again": ninety_again,
            "after_s": round(time.perf_counter() - started, 3)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--allocators", default="native,expandable,gmem")
    parser.add_argument("--allocator", help=argparse.SUPPRESS)  # one run, in this process
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.allocator:
        print(json.dumps(run_one(args.allocator)), flush=True)
        return
    failed = False
    for allocator in args.allocators.split(","):
        env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
        if allocator == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        proc = subprocess.run([sys.executable, os.path.join(HERE, "probe_device_oom.py"),
                               "--allocator", "gmem" if allocator == "gmem" else "native"],
                              env=env, capture_output=True, text=True, timeout=600)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        if proc.returncode != 0 or not lines:
            failed = True
            result = {"allocator": allocator, "error": "exit %d: %s" % (proc.returncode,
                                                                       proc.stderr[-2000:])}
        else:
            result = json.loads(lines[-1])
            result["allocator"] = allocator
            failed |= result["error_type"] != "torch.OutOfMemoryError" or not all(
                result[k] is True for k in ("loop_again", "ninety_percent_again"))
        emit(result, args.out)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
