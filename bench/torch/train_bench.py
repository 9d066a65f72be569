"""Training steps under each allocator, each run in its own process (an allocator is chosen
before CUDA starts): median step time after warm-up, peak allocated and peak reserved; optionally
under a memory cap of R x the peak allocated.

    python3 bench/torch/train_bench.py --all [--out FILE]              # every model x allocator
    python3 bench/torch/train_bench.py --all --cap-ratio 1.015 --cap-models gpt2
    python3 bench/torch/train_bench.py --model gpt2 --allocator gmem   # one run, in this process
    python3 bench/torch/train_bench.py --model gpt2 --cap-ratio 1.015  # native uncapped, then each
                                                                        # allocator under the cap

Models: GPT-2 124M (transformers, random init, batch 8 x 1024 tokens, AdamW, bf16 autocast) and
ResNet-50 (torchvision, batch 64 at 224x224, SGD, fp32): the programs of tests/data's traces; llama
(models/llama.py: a 374M-parameter Llama-style decoder, activation checkpointing per layer, batch
8 with a sequence length drawn per step from 512..2048, the same lengths for every allocator, bf16
autocast, AdamW), the program of llama_ckpt_varlen.trace.csv.gz; its warm-up runs each distinct
length of its timed steps once (see each_length_warmed). gpt2_train_eval and resnet50_train_eval
(models/; only when named): three training steps and an evaluation, taking turns.
Allocators: native (PyTorch's caching allocator), expandable (the same with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) and gmem (gmem.torch.enable()).

The cap (--cap-ratio R): R x the peak allocated of the model's uncapped native run (taken from
this invocation's --all runs, else measured first), through
torch.cuda.set_per_process_memory_fraction(cap / total) for native and expandable and
gmem.set_memory_limit(cap) for gmem. An out-of-memory error is a result, not a failure: the run's
line says "oom": true and the step it happened at (counted from 0, warm-up included; null when
building the model failed). A last step whose output (the loss, or what a serving step returns)
is NaN or infinite fails the run: its line says "error", and --all exits 1.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

from common import HERE, PYTHON_DIR, emit, read_json_lines

HELD_OUT = ("vit", "bert_varlen", "t5_varlen", "gpt2_accum", "bert_serve",  # models/
            "llama_generate", "unet", "convnext_multiscale", "moe", "gpt2_compiled",
            "llama_serve_1b", "bert_large_serve", "lora_llama", "gpt2_dynamic", "diffusion_sample",
            "gnn_random", "dlrm_sparse", "lstm_varlen", "gpt2_cudagraphs",
            "graph_serve", "prefetch_train", "gan", "offload_train",
            "empty_cache_varlen", "beam_generate", "amp_scaler", "distill",
            "ddp_train", "fsdp_train", "threads_serve", "compile_serve",
            "rollout_train", "ema_train", "static_generate", "fabric_train",
            "spec_generate", "cudagraphs_varlen",
            "weights_stream_serve", "continuous_batching", "eval_collect", "clip_train",
            "bert_mlm")
MODELS = ("gpt2", "resnet50", "llama", "gpt2_train_eval", "resnet50_train_eval") + HELD_OUT
DEFAULT_MODELS = ("gpt2", "resnet50", "llama")
ALLOCATORS = ("native", "expandable", "gmem")
DEFAULT_ALLOCATORS = ("native", "expandable", "gmem")


def gpt2_step(torch, warmup, steps):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config()).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")

    def step(i):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def resnet50_step(torch, warmup, steps):
    import torchvision

    model = torchvision.models.resnet50().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images = torch.randn(64, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 1000, (64,), device="cuda")

    def step(i):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def each_length_warmed(name, timed_lengths):
    """models.<name>_step over `timed_lengths(models, steps)` as the timed steps, after a
    warm-up that runs each distinct length among them once (in order of first appearance; the
    `warmup` argument is ignored). On an H100 a length's first step took 200-300 ms longer than
    its later ones under native and expandable alike (2026-11-23; cause not established, per-shape
    kernel set-up most likely), which would otherwise swamp the comparison."""

    def make(torch, warmup, steps):
        sys.path.insert(0, HERE)
        import models

        timed = timed_lengths(models, steps)
        warm = list(dict.fromkeys(timed))
        step = getattr(models, name + "_step")(torch, len(warm) + steps, lengths=warm + timed)
        step.warmup = len(warm)
        step.varying = True  # steps of different lengths: the total compares allocators
        return step

    return make


llama_step = each_length_warmed("llama", lambda models, steps: models.llama_lengths(steps))
bert_varlen_step = each_length_warmed("bert_varlen", lambda models, steps: models.bert_lengths(steps))


def models_step(name, varying=True):
    """models.<name>_step (the train/eval loops and the held-out workloads; not in --all by
    default). `varying`: its steps differ (evaluations among training steps, lengths drawn per
    step), so the total compares allocators, not the median."""

    def make(torch, warmup, steps):
        sys.path.insert(0, HERE)
        import models

        step = getattr(models, name + "_step")(torch, warmup + steps)
        step.varying = varying
        return step

    return make


# Held-out programs whose every step has the same shapes: their median step compares allocators.
FIXED_SHAPES = {"vit", "gpt2_accum", "unet", "moe", "gpt2_compiled", "gpt2_cudagraphs",
                "prefetch_train", "gan", "offload_train", "amp_scaler", "distill", "ddp_train",
                "ema_train", "clip_train", "bert_mlm"}
STEPS = {"gpt2": gpt2_step, "resnet50": resnet50_step, "llama": llama_step,
         "gpt2_train_eval": models_step("gpt2_train_eval"),
         "resnet50_train_eval": models_step("resnet50_train_eval"),
         "bert_varlen": bert_varlen_step}
STEPS.update({name: models_step(name, varying=name not in FIXED_SHAPES)
              for name in HELD_OUT if name not in STEPS})

# gmem's counters recorded for each step (the increase over it), under the record's keys.
PER_STEP_STATS = {
    "step_maps": "gmem.num_maps",           # device maps
    "step_maps_ahead": "gmem.num_maps_ahead",  # of those, made by the map-ahead thread
    "step_ahead_wait_us": "gmem.map_ahead_wait_us",  # mallocs waiting for its batches
    "step_plans": "gmem.plans",             # plans taken into use: a shape's first step on its plan
    "step_waits": "num_sync_all_streams",   # host waits for a stream
    "step_call_us": "gmem.device_call_us",  # host time in the driver's memory calls
    "step_wait_us": "gmem.stream_wait_us",  # host time blocked waiting for a stream
    "step_handovers": "gmem.num_stream_handovers",  # streams made to wait on the GPU instead
}


def is_oom(torch, error):
    kinds = tuple(k for k in (getattr(torch, "OutOfMemoryError", None),
                              getattr(torch.cuda, "OutOfMemoryError", None)) if k)
    return (isinstance(error, kinds + (MemoryError,)) or
            "out of memory" in str(error).lower())


def run_one(model, allocator, steps, warmup, cap_bytes=None, empty_cache=False):
    # Alone (not under --all), the allocator's setting is made here, before torch starts.
    if allocator == "expandable":
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    uses_gmem = allocator.startswith("gmem")
    if uses_gmem:
        sys.path.insert(0, PYTHON_DIR)
        import gmem.torch

        gmem.torch.enable()
    import torch

    if cap_bytes and uses_gmem:  # as tests/python/test_torch_gpu.py does: CUDA first
        torch.cuda.init()
        gmem.set_memory_limit(int(cap_bytes))
    elif cap_bytes:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total))

    torch.manual_seed(0)
    start = time.time()
    record = dict(kind="train", model=model, allocator=allocator, steps=steps, warmup=warmup,
                  torch=torch.__version__, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    if cap_bytes:
        record["cap_bytes"] = int(cap_bytes)
    if empty_cache:
        record["empty_cache"] = True
    times, loss = [], None
    maps_after_warmup = None
    per_step = {key: [] for key in PER_STEP_STATS}  # gmem's counters, step by step
    before = dict.fromkeys(PER_STEP_STATS, 0)
    step_reserved = []  # MiB reserved after each step, warm-up included: when does it climb?
    i = None
    try:
        step = STEPS[model](torch, warmup, steps)
        warmup = record["warmup"] = getattr(step, "warmup", warmup)
        record["varying_steps"] = getattr(step, "varying", False)
        for i in range(warmup + steps):
            if uses_gmem and i == warmup:
                maps_after_warmup = gmem.memory_stat("gmem.num_maps")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step(i)
            if empty_cache:  # as programs that call it after every step do, inside the timing
                torch.cuda.empty_cache()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            step_reserved.append(round(torch.cuda.memory_reserved() / 2**20))
            if uses_gmem:  # outside the timing: does the layout settle?
                for key, stat in PER_STEP_STATS.items():
                    now = gmem.memory_stat(stat)
                    per_step[key].append(now - before[key])
                    before[key] = now
    except Exception as e:  # an OOM is the run's result; anything else fails the run
        if not is_oom(torch, e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        record.update(oom=True, oom_step=i, oom_message=first[:300])
    timed = times[warmup:]
    if timed and "oom" not in record:
        # Every allocator runs the same steps (llama: the same lengths in the same order), so the
        # timed steps' total compares them where the median of steps of different lengths does not.
        record.update(median_ms=round(statistics.median(timed) * 1e3, 2),
                      min_ms=round(min(timed) * 1e3, 2), max_ms=round(max(timed) * 1e3, 2),
                      total_ms=round(sum(timed) * 1e3, 1),
                      step_ms=[round(t * 1e3, 1) for t in timed])
    record.update(steps_done=len(times), loss=round(float(loss), 4) if loss is not None else None,
                  peak_allocated=torch.cuda.max_memory_allocated(),
                  peak_reserved=torch.cuda.max_memory_reserved(), s=round(time.time() - start, 1),
                  step_reserved_mib=step_reserved)
    if record["peak_allocated"]:
        record["reserved_ratio"] = round(record["peak_reserved"] / record["peak_allocated"], 4)
    if record["loss"] is not None and not math.isfinite(record["loss"]) and "oom" not in record:
        # The program computed garbage, so its times and memory are no result: graph_serve's
        # graphs read the weights of a model it had dropped, and its NaN went unseen for weeks.
        record["error"] = "non-finite output (%s): the program is broken" % record["loss"]
    if uses_gmem:
        import gmem

        stats = gmem.memory_stats()
        record.update(maps=stats.get("gmem.num_maps"), stitches=stats.get("gmem.num_stitches"),
                      page_size=stats.get("gmem.granularity"),  # GMEM_PAGE_SIZE, or 2 MiB
                      stream_waits=stats.get("num_sync_all_streams"),
                      stream_handovers=stats.get("gmem.num_stream_handovers"),
                      handovers_setting=os.environ.get("GMEM_STREAM_HANDOVERS", "on"),
                      plan={k[len("gmem."):]: v for k, v in stats.items()
                            if k.startswith(("gmem.plan", "gmem.steps_marked"))},
                      device_allocs=stats.get("num_device_alloc"),
                      alloc_retries=stats.get("num_alloc_retries"))
        if maps_after_warmup is not None:
            record["maps_after_warmup"] = stats.get("gmem.num_maps", 0) - maps_after_warmup
        record.update(per_step)
    else:
        record["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries")
    return record


def run_child(args, model, allocator, cap_bytes=None, cap_ratio=None):
    """One run in its own process; returns its record (with "error" when it failed)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("GMEM_DEVICE", None)
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    cmd = [sys.executable, os.path.join(HERE, "train_bench.py"), "--model", model,
           "--allocator", allocator, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if cap_bytes:
        cmd += ["--cap-bytes", str(cap_bytes)]
    if args.empty_cache:
        cmd += ["--empty-cache"]
    began = time.time()
    try:
        result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                universal_newlines=True, timeout=args.timeout)
        lines = [l for l in result.stdout.splitlines() if l.startswith("{")]
        if result.returncode == 0 and lines:
            record = json.loads(lines[-1])
            record["process_s"] = round(time.time() - began, 1)  # start-up and imports included
            if cap_ratio:
                record["cap_ratio"] = cap_ratio
            return record
        print(result.stderr[-3000:], file=sys.stderr, flush=True)
        last = [l for l in result.stderr.splitlines() if l.strip()][-1:] or ["no output"]
        error = "exit %d: %s" % (result.returncode, last[0].strip())
    except subprocess.TimeoutExpired:
        error = "timed out after %d s" % args.timeout
    record = dict(kind="train", model=model, allocator=allocator, error=error[-300:])
    if cap_bytes:
        record.update(cap_bytes=cap_bytes, cap_ratio=cap_ratio)
    return record


