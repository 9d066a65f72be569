"""Captures real PyTorch allocation traces in the format of tests/data (gzip CSV, header
`action,addr,size,stream,time_us,user_frame,lib_frame`; /work/shared/traces/README.md and
bench/torch/README.md describe it), and prints the native allocator's peak allocated and reserved.

    python3 bench/torch/capture_traces.py [--programs NAME...] [--out-dir DIR] [--expandable]
    python3 bench/torch/capture_traces.py trim FULL.trace.csv.gz OUT.trace.csv.gz --before-us T
    python3 bench/torch/capture_traces.py stats TRACE...

Each program runs in its own process under PyTorch's native allocator with default settings
(PYTORCH_CUDA_ALLOC_CONF unset), after torch.cuda.memory._record_memory_history(stacks="python",
max_entries=N); at the end it frees everything, takes torch.cuda.memory._snapshot() and writes
its 'device_traces' one event a line to DIR/NAME.trace.csv.gz. `--expandable` runs each program
again, untraced, with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. One JSON line per run
(peak_allocated, peak_reserved, per step: its shape, ms, the peaks so far and `end_us`, a wall
clock time in a 20 ms pause after the step, where no event happens). `trim` keeps a trace's
events before such a time (whole steps) and `stats` recomputes a trace's peaks; neither needs torch.

Programs (models/): llama_ckpt_varlen, fasterrcnn_varsize, gpt2_generate, gpt2_train_eval and
resnet50_train_eval (four rounds of three training steps and an evaluation), llama_rounds
(train_bench's Llama schedule for 60 timed steps: 24 lengths taking turns; not run unless named).
"""

import argparse
import csv
import gc
import gzip
import io
import json
import os
import subprocess
import sys
import sysconfig
import time

from common import HERE, emit

# name: (factory in models/, steps[, the stacks recorded: "all" (alloc and free, the default)
# or "alloc"])
PROGRAMS = {
    "llama_ckpt_varlen": ("llama_step", 12),
    "fasterrcnn_varsize": ("fasterrcnn_step", 14),
    "gpt2_generate": ("gpt2_generate_step", 2),
    "llama_rounds": ("llama_rounds_step", 84),
    "gpt2_train_eval": ("gpt2_train_eval_step", 16),
    "resnet50_train_eval": ("resnet50_train_eval_step", 16),
    # held-out (models/__init__.py): checks, not tuned on
    "vit": ("vit_step", 12),
    "bert_varlen": ("bert_varlen_step", 24),
    "t5_varlen": ("t5_varlen_step", 24),
    "gpt2_accum": ("gpt2_accum_step", 8),
    "bert_serve": ("bert_serve_step", 12),
    # held-out, second batch
    "llama_generate": ("llama_generate_step", 6),
    "unet": ("unet_step", 12),
    "convnext_multiscale": ("convnext_multiscale_step", 16),
    "moe": ("moe_step", 10),
    "gpt2_compiled": ("gpt2_compiled_step", 10),
    # held-out, third batch: serving models of GiBs
    "llama_serve_1b": ("llama_serve_1b_step", 8),
    "bert_large_serve": ("bert_large_serve_step", 12),
    # held-out, fourth batch: fine-tuning, dynamic shapes compiled, diffusion sampling
    # PyTorch 2.11 fails in backward ("run_backward returned NULL without setting an exception")
    # when it records free stacks under HF's gradient checkpointing; the alloc stacks suffice
    "lora_llama": ("lora_llama_step", 30, "alloc"),
    "gpt2_dynamic": ("gpt2_dynamic_step", 24),
    "diffusion_sample": ("diffusion_sample_step", 16),
    # held-out, fifth batch: shapes new every step, two optimizers, LSTM, CUDA graphs
    "gnn_random": ("gnn_random_step", 16),
    "dlrm_sparse": ("dlrm_sparse_step", 16),
    "lstm_varlen": ("lstm_varlen_step", 16),
    "gpt2_cudagraphs": ("gpt2_cudagraphs_step", 12),
    # held-out, sixth batch: graphs captured by hand, a prefetching side stream, a GAN, offload
    "graph_serve": ("graph_serve_step", 12),
    "prefetch_train": ("prefetch_train_step", 16),
    "gan": ("gan_step", 16),
    "offload_train": ("offload_train_step", 10),
    # held-out, seventh batch: empty_cache() every step, beam search, AMP's GradScaler, distillation
    "empty_cache_varlen": ("empty_cache_varlen_step", 16),
    "beam_generate": ("beam_generate_step", 8),
    "amp_scaler": ("amp_scaler_step", 16),
    "distill": ("distill_step", 16),
    # held-out, eighth batch: DDP and FSDP2 on one rank, threads on streams, compiled serving
    "ddp_train": ("ddp_train_step", 16),
    "fsdp_train": ("fsdp_train_step", 16),
    "threads_serve": ("threads_serve_step", 12),
    "compile_serve": ("compile_serve_step", 12),
    # held-out, ninth batch: rollouts and training taking turns, EMA with foreach ops, generation
    # on a static cache under CUDA graphs, Lightning Fabric
    "rollout_train": ("rollout_train_step", 12),
    "ema_train": ("ema_train_step", 16),
    "static_generate": ("static_generate_step", 10),
    "fabric_train": ("fabric_train_step", 16),
    # held-out, tenth batch: speculative decoding, CUDA graphs over bucketed lengths
    "spec_generate": ("spec_generate_step", 4),  # 10 steps overran the 2,000,000-event history
    "cudagraphs_varlen": ("cudagraphs_varlen_step", 16),
    # held-out, eleventh batch: weights streamed in a layer at a time, continuous batching with
    # caches grown by torch.cat, an evaluation gathering its outputs, two towers contrastively
    "weights_stream_serve": ("weights_stream_serve_step", 8),
    "continuous_batching": ("continuous_batching_step", 8),
    "eval_collect": ("eval_collect_step", 16),
    "clip_train": ("clip_train_step", 12),
    # issue #56 item 5: BERT-base masked LM at one shape, long enough to see gmem's layout settle
    # (fsdp2_varlen, the other program of that item, runs on several ranks: fsdp2_bench.py --capture)
    "bert_mlm": ("bert_mlm_step", 80),
}
HEADER = ["action", "addr", "size", "stream", "time_us", "user_frame", "lib_frame"]
PAUSE_S = 0.010  # on each side of a step boundary's time mark
GiB = float(1 << 30)


