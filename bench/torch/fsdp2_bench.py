"""FSDP2 over sequence lengths drawn per step (models.fsdp2_varlen_step, a 1.1B transformers Llama,
fully_shard per layer and on the root) on several GPUs under each allocator, one torchrun job a
run, a rank per GPU; and the allocation trace of its rank 0 under the native allocator.

    python3 bench/torch/fsdp2_bench.py [--gpus 2] [--runs native,expandable,gmem] [--out FILE]
    python3 bench/torch/fsdp2_bench.py --capture DIR      # DIR/fsdp2_varlen.trace.csv.gz, rank 0
    python3 bench/torch/fsdp2_bench.py --show FILE...

--runs is the order of the jobs, repeats allowed (native,expandable,gmem,gmem,expandable,native
alternates them: runs of one allocator differ by a few percent). Every job runs the same steps:
--warmup steps, then --steps timed ones, the lengths fsdp2_varlen_lengths draws (seed 0), the
tokens from seed 1000 + rank. gmem is `gmem.torch.enable()` at the top of each rank, with its
default step marks (GMEM_PLAN_STEPS passes through: `gmem-nomarks` in --runs sets it to 0);
expandable is PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.

One JSON line per rank and job: every step's ms (warm-up included), the timed steps' median and
total, peak allocated and reserved, MiB reserved after each step; under gmem, each step's device
maps, host time in the driver's memory calls (gmem.device_call_us) and waiting for streams
(gmem.stream_wait_us), and their totals; under PyTorch's allocator, each step's cudaMalloc calls
(num_device_alloc). --capture runs one job under the native allocator in which rank 0 records
its memory history (as capture_traces.py does: stacks="python", a 20 ms pause around a time mark
after each step on every rank, `end_us` in the row) and writes it in capture_traces.py's format.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

from common import emit, read_json_lines, torchrun

MODELS = ("fsdp2_varlen",)
GMEM_PER_STEP = {  # record key: gmem statistic, its increase over each step
    "step_maps": "gmem.num_maps",
    "step_call_us": "gmem.device_call_us",
    "step_wait_us": "gmem.stream_wait_us",
    "step_plans": "gmem.plans",
    "step_device_allocs": "num_device_alloc",
}
WORKER_ENV = "FSDP2_BENCH_WORKER"  # the settings of a rank, as JSON
PAUSE_S = 0.010  # --capture: on each side of a step's time mark, as capture_traces.py


def worker(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    uses_gmem = args.allocator.startswith("gmem")
    if uses_gmem:
        import gmem
        import gmem.torch

        gmem.torch.enable()
    import torch
    import torch.distributed as dist

    import models

    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    tracing = bool(args.trace_dir) and rank == 0
    if tracing:
        torch.cuda.memory._record_memory_history(context="all", stacks="python",
                                                 max_entries=args.max_entries)
    total_steps = args.warmup + args.steps
    began = time.time()
    step = getattr(models, args.model + "_step")(torch, total_steps)
    torch.manual_seed(1000 + rank)  # the model is the same on every rank, the batches are not
    torch.cuda.synchronize()
    setup_s = time.time() - began

    def stat(name):
        if uses_gmem:
            return gmem.memory_stat(name)
        return torch.cuda.memory_stats().get(name, 0)

    keys = GMEM_PER_STEP if uses_gmem else {"step_device_allocs": "num_device_alloc"}
    before = {key: stat(name) for key, name in keys.items()}
    per_step = {key: [] for key in keys}
    losses, times, reserved, marks = [], [], [], []
    for i in range(total_steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step(i))
        torch.cuda.synchronize()
        times.append(round((time.perf_counter() - t0) * 1e3, 2))
        reserved.append(round(torch.cuda.memory_reserved() / 2**20))
        for key, name in keys.items():  # outside the timing
            now = stat(name)
            per_step[key].append(now - before[key])
            before[key] = now
        if args.trace_dir:  # every rank pauses alike; rank 0 marks a time where no event happens
            time.sleep(PAUSE_S)
            marks.append(time.time_ns() // 1000)
            time.sleep(PAUSE_S)

    timed = times[args.warmup:]
    row = dict(kind="fsdp2", model=args.model, allocator=args.allocator, run=args.job_index, rank=rank,
               world=world, device=torch.cuda.get_device_name(), torch=torch.__version__,
               alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
               plan_steps_env=os.environ.get("GMEM_PLAN_STEPS", ""), warmup=args.warmup,
               steps=args.steps, shapes=step.shapes, losses=[round(l, 4) for l in losses],
               step_ms=times, median_ms=round(statistics.median(timed), 2),
               total_ms=round(sum(timed), 1), setup_s=round(setup_s, 1),
               peak_allocated=torch.cuda.max_memory_allocated(),
               peak_reserved=torch.cuda.max_memory_reserved(), step_reserved_mib=reserved)
    row["reserved_ratio"] = round(row["peak_reserved"] / max(1, row["peak_allocated"]), 4)
    row.update(per_step)
    if uses_gmem:
        stats = gmem.memory_stats()
        row.update(maps=stats.get("gmem.num_maps"), unmaps=stats.get("gmem.num_unmaps"),
                   device_call_us=stats.get("gmem.device_call_us"),
                   stream_wait_us=stats.get("gmem.stream_wait_us"),
                   steps_marked=stats.get("gmem.steps_marked"),
                   plan={k[len("gmem."):]: v for k, v in stats.items() if k.startswith("gmem.plan")},
                   maps_timed=sum(per_step["step_maps"][args.warmup:]),
                   call_us_timed=sum(per_step["step_call_us"][args.warmup:]),
                   gmem_mode=gmem.torch.mode())
    if args.trace_dir:
        row["end_us"] = marks
    free, device_total = torch.cuda.mem_get_info()
    row["outside"] = device_total - free - torch.cuda.memory_reserved()

    if tracing:
        import capture_traces

        del step
        gc.collect()
        torch.cuda.synchronize()
        t0 = time.time()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        entries = sum(len(d) for d in snapshot["device_traces"])
        path = os.path.join(args.trace_dir, "%s.trace.csv.gz" % args.model)
        counts = capture_traces.write_trace(snapshot, path, os.path.dirname(torch.__file__))
        row.update(trace=os.path.basename(path), trace_bytes=os.path.getsize(path),
                   events=sum(counts.values()), actions=counts, max_entries=args.max_entries,
                   truncated=entries >= args.max_entries, write_s=round(time.time() - t0, 1))
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        for r in rows:
            emit(r, args.out)
    dist.barrier()
    dist.destroy_process_group()


def last_map_step(maps):
    """The last step (counted from 0) that mapped, or None when none did."""
    mapped = [i for i, n in enumerate(maps) if n]
    return mapped[-1] if mapped else None


def show(records):
    lines = ["fsdp2: run allocator rank | median ms, total of the timed steps | peak reserved / "
             "allocated GiB (ratio) | gmem: maps (timed steps), last step that mapped, driver "
             "calls ms (timed) | native: cudaMallocs"]
    for r in records:
        if r.get("kind") != "fsdp2":
            continue
        if "error" in r:
            lines.append("  %-2s %-12s FAILED: %s" % (r.get("run", ""), r["allocator"], r["error"][-200:]))
            continue
        line = "  %-2s %-12s %d | %7.1f %8.0f ms | %6.2f / %6.2f (%.3f)" % (
            r["run"], r["allocator"], r["rank"], r["median_ms"], r["total_ms"],
            r["peak_reserved"] / 2**30, r["peak_allocated"] / 2**30, r["reserved_ratio"])
        if "maps" in r:
            line += " | maps %d (%d), last at step %s, calls %.0f ms (%.0f)" % (
                r["maps"], r["maps_timed"], last_map_step(r["step_maps"]),
                r["device_call_us"] / 1e3, r["call_us_timed"] / 1e3)
        elif "step_device_allocs" in r:
            line += " | cudaMallocs %d" % sum(r["step_device_allocs"])
        if "trace" in r:
            line += " | trace %s: %d events, %.1f MiB" % (r["trace"], r["events"], r["trace_bytes"] / 2**20)
        lines.append(line)
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=None, help="ranks (default: every GPU)")
    parser.add_argument("--model", default="fsdp2_varlen", choices=MODELS)
    parser.add_argument("--runs", default="native,expandable,gmem",
                        help="allocators in the order run, repeats allowed (gmem-nomarks: "
                             "gmem with GMEM_PLAN_STEPS=0)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up")
    parser.add_argument("--out", default=None, help="JSON lines appended here")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per torchrun job")
    parser.add_argument("--capture", metavar="DIR",
                        help="one native job, rank 0's allocation trace into DIR")
    parser.add_argument("--max-entries", type=int, default=2000000)
    parser.add_argument("--run-base", type=int, default=0,
                        help="the first job's number in the rows' `run` (appending to a file)")
    parser.add_argument("--show", nargs="+", metavar="FILE")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # a rank, started by torchrun; its settings in WORKER_ENV
        return worker(argparse.Namespace(**json.loads(os.environ[WORKER_ENV])))
    if args.show:
        print(show([r for path in args.show for r in read_json_lines(path)]))
        return 0

    gpus = args.gpus
    if gpus is None:
        import torch
        gpus = torch.cuda.device_count()
    out_file = os.path.abspath(args.out or os.path.join("/tmp", "fsdp2_bench.jsonl"))
    runs = ["native"] if args.capture else args.runs.split(",")
    failed = 0
    for index, allocator in enumerate(runs):
        env = dict(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if allocator == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        if allocator == "gmem-nomarks":
            env["GMEM_PLAN_STEPS"] = "0"
        run = "c" if args.capture else str(args.run_base + index)
        # The worker's settings travel in the environment: torchrun's own parser rejects an
        # option of the script's that abbreviates two of its own (`--run`: --run-path, --run_path)
        worker_args = dict(model=args.model, allocator=allocator, job_index=run,
                           warmup=args.warmup, steps=args.steps, out=out_file,
                           max_entries=args.max_entries, trace_dir=None)
        if args.capture:
            os.makedirs(args.capture, exist_ok=True)
            worker_args["trace_dir"] = os.path.abspath(args.capture)
        env[WORKER_ENV] = json.dumps(worker_args)
        code, output, took = torchrun(__file__, gpus, env=env, timeout=args.timeout)
        rows = [r for r in read_json_lines(out_file) if r.get("kind") == "fsdp2" and
                r.get("run") == run and r.get("allocator") == allocator]
        ok = code == 0 and len(rows) >= gpus
        print("== %s under %s (run %s) on %d GPUs: %s in %.0f s" % (
            args.model, allocator, run, gpus, "ok" if ok else "FAILED (exit %s)" % code, took),
            flush=True)
        if not ok:
            failed += 1
            print(output[-5000:], flush=True)
            emit(dict(kind="fsdp2", model=args.model, allocator=allocator, run=run,
                      error="exit %s: %s" % (code, output.strip().splitlines()[-1:] or "no output")),
                 out_file)
    print(show(read_json_lines(out_file)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
