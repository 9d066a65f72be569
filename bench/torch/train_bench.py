"""Training steps under each allocator, each run in its own process (an allocator is chosen
before CUDA starts): median step time after warm-up, peak allocated and peak reserved.

    python3 bench/torch/train_bench.py --all [--out FILE]              # every model x allocator
    python3 bench/torch/train_bench.py --model gpt2 --allocator gmem   # one run, in this process

Models: GPT-2 124M (transformers, random init, batch 8 x 1024 tokens, AdamW, bf16 autocast) and
ResNet-50 (torchvision, batch 64 at 224x224, SGD, fp32): the programs of tests/data's traces.
Allocators: native (PyTorch's caching allocator), expandable (the same with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), gmem (gmem.torch.enable()) and gmem_compact
(the same with GMEM_CACHE_SLACK=0.015625: memory first).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common import HERE, PYTHON_DIR, emit

MODELS = ("gpt2", "resnet50")
ALLOCATORS = ("native", "expandable", "gmem", "gmem_compact")


def gpt2_step(torch):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config()).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def resnet50_step(torch):
    import torchvision

    model = torchvision.models.resnet50().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images = torch.randn(64, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 1000, (64,), device="cuda")

    def step():
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def run_one(model, allocator, steps, warmup):
    uses_gmem = allocator.startswith("gmem")
    if uses_gmem:
        sys.path.insert(0, PYTHON_DIR)
        import gmem.torch

        gmem.torch.enable()
    import torch

    torch.manual_seed(0)
    start = time.time()
    step = {"gpt2": gpt2_step, "resnet50": resnet50_step}[model](torch)
    times, loss = [], None
    maps_after_warmup = None
    for i in range(warmup + steps):
        if uses_gmem and i == warmup:
            import gmem

            maps_after_warmup = gmem.memory_stats().get("gmem.num_maps", 0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    timed = times[warmup:]
    record = dict(kind="train", model=model, allocator=allocator, steps=steps, warmup=warmup,
                  median_ms=round(statistics.median(timed) * 1e3, 2),
                  min_ms=round(min(timed) * 1e3, 2), max_ms=round(max(timed) * 1e3, 2),
                  peak_allocated=torch.cuda.max_memory_allocated(),
                  peak_reserved=torch.cuda.max_memory_reserved(),
                  loss=round(float(loss.item()), 4), s=round(time.time() - start, 1),
                  torch=torch.__version__)
    record["reserved_ratio"] = round(record["peak_reserved"] / record["peak_allocated"], 4)
    if uses_gmem:
        import gmem

        stats = gmem.memory_stats()
        record.update(maps=stats.get("gmem.num_maps"), stitches=stats.get("gmem.num_stitches"),
                      device_allocs=stats.get("num_device_alloc"),
                      maps_after_warmup=stats.get("gmem.num_maps", 0) - maps_after_warmup)
    return record


def run_all(args):
    """Returns the number of runs that failed."""
    failed = 0
    for model in args.models:
        for allocator in args.allocators:
            env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            env.pop("GMEM_DEVICE", None)
            if allocator == "expandable":
                env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
            if allocator == "gmem_compact":  # memory first: stitch beyond 1/64 over the high-water mark
                env["GMEM_CACHE_SLACK"] = "0.015625"
            cmd = [sys.executable, os.path.join(HERE, "train_bench.py"), "--model", model,
                   "--allocator", allocator, "--steps", str(args.steps), "--warmup",
                   str(args.warmup)]
            try:
                result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        universal_newlines=True, timeout=args.timeout)
                lines = [l for l in result.stdout.splitlines() if l.startswith("{")]
                if result.returncode == 0 and lines:
                    emit(json.loads(lines[-1]), args.out)
                    continue
                print(result.stderr[-3000:], file=sys.stderr, flush=True)
                last = [l for l in result.stderr.splitlines() if l.strip()][-1:] or ["no output"]
                error = "exit %d: %s" % (result.returncode, last[0].strip())
            except subprocess.TimeoutExpired:
                error = "timed out after %d s" % args.timeout
            failed += 1
            emit(dict(kind="train", model=model, allocator=allocator, error=error[-300:]), args.out)
    return failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all", action="store_true", help="every model x allocator, one process each")
    parser.add_argument("--model", choices=MODELS)
    parser.add_argument("--allocator", choices=ALLOCATORS)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--allocators", nargs="+", choices=ALLOCATORS, default=list(ALLOCATORS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=150, help="seconds per run (--all)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.all:
        sys.exit(1 if run_all(args) else 0)
    elif args.model and args.allocator:
        emit(run_one(args.model, args.allocator, args.steps, args.warmup), args.out)
    else:
        parser.error("give --all, or --model and --allocator")


if __name__ == "__main__":
    main()
