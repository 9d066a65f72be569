"""Lightning's BatchSizeFinder against gmem's FitBatchSize callback, on the same LightningModule:

    python bench/torch/fit_lightning.py --finder lightning --cap 24      # PyTorch's allocator
    python -m gmem.run bench/torch/fit_lightning.py --finder lightning --cap 24   # under gmem
    python -m gmem.run bench/torch/fit_lightning.py --finder gmem --cap 24

GPT-2 124M (random init), sequence 1024, precision "bf16-mixed", AdamW, under a memory cap (GiB:
gmem's limit under gmem, set_per_process_memory_fraction under PyTorch's allocator). The trainer
runs the finder at fit start (Lightning's in mode "binsearch", 3 steps a trial, as a new user
would), then --steps training steps at its pick. One JSON line: the finder's wall time, pick,
trials and the out-of-memory errors inside it, and whether training at the pick ran out.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

GiB = 1 << 30


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--finder", choices=("lightning", "gmem"), required=True)
    parser.add_argument("--cap", type=float, default=24.0)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()

    import torch
    import transformers
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import BatchSizeFinder
        from lightning.pytorch.tuner import batch_size_scaling
    except ImportError:
        import pytorch_lightning as pl
        from pytorch_lightning.callbacks import BatchSizeFinder
        from pytorch_lightning.tuner import batch_size_scaling

    gmem = None
    under_gmem = False
    try:
        import gmem.torch as gmem_torch  # noqa: F401
        under_gmem = gmem_torch.is_enabled()
        gmem = common.import_gmem() if under_gmem else None
    except ImportError:
        pass
    cap = int(args.cap * GiB)
    if under_gmem:
        gmem.set_memory_limit(cap)
    else:
        torch.cuda.set_per_process_memory_fraction(
            cap / float(torch.cuda.get_device_properties(0).total_memory))

    class GPT2(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 2
            self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=1024))

        def train_dataloader(self):
            data = torch.randint(0, 50257, (4096, 1024))
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=True)

        def training_step(self, ids, index):
            loss = self.model(input_ids=ids, labels=ids).loss
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    counts = {"trials": 0, "ooms": 0}
    if args.finder == "lightning":
        original = getattr(batch_size_scaling, "_try_loop_run", None)

        def counted(trainer, params):
            counts["trials"] += 1
            try:
                return original(trainer, params)
            except Exception as e:
                if batch_size_scaling.is_oom_error(e):
                    counts["ooms"] += 1
                raise

        if original is not None:  # Lightning 2.x; otherwise trials go uncounted
            batch_size_scaling._try_loop_run = counted
        finder = BatchSizeFinder(mode="binsearch")
    else:
        from gmem.lightning import FitBatchSize
        finder = FitBatchSize()

    timing = {}

    class Timer(pl.Callback):
        """Times the finder: it runs in on_fit_start, between these two hooks."""

        def setup(self, trainer, module, stage):
            timing["start"] = time.perf_counter()

        def on_train_start(self, trainer, module):
            timing["end"] = time.perf_counter()

    torch.manual_seed(0)
    module = GPT2()
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed",
                         max_steps=args.steps, callbacks=[Timer(), finder], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    record = {"bench": "fit_lightning", "finder": args.finder, "cap_gib": args.cap,
              "allocator": "gmem" if under_gmem else "native", "steps": args.steps,
              "device": torch.cuda.get_device_name()}
    oom = None
    started = time.perf_counter()
    try:
        trainer.fit(module)
    except Exception as e:  # noqa: BLE001
        if "out of memory" not in str(e).lower() and "OutOfMemory" not in type(e).__name__:
            raise
        oom = str(e).split("\n", 1)[0]
    record["seconds_total"] = time.perf_counter() - started
    record["finder_seconds"] = timing.get("end", time.perf_counter()) - timing.get("start", started)
    record["pick"] = module.batch_size
    record["train_oom"] = oom
    record["global_step"] = trainer.global_step
    if args.finder == "lightning":
        record.update(trials=counts["trials"], finder_ooms=counts["ooms"])
    else:
        fit = finder.fit
        record.update(trials=len(fit.steps) if fit else None,
                      finder_ooms=fit.out_of_memory_caught if fit else None,
                      fit=fit.as_dict() if fit else None)
    common.emit(record, args.out)


if __name__ == "__main__":
    main()
