"""gmem.fit_batch_size on real models under memory caps, against the truth found by trying:

    python bench/torch/fit_bench.py gpt2 --caps 16,24 --out results.jsonl

For each model and cap (GiB, set as gmem's limit), in one process under gmem.torch:
  1. gmem.fit_batch_size(step, limit=cap, restore=(model, optimizer)): the pick, the steps it
     ran, their out-of-memory errors (caught), its wall time, the predicted and measured peak;
  2. the true largest batch under gmem at that cap: steps at pick + 1, pick + 2, ... until one
     runs out of memory (and down from the pick, should the pick itself fail);
  3. --train-steps training steps at the pick (an out-of-memory is a result);
  4. with --what-if: gmem.what_fits at the cap, then one real step at the reference batch under
     each measured setting, against the row's predicted peak.
One JSON line a (model, cap) on stdout and in --out; bench/torch/fit_report.py tables them.

Models (random init, nothing downloaded):
  gpt2     transformers GPT-2 124M, sequence 1024, bf16 autocast, AdamW
  resnet50 torchvision ResNet-50, 224 px images, SGD with momentum
  llama    the Llama-style 374M decoder of models/llama.py, every layer checkpointed, bf16 autocast,
           AdamW; probed at its longest sequence (2048) and trained on lengths drawn per step
           from 512..2048
"""

import argparse
import contextlib
import gc
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import models  # noqa: E402

GiB = 1 << 30


def build(torch, name):
    """(model, optimizer, step(batch_size, length=None)) for a model name."""
    torch.manual_seed(0)
    if name == "gpt2":
        import transformers
        config = transformers.GPT2Config(n_positions=1024)
        model = transformers.GPT2LMHeadModel(config).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(batch_size, length=1024):
            ids = torch.randint(0, config.vocab_size, (batch_size, length), device="cuda")
            # Without its own autocast (what_fits' fp32 base), not autocast(enabled=False),
            # which would switch off the autocast what_fits puts around the step.
            precision = (torch.autocast("cuda", dtype=torch.bfloat16) if step.autocast
                         else contextlib.nullcontext())
            with precision:
                loss = model(input_ids=ids, labels=ids).loss
            models.finish_training_step(optimizer, loss)
    elif name == "resnet50":
        import torchvision
        model = torchvision.models.resnet50(weights=None).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(batch_size, length=None):
            images = torch.randn(batch_size, 3, 224, 224, device="cuda")
            labels = torch.randint(0, 1000, (batch_size,), device="cuda")
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            models.finish_training_step(optimizer, loss)
    elif name == "llama":
        import torch.utils.checkpoint  # noqa: F401
        with torch.device("cuda"):
            model = models._llama_modules(torch)(**models.LLAMA)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

        def step(batch_size, length=models.LLAMA["max_seq"]):
            tokens = torch.randint(0, models.LLAMA["vocab"], (batch_size, length + 1), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], tokens[:, 1:])
            models.finish_training_step(optimizer, loss)
    else:
        raise SystemExit("unknown model %r (gpt2, resnet50, llama)" % name)
    step.autocast = True
    return model, optimizer, step


def runs(gmem, step, batch_size):
    """Whether one step at `batch_size` runs (an out-of-memory is caught and cleaned up)."""
    try:
        step(batch_size)
        return True
    except Exception as e:  # noqa: BLE001
        if not gmem.fit.is_out_of_memory(e):
            raise
        e.__traceback__ = None
        del e
        gc.collect()
        return False


def true_largest(gmem, step, pick, limit=64):
    """The largest batch that runs, scanning up from the pick (down if the pick fails)."""
    if pick is None or pick < 1:
        return None, 0
    tries = 0
    if runs(gmem, step, pick):
        b = pick
        while tries < limit:
            tries += 1
            if not runs(gmem, step, b + 1):
                return b, tries
            b += 1
        return b, tries
    b = pick - 1
    while b >= 1 and tries < limit:
        tries += 1
        if runs(gmem, step, b):
            return b, tries
        b -= 1
    return 0, tries


