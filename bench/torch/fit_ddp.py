"""gmem.fit_batch_size under DDP, a rank per GPU, each rank under its own cap:

    python bench/torch/fit_ddp.py --gpus 2 --caps 16,12 --out fit_ddp.jsonl

Each rank enables gmem, wraps GPT-2 124M (sequence 1024, bf16 autocast, AdamW) in
DistributedDataParallel, fits under its cap, then trains --train-steps steps at the pick. One JSON
line a rank: its pick, the batch sizes it ran, and whether training ran out of memory. The
ranks must agree on the pick and run the same steps, and the pick must fit the tightest rank.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

GiB = 1 << 30


def rank_main(rank, world, caps, train_steps, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    gmem = common.import_gmem()
    import gmem.torch
    gmem.torch.enable()
    import torch
    import torch.distributed as dist
    import transformers

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_positions=1024)
    model = torch.nn.parallel.DistributedDataParallel(
        transformers.GPT2LMHeadModel(config).cuda(), device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch_size):
        ids = torch.randint(0, config.vocab_size, (batch_size, 1024), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    cap = int(caps[rank] * GiB)
    fit = gmem.fit_batch_size(step, limit=cap, restore=(model, optimizer), timeout=120)
    if rank == 0:
        print(fit, flush=True)
    gmem.set_memory_limit(cap)
    oom = None
    for i in range(train_steps):
        try:
            step(fit.batch_size)
        except torch.OutOfMemoryError as e:
            oom = "step %d: %s" % (i, str(e).split("\n", 1)[0])
            break
    torch.cuda.synchronize()
    record = {"bench": "fit_ddp", "rank": rank, "world": world, "cap_gib": caps[rank],
              "pick": fit.batch_size, "sizes": [p.batch_size for p in fit.steps],
              "ooms_caught": fit.out_of_memory_caught, "fit_seconds": fit.seconds,
              "predicted_peak": fit.predicted_peak, "measured_peak": fit.measured_peak,
              "train_steps": train_steps, "train_oom": oom,
              "device": torch.cuda.get_device_name()}
    common.emit(record, out)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--caps", default="16,12", help="GiB a rank, comma separated")
    parser.add_argument("--train-steps", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    caps = [float(c) for c in args.caps.split(",")]
    if len(caps) < args.gpus:
        caps += [caps[-1]] * (args.gpus - len(caps))
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(args.gpus, caps, args.train_steps, args.out), nprocs=args.gpus)
    if args.out:
        records = [json.loads(l) for l in open(args.out) if '"fit_ddp"' in l]
        picks = {r["pick"] for r in records}
        sizes = {tuple(r["sizes"]) for r in records}
        print("ranks agree on the pick: %s (%s); same steps: %s; training OOM: %s" % (
            len(picks) == 1, sorted(picks), len(sizes) == 1,
            [r["train_oom"] for r in records]))


if __name__ == "__main__":
    main()