# --- writing a snapshot's device_traces as CSV -----------------------------------------------


class FrameNamer:
    """user_frame: the innermost frame of the program's own Python files (not torch, not an
    installed package, not the standard library), as `file.py:line:function`; lib_frame: the
    innermost frame inside transformers/ or torchvision/, as `transformers/path.py:line:function`."""

    def __init__(self, torch_dir):
        paths = sysconfig.get_paths()
        self.excluded = tuple(sorted({p for p in (paths.get("stdlib"), paths.get("platstdlib"),
                                                  torch_dir) if p}))
        self.kinds = {}  # filename -> (is user, library path or None)
        self.named = {}  # id(frames list) -> (user, lib); the lists live as long as the snapshot

    def kind(self, filename):
        known = self.kinds.get(filename)
        if known is None:
            user = (filename.endswith(".py") and "site-packages/" not in filename and
                    "dist-packages/" not in filename and not filename.startswith(self.excluded))
            lib = None
            for name in ("transformers/", "torchvision/"):
                if filename.startswith(name):
                    lib = filename
                elif "/" + name in filename:
                    lib = filename[filename.find("/" + name) + 1:]
                if lib:
                    break
            known = self.kinds[filename] = (user, lib)
        return known

    def frames(self, frames):
        if not frames:
            return "", ""
        known = self.named.get(id(frames))
        if known is not None:
            return known
        user = lib = ""
        for frame in frames:  # innermost first
            is_user, lib_path = self.kind(frame["filename"])
            if is_user and not user:
                user = "%s:%d:%s" % (os.path.basename(frame["filename"]), frame["line"], frame["name"])
            if lib_path and not lib:
                lib = "%s:%d:%s" % (lib_path, frame["line"], frame["name"])
            if user and lib:
                break
        known = self.named[id(frames)] = (user, lib)
        return known


def open_gzip_text(path, mode):
    if "w" in mode:
        raw = open(path, "wb")
        return io.TextIOWrapper(gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=9,
                                              mtime=0), encoding="utf-8", newline="")
    return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")