def run_all(args, models, allocators, uncapped):
    """Every model x allocator when `uncapped`, then the capped runs of --cap-ratio. Returns the
    number of runs that failed (an OOM under a cap is a result, not a failure)."""
    failed = 0
    native = {}
    if uncapped:
        for model in models:
            for allocator in allocators:
                record = run_child(args, model, allocator)
                emit(record, args.out)
                failed += "error" in record
                if allocator == "native":
                    native[model] = record
    if args.cap_ratio:
        for model in args.cap_models or models:
            reference = native.get(model)
            if not reference or "error" in reference:  # measure the peak first
                reference = run_child(args, model, "native")
                reference["role"] = "cap_reference"
                emit(reference, args.out)
                if "error" in reference:
                    failed += 1
                    continue
            cap = int(args.cap_ratio * reference["peak_allocated"])
            for allocator in allocators:
                record = run_child(args, model, allocator, cap, args.cap_ratio)
                record["cap_reference_peak_allocated"] = reference["peak_allocated"]
                emit(record, args.out)
                failed += "error" in record
    return failed


def show(paths):
    """Prints each run of the JSON-lines files `paths`: time, reserved / allocated, and gmem's maps
    step by step (the GPU scripts' summary)."""
    for path in paths:
        for r in read_json_lines(path):
            print(f"{r['model']:20} {r['allocator']:10} median {r.get('median_ms', 0):7.1f} "
                  f"total {r.get('total_ms', 0):7.0f} ms  reserved/allocated {r.get('reserved_ratio')}  "
                  f"maps after warm-up {r.get('maps_after_warmup')} {r.get('error', '')}")
            if r.get("step_maps"):
                print("   maps", r["step_maps"])
            if r.get("step_call_us"):  # the driver's memory calls and stream waits, ms a step
                print("   call ms", [round(us / 1000, 1) for us in r["step_call_us"]])
                print("   wait ms", [round(us / 1000, 1) for us in r["step_wait_us"]])
            if r.get("step_handovers"):
                print("   handovers (%s)" % r.get("handovers_setting", "on"), r["step_handovers"])
            print("   ms", r.get("step_ms"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all", action="store_true", help="every model x allocator, one process each")
    parser.add_argument("--model", choices=MODELS)
    parser.add_argument("--allocator", choices=ALLOCATORS)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(DEFAULT_MODELS))
    parser.add_argument("--allocators", nargs="+", choices=ALLOCATORS, default=list(DEFAULT_ALLOCATORS))
    parser.add_argument("--cap-ratio", type=float,
                        help="also run under a cap of this times the native peak allocated")
    parser.add_argument("--cap-models", nargs="+", choices=MODELS,
                        help="the models run under the cap (default: every model run)")
    parser.add_argument("--cap-bytes", type=int, help=argparse.SUPPRESS)  # one capped run
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=150, help="seconds per run (--all, --cap-ratio)")
    parser.add_argument("--empty-cache", action="store_true",
                        help="call torch.cuda.empty_cache() after every step (timed with it)")
    parser.add_argument("--out")
    parser.add_argument("--show", nargs="+", metavar="FILE", help="print the runs in these files")
    args = parser.parse_args()
    if args.show:
        return show(args.show)
    if args.cap_ratio is not None and args.cap_ratio <= 0:
        parser.error("--cap-ratio must be positive")
    if args.model and args.allocator and (args.cap_bytes or not args.cap_ratio):
        emit(run_one(args.model, args.allocator, args.steps, args.warmup, args.cap_bytes, args.empty_cache),
             args.out)
    elif args.all:
        sys.exit(1 if run_all(args, args.models, args.allocators, uncapped=True) else 0)
    elif args.model and args.cap_ratio:
        allocators = [args.allocator] if args.allocator else args.allocators
        args.cap_models = [args.model]
        sys.exit(1 if run_all(args, [args.model], allocators, uncapped=False) else 0)
    else:
        parser.error("give --all, or --model and --allocator, or --model and --cap-ratio")


if __name__ == "__main__":
    main()
