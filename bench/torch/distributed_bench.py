"""Data-parallel training on several GPUs under each allocator: one torchrun job per model and
allocator, a rank per GPU, NCCL between them.

    python3 bench/torch/distributed_bench.py [--gpus 2] [--out FILE]    # every model x allocator
    python3 bench/torch/distributed_bench.py --oom-check                 # a rank runs out

Models (bench/torch/models/distributed.py, the held-out programs ddp_train and fsdp_train,
here on every rank): gpt2_ddp, GPT-2 124M under DistributedDataParallel (25 MB gradient buckets
as views, bf16 autocast, AdamW, 8 x 512 tokens a rank); llama_fsdp, the 12-layer Llama-style
model under FSDP2 (fully_shard per layer, bf16 parameters gathered per layer, fp32 gradients
reduce-scattered, AdamW, 4 sequences a rank of a length drawn per step from 512..2048). Each rank
draws its own batches (the model's seed, then 1000 + rank); every allocator sees the same ones.
Allocators: native (PyTorch's caching allocator), expandable (PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True), gmem (`gmem.torch.enable()` at the top of each rank), and native
again (`native2`), whose losses against native's show how far two runs of one allocator differ
(cuDNN, NCCL and attention kernels are not bitwise deterministic).

One JSON line per rank: the losses of every step, the timed steps' median and total, peak
allocated and peak reserved, and what the GPU holds outside the allocator (the device's total
less its free memory less the allocator's reserved: NCCL's buffers and the CUDA context). Under
gmem, rank 0 also keeps gmem.torch.distributed_summary()'s table. A table comes last.

--oom-check runs gpt2_ddp through `torchrun -m gmem.run` with no gmem call in the program; at
its third step rank 1 asks for more than the GPU holds. It passes when rank 1's error says which
rank ran out and shows rank 0's row (published by gmem at rank 0's optimizer steps) and the job
ends (torchrun stops rank 0, which waits in a collective for rank 1) within its time limit.
"""

import argparse
import io
import os
import re
import statistics
import sys
import time

from common import emit, read_json_lines, torchrun

MODELS = ("gpt2_ddp", "llama_fsdp")
ALLOCATORS = ("native", "expandable", "gmem", "native2")
WARMUP = 3


def worker(args):
    """One rank: runs the model's steps and sends its row to rank 0, which emits every row."""
    local_rank = int(os.environ["LOCAL_RANK"])
    gmem_torch = None
    if args.allocator == "gmem":
        from gmem import torch as gmem_torch
        gmem_torch.enable()
    import torch
    import torch.distributed as dist

    import models

    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    # Deterministic kernels where PyTorch has them (warn_only: the others run as they are), so
    # that the losses of two runs differ by what no allocator can change.
    torch.use_deterministic_algorithms(True, warn_only=True)
    factory = {"gpt2_ddp": models.ddp_train_step, "llama_fsdp": models.fsdp_train_step}[args.model]
    total_steps = WARMUP + args.steps
    step = factory(torch, total_steps)
    torch.manual_seed(1000 + rank)  # the model is the same on every rank, the batches are not

    losses, times = [], []
    for i in range(total_steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step(i))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        if i == args.oom_at and rank == args.oom_rank:
            total = torch.cuda.mem_get_info()[1]
            torch.empty(total + (1 << 30), dtype=torch.uint8, device="cuda")

    free, total = torch.cuda.mem_get_info()
    timed = times[WARMUP:]
    row = dict(model=args.model, allocator=args.allocator, rank=rank, world=world,
               device=torch.cuda.get_device_name(), torch=torch.__version__,
               losses=losses, step_ms=times, median_ms=statistics.median(timed),
               timed_ms=sum(timed), peak_allocated=torch.cuda.max_memory_allocated(),
               peak_reserved=torch.cuda.max_memory_reserved(),
               outside=total - free - torch.cuda.memory_reserved(), device_total=total,
               shapes=step.shapes)
    if gmem_torch is not None:
        text = io.StringIO()
        gmem_torch.distributed_summary(file=text)
        row["summary"] = text.getvalue()
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        for r in rows:
            emit(r, args.out)
    dist.destroy_process_group()


def rank_rows(records, model, allocator):
    """The last row of each rank for the model under the allocator (a file may hold earlier
    runs: JSON lines are appended)."""
    last = {}
    for r in records:
        if r.get("model") == model and r.get("allocator") == allocator and "rank" in r:
            last[r["rank"]] = r
    return [last[rank] for rank in sorted(last)]


def gib(n):
    return n / 2**30