def write_trace(snapshot, path, torch_dir):
    """Writes the snapshot's device_traces; returns {action: count}."""
    devices = [d for d in snapshot["device_traces"] if d]
    events = [e for d in devices for e in d]
    if len(devices) > 1:
        events.sort(key=lambda e: e["time_us"])
    namer = FrameNamer(torch_dir)
    counts = {}
    renamed = {"segment_map": "segment_alloc", "segment_unmap": "segment_free"}  # expandable only
    with open_gzip_text(path, "w") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(HEADER)
        for e in events:
            action = e["action"]
            if action == "snapshot":
                continue
            action = renamed.get(action, action)
            counts[action] = counts.get(action, 0) + 1
            user, lib = namer.frames(e.get("frames"))
            out.writerow([action, int(e["addr"]), int(e["size"]), int(e["stream"]),
                          int(e["time_us"]), user, lib])
    return counts


# --- one program in this process ---------------------------------------------------------------


def run_program(name, trace_path, max_entries, steps=None):
    import torch

    sys.path.insert(0, HERE)
    import models

    factory, default_steps, context = (PROGRAMS[name] + ("all",))[:3]
    steps = steps or default_steps
    if trace_path:
        torch.cuda.memory._record_memory_history(context=context, stacks="python",
                                                 max_entries=max_entries)
    start = time.time()
    step = getattr(models, factory)(torch, steps)
    shapes = list(step.shapes)
    torch.cuda.synchronize()
    setup_s = time.time() - start
    per_step = []
    for i in range(steps):
        t0 = time.perf_counter()
        value = step(i)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        time.sleep(PAUSE_S)
        mark = time.time_ns() // 1000
        time.sleep(PAUSE_S)
        per_step.append(dict(step=i, shape=shapes[i], ms=round(ms, 1), value=round(value, 4),
                             end_us=mark, max_allocated=torch.cuda.max_memory_allocated(),
                             max_reserved=torch.cuda.max_memory_reserved()))
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    record = dict(kind="capture", program=name, allocator="expandable" if "expandable" in conf else "native",
                  alloc_conf=conf, steps=steps, setup_s=round(setup_s, 1),
                  peak_allocated=torch.cuda.max_memory_allocated(),
                  peak_reserved=torch.cuda.max_memory_reserved(),
                  num_alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries"),
                  per_step=per_step, torch=torch.__version__,
                  device=torch.cuda.get_device_name(0))
    if name.startswith("llama"):
        record["parameters"] = models.llama_parameters()
    record["reserved_ratio"] = round(record["peak_reserved"] / record["peak_allocated"], 4)
    del step
    gc.collect()
    torch.cuda.synchronize()
    record["run_s"] = round(time.time() - start, 1)
    if trace_path:
        t0 = time.time()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        entries = sum(len(d) for d in snapshot["device_traces"])
        counts = write_trace(snapshot, trace_path, os.path.dirname(torch.__file__))
        record.update(trace=os.path.basename(trace_path), trace_bytes=os.path.getsize(trace_path),
                      events=sum(counts.values()), actions=counts, max_entries=max_entries,
                      truncated=entries >= max_entries, write_s=round(time.time() - t0, 1))
    return record


# --- the driver: one process per program and allocator -----------------------------------------


def run_child(name, expandable, args):
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name,
           "--max-entries", str(args.max_entries)]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    else:
        cmd += ["--trace", os.path.join(args.out_dir, "%s.trace.csv.gz" % name)]
    allocator = "expandable" if expandable else "native"
    try:
        result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                universal_newlines=True, timeout=args.timeout)
        lines = [l for l in result.stdout.splitlines() if l.startswith("{")]
        if result.returncode == 0 and lines:
            return json.loads(lines[-1])
        print(result.stderr[-4000:], file=sys.stderr, flush=True)
        last = [l for l in result.stderr.splitlines() if l.strip()][-1:] or ["no output"]
        error = "exit %d: %s" % (result.returncode, last[0].strip())
    except subprocess.TimeoutExpired:
        error = "timed out after %d s" % args.timeout
    return dict(kind="capture", program=name, allocator=allocator, error=error[-300:])


