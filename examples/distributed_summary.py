"""gmem.torch.distributed_summary() with two ranks over gloo, on gmem's simulated device (no GPU
needed; PyTorch needed). Rank 1 holds more than rank 0, as an embedding shard would:

    GMEM_DEVICE=sim PYTHONPATH=python python3 examples/distributed_summary.py
"""

import os
import sys

import torch.multiprocessing as mp


def rank_main(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    import torch.distributed as dist
    import gmem
    import gmem.torch

    dist.init_process_group("gloo", rank=rank, world_size=world)
    gmem.enable_tracking()
    held = [gmem.malloc((64 << 20) if rank == 0 else (512 << 20))]
    if rank == 1:
        held.append(gmem.malloc(96 << 20))
    gmem.torch.distributed_summary()  # a collective: every rank calls it, rank 0 prints
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GMEM_DEVICE", "sim")
    mp.spawn(rank_main, args=(2,), nprocs=2)
    sys.exit(0)