def train(gmem, torch, name, step, batch_size, steps):
    """`steps` training steps at the pick; (steps run, out-of-memory or None, seconds)."""
    lengths = [random.Random(1).randrange(512, 2049, 64) for _ in range(steps)]
    started = time.perf_counter()
    for i in range(steps):
        try:
            if name == "llama":
                step(batch_size, lengths[i])
            else:
                step(batch_size)
        except Exception as e:  # noqa: BLE001
            if not gmem.fit.is_out_of_memory(e):
                raise
            message = str(e).split("\n", 1)[0]
            e.__traceback__ = None
            del e
            gc.collect()
            return i, message, time.perf_counter() - started
    torch.cuda.synchronize()
    return steps, None, time.perf_counter() - started


def what_if_check(gmem, torch, model, optimizer, step, cap):
    """what_fits at the cap for the step in fp32 (GPT-2's step without its autocast), then each
    measured row's peak allocated at the reference against one real step at that setting."""
    step.autocast = False
    try:
        table = gmem.what_fits(step, model=model, limit=cap, restore=(model, optimizer))
    finally:
        step.autocast = True
    step.autocast = False
    print(table, flush=True)
    checks = []
    reference = table.reference
    for row in table.rows:
        if not row.how.startswith("measured") or row.peak is None or row.setting == "as is":
            continue
        if row.setting.startswith("bf16"):
            context = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
            toggle = None
        elif row.setting.startswith("fp16"):
            context = lambda: torch.autocast("cuda", dtype=torch.float16)  # noqa: E731
            toggle = None
        elif row.setting.startswith("activation"):
            context, toggle = None, model
        else:
            continue
        if toggle is not None:
            toggle.gradient_checkpointing_enable()
        gmem.reset_peak_memory_stats()
        try:
            if context is not None:
                with context():
                    step(reference)
            else:
                step(reference)
            measured = gmem.max_memory_allocated()
        finally:
            if toggle is not None:
                toggle.gradient_checkpointing_disable()
        checks.append({"setting": row.setting, "predicted_peak": row.peak,
                       "measured_peak": measured,
                       "error": (row.peak - measured) / float(measured)})
    step.autocast = True
    return table.as_dict(), checks


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--caps", default="16,24", help="GiB, comma separated")
    parser.add_argument("--train-steps", type=int, default=50)
    parser.add_argument("--what-if", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()

    gmem = common.import_gmem()
    import gmem.torch
    gmem.torch.enable()
    import torch

    model, optimizer, step = build(torch, args.model)
    for cap_gib in [float(c) for c in args.caps.split(",")]:
        cap = int(cap_gib * GiB)
        fit = gmem.fit_batch_size(step, limit=cap, restore=(model, optimizer))
        print(fit, flush=True)
        record = {"bench": "fit", "model": args.model, "cap_gib": cap_gib,
                  "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "fit": fit.as_dict()}
        gmem.set_memory_limit(cap)
        started = time.perf_counter()
        truth, tries = true_largest(gmem, step, fit.batch_size)
        record["true_largest"] = truth
        record["true_largest_steps"] = tries
        record["true_largest_seconds"] = time.perf_counter() - started
        if args.train_steps:
            ran, oom, seconds = train(gmem, torch, args.model, step, fit.batch_size,
                                      args.train_steps)
            record.update(train_steps=ran, train_oom=oom, train_seconds=seconds,
                          train_peak_reserved=gmem.max_memory_reserved())
        if args.what_if:
            record["what_if"], record["what_if_checks"] = what_if_check(
                gmem, torch, model, optimizer, step, cap)
        gmem.set_memory_limit(0)
        common.emit(record, args.out)
        optimizer.zero_grad(set_to_none=True)
        gc.collect()


if __name__ == "__main__":
    main()
