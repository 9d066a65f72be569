"""Training under the wrappers that training at scale runs through. ddp_train and fsdp_train run
on one rank (an NCCL process group over one GPU: _one_rank_group), the wrappers' real code: their
buckets, streams and copies; distributed_bench.py runs them on every GPU. The held-out batch of
each program is in parentheses (models/__init__.py).

- ddp_train (8): transformers GPT-2 124M under DistributedDataParallel, gradients as views of its
  buckets (shared.finish_training_step).
- fsdp_train (8): the Llama-style model of llama.py (12 layers) under FSDP2, fully_shard per layer
  (shared.finish_training_step).
- fabric_train (9): the Llama-style model under Lightning Fabric (bf16-mixed, gradients clipped),
  the memory statistics polled after every step; its own optimizer step.
- fsdp2_varlen (issue #56 item 5): a transformers Llama of 1.1B parameters (FSDP2_LLAMA) under
  FSDP2 over a length drawn per step (fsdp2_varlen_lengths), a rank per GPU in a torchrun job
  (fsdp2_bench.py); alone, on a group of one rank (shared.finish_training_step).
"""

import random

from . import shared  # shared.finish_training_step, looked up at each call (host_time.py)
from .llama import LLAMA, _llama_modules


def _one_rank_group(torch):
    """An NCCL process group of one rank (this GPU), made once per process."""
    import os
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
        dist.init_process_group("nccl", rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))


def ddp_train_step(torch, steps, seed=0, batch=8, length=512):
    """transformers GPT-2 124M (random init) under DistributedDataParallel on one rank
    (NCCL), gradients as views of its 25 MB buckets (gradient_as_bucket_view), bf16 autocast,
    AdamW; one shape every step."""
    from torch.nn.parallel import DistributedDataParallel
    from transformers import GPT2Config, GPT2LMHeadModel

    _one_rank_group(torch)
    torch.manual_seed(seed)
    config = GPT2Config()
    model = DistributedDataParallel(GPT2LMHeadModel(config).cuda().train(),
                                    gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        ids = torch.randint(0, config.vocab_size, (batch, length), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, length)] * steps
    return step


def fsdp_train_step(torch, steps, seed=0, batch=4, layers=12):
    """The Llama-style model of llama_step (12 layers, no activation checkpointing) under FSDP2
    (fully_shard on each layer and the root) on one rank: bf16 parameters gathered for each
    layer's forward and backward and freed after, fp32 gradients reduced, AdamW on the fp32
    shards; a sequence length drawn per step from 512..2048."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _one_rank_group(torch)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = dict(LLAMA, layers=layers)
    with torch.device("cuda"):
        model = _llama_modules(torch)(**config, checkpoint=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    lengths = [rng.randrange(512, 2049, 64) for _ in range(steps)]

    def step(i):
        tokens = torch.randint(0, config["vocab"], (batch, lengths[i] + 1), device="cuda")
        loss = model(tokens[:, :-1], tokens[:, 1:])
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, t) for t in lengths]
    return step


def fabric_train_step(torch, steps, seed=0, batch=8, lengths=(256, 512, 1024), layers=12):
    """Training under Lightning Fabric, the loop scripts write with it: the Llama-style model
    (12 layers, no activation checkpointing) set up by Fabric with precision="bf16-mixed",
    fabric.backward, fabric.clip_gradients, AdamW; batches bucketed by length (256, 512 or 1024
    tokens, drawn per step), and the device's memory statistics read after every step as
    Lightning's DeviceStatsMonitor reads them (torch.cuda.memory_stats)."""
    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric

    torch.manual_seed(seed)
    rng = random.Random(seed)
    fabric = Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
    config = dict(LLAMA, layers=layers)
    with torch.device("cuda"):
        model = _llama_modules(torch)(**config, checkpoint=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    plan = [rng.choice(lengths) for _ in range(steps)]
    polled = []

    def step(i):
        tokens = torch.randint(0, config["vocab"], (batch, plan[i] + 1), device="cuda")
        loss = model(tokens[:, :-1], tokens[:, 1:])
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stats = torch.cuda.memory_stats()
        polled.append(stats.get("allocated_bytes.all.current", 0))
        return loss.item()

    step.shapes = ["%d x %d" % (batch, t) for t in plan]
    return step


FSDP2_LLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                   num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                   max_position_embeddings=2048)  # TinyLlama's shape: 1.1B parameters
FSDP2_SEQ = (256, 2048, 64)  # lengths drawn from range(256, 2048 + 1, 64)


def fsdp2_varlen_lengths(count, seed=0):
    """fsdp2_varlen's sequence length of each step: the same on every rank and allocator."""
    rng = random.Random(seed)
    lo, hi, step = FSDP2_SEQ
    return [rng.randrange(lo, hi + 1, step) for _ in range(count)]


def fsdp2_varlen_step(torch, steps, seed=0, batch=8):
    """A transformers Llama of 1.1B parameters (LlamaForCausalLM(LlamaConfig(...)) of TinyLlama's
    shape: 22 layers, 2048 wide, 32 heads, 4 KV heads, SwiGLU 5632, vocabulary 32000; random
    init, transformers' default attention (SDPA), no cache) under FSDP2: fully_shard on each decoder layer, then on the
    root, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), AdamW on the fp32 shards;
    batch 8 of random tokens a rank, of a sequence length drawn per step from 256..2048
    (multiples of 64; fsdp2_varlen_lengths, the same on every rank). Runs in a torch.distributed
    job (torchrun: fsdp2_bench.py), a rank per GPU; alone, on a process group of one rank. The
    model is built from `seed` on every rank; the tokens from the generator as the caller seeds
    it (fsdp2_bench.py: 1000 + rank)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    if not dist.is_initialized():
        _one_rank_group(torch)
    torch.manual_seed(seed)
    config = LlamaConfig(**FSDP2_LLAMA, use_cache=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).train()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    lengths = fsdp2_varlen_lengths(steps, seed)

    def step(i):
        ids = torch.randint(0, config.vocab_size, (batch, lengths[i]), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, t) for t in lengths]
    return step