def table(records, models=MODELS):
    """Per model: a line per allocator and rank, and how far each allocator's losses are from
    native's (the largest difference over every step and rank), and the OOM check's outcome."""
    lines = []
    for model in models:
        native = {r["rank"]: r["losses"] for r in rank_rows(records, model, "native")}
        lines.append("%s: median step ms, peak reserved / allocated GiB (ratio), outside GiB, "
                     "max |loss - native's|" % model)
        for allocator in ALLOCATORS:
            for r in rank_rows(records, model, allocator):
                ref = native.get(r["rank"])
                diff = ("%.2g" % max(abs(a - b) for a, b in zip(r["losses"], ref))
                        if ref and allocator != "native" else "-")
                lines.append("  %-10s rank %d  %8.1f ms  %6.2f / %6.2f (%.3f)  outside %5.2f  %s" % (
                    allocator, r["rank"], r["median_ms"], gib(r["peak_reserved"]),
                    gib(r["peak_allocated"]), r["peak_reserved"] / max(1, r["peak_allocated"]),
                    gib(r["outside"]), diff))
    for r in records:
        if r.get("check") == "oom":
            lines.append("oom check (torchrun -m gmem.run, rank 1 out of memory): %s: exit %s in "
                         "%.0f s, names the rank %s, shows rank 0's row %s" % (
                             "ok" if r["ok"] else "FAILED", r["exit_code"], r["seconds"],
                             r["names_the_rank"], r["shows_peer_row"]))
    return "\n".join(lines)


def oom_check(gpus, out_file, timeout):
    """A rank runs out of memory under `torchrun -m gmem.run`: its report names it and shows the
    other ranks' rows, and the job ends. Returns whether it did."""
    code, output, took = torchrun(__file__, gpus, ["--model", "gpt2_ddp", "--allocator", "gmem-run",
                                                   "--steps", "3", "--oom-at", "2", "--oom-rank", "1"],
                                  module="gmem.run", timeout=timeout)
    said = re.search(r"rank 1 of %d ran out of memory" % gpus, output) is not None
    # The table's row of rank 0 (what it published at its last optimizer step).
    peer_row = re.search(r"^(\[[^\]]*\]:)?0 +\S+ +\d[\d.]* [KMGT]?i?B ", output, re.M) is not None
    ok = code not in (0, None) and said and peer_row
    record = dict(check="oom", gpus=gpus, exit_code=code, seconds=round(took, 1),
                  names_the_rank=said, shows_peer_row=peer_row, ok=ok,
                  report=[line for line in output.splitlines() if "gmem" in line or
                          re.match(r"^(\[[^\]]*\]:)?\d+\s+\S+:\d", line)][:20])
    emit(record, out_file)
    if not ok:
        print(output[-6000:])
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=None, help="ranks (default: every GPU)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--allocators", default=",".join(ALLOCATORS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps after %d warm-up" % WARMUP)
    parser.add_argument("--out", default=None, help="JSON lines appended here")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per torchrun job")
    parser.add_argument("--oom-check", action="store_true")
    # The worker's own options (torchrun starts this script with --worker).
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="gpt2_ddp", help=argparse.SUPPRESS)
    parser.add_argument("--allocator", default="native", help=argparse.SUPPRESS)
    parser.add_argument("--oom-at", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--oom-rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    gpus = args.gpus
    if gpus is None:
        import torch
        gpus = torch.cuda.device_count()
    if gpus < 2:
        print("distributed_bench: needs 2 GPUs or more, this machine has %d" % gpus)
        return 2
    out_file = args.out or os.path.join("/tmp", "distributed_bench.jsonl")
    if args.oom_check:
        return 0 if oom_check(gpus, out_file, args.timeout) else 1

    failed = 0
    models = args.models.split(",")
    for model in models:
        for allocator in args.allocators.split(","):
            env = {"expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}.get(
                allocator, {})
            code, output, took = torchrun(__file__, gpus, ["--model", model, "--allocator", allocator,
                                                           "--steps", str(args.steps), "--out", out_file],
                                          env=env, timeout=args.timeout)
            rows = rank_rows(read_json_lines(out_file), model, allocator)
            bad = [r["rank"] for r in rows if any(l != l or abs(l) == float("inf")
                                                  for l in r["losses"])]
            ok = code == 0 and len(rows) == gpus and not bad
            print("== %s under %s on %d GPUs: %s in %.0f s" % (model, allocator, gpus,
                                                               "ok" if ok else "FAILED", took))
            if not ok:
                failed += 1
                print(output[-6000:])
            elif allocator == "gmem":
                print(rows[0].get("summary", ""))
    print(table(read_json_lines(out_file), models))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