def summary(records):
    lines = ["", "program              allocator   peak alloc GiB  peak resv GiB  resv/alloc  "
                 "events  trace KiB  run s"]
    for r in records:
        if "error" in r:
            lines.append("%-20s %-11s FAILED: %s" % (r["program"], r["allocator"], r["error"][-70:]))
            continue
        lines.append("%-20s %-11s %14.3f %14.3f %11.3f %7s %10s %6.1f" % (
            r["program"], r["allocator"], r["peak_allocated"] / GiB, r["peak_reserved"] / GiB,
            r["reserved_ratio"], r.get("events", "-"),
            "%.0f" % (r["trace_bytes"] / 1024.0) if "trace_bytes" in r else "-", r["run_s"]))
    return "\n".join(lines)


# --- trim and stats: plain Python, no torch ----------------------------------------------------


def read_rows(path):
    with open_gzip_text(path, "r") as f:
        rows = csv.reader(f)
        header = next(rows)
        if header != HEADER:
            raise SystemExit("%s: header %r, expected %r" % (path, header, HEADER))
        for row in rows:
            yield row


def trace_stats(path):
    """Peaks recomputed from the events: allocated (alloc to free_completed) and reserved
    (segment_alloc to segment_free), as max_memory_allocated/reserved count them."""
    live, allocated, reserved = {}, 0, 0
    stats = dict(trace=os.path.basename(path), events=0, peak_allocated=0, peak_reserved=0,
                 bytes=os.path.getsize(path), first_us=None, last_us=None)
    for action, addr, size, _stream, time_us, _user, _lib in read_rows(path):
        stats["events"] += 1
        stats["first_us"] = stats["first_us"] or int(time_us)
        stats["last_us"] = int(time_us)
        if action == "alloc":
            live[addr] = int(size)
            allocated += int(size)
            stats["peak_allocated"] = max(stats["peak_allocated"], allocated)
        elif action == "free_completed":
            allocated -= live.pop(addr, 0)
        elif action == "segment_alloc":
            reserved += int(size)
            stats["peak_reserved"] = max(stats["peak_reserved"], reserved)
        elif action == "segment_free":
            reserved -= int(size)
    stats["live_at_end"] = allocated
    stats["reserved_ratio"] = round(stats["peak_reserved"] / max(stats["peak_allocated"], 1), 4)
    return stats


def trim(full, out, before_us, quiet_us):
    """Copies the events of `full` before `before_us`; counts those within quiet_us of it (there
    should be none: the mark lies in a pause between steps)."""
    kept = near = 0
    with open_gzip_text(out, "w") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(HEADER)
        for row in read_rows(full):
            t = int(row[4])
            near += abs(t - before_us) < quiet_us
            if t < before_us:
                writer.writerow(row)
                kept += 1
    return dict(kept=kept, events_near_mark=near)


def main():
    if len(sys.argv) > 1 and sys.argv[1] in ("trim", "stats"):
        parser = argparse.ArgumentParser(prog="capture_traces.py " + sys.argv[1])
        if sys.argv[1] == "trim":
            parser.add_argument("full")
            parser.add_argument("out")
            parser.add_argument("--before-us", type=int, required=True)
            args = parser.parse_args(sys.argv[2:])
            result = trim(args.full, args.out, args.before_us, int(PAUSE_S * 1e6 * 0.8))
            result.update(trace_stats(args.out))
            emit(result)
        else:
            parser.add_argument("traces", nargs="+")
            for path in parser.parse_args(sys.argv[2:]).traces:
                emit(trace_stats(path))
        return

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", nargs="+", choices=sorted(PROGRAMS),
                        default=[p for p in PROGRAMS if p != "llama_rounds"])
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--expandable", action="store_true",
                        help="also run each program with expandable_segments:True (no trace)")
    parser.add_argument("--max-entries", type=int, default=2000000)
    parser.add_argument("--timeout", type=int, default=150, help="seconds per run")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("--steps", type=int,
                        help="steps to run (default: each program's own; a longer trace)")
    parser.add_argument("--child", choices=sorted(PROGRAMS), help=argparse.SUPPRESS)
    parser.add_argument("--trace", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        emit(run_program(args.child, args.trace, args.max_entries, args.steps))
        return
    os.makedirs(args.out_dir, exist_ok=True)
    records = []
    for name in args.programs:
        for expandable in ((False, True) if args.expandable else (False,)):
            records.append(run_child(name, expandable, args))
            emit(records[-1], args.out)
    print(summary(records), flush=True)
    sys.exit(1 if any("error" in r for r in records) else 0)


if __name__ == "__main__":
    main()
