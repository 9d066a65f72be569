"""The Llama-style decoder in plain torch, and the schedules train_bench.py and capture_traces.py
run it over.

- llama (llama_step): RMSNorm, SwiGLU MLP, rotary positions, causal attention through
  F.scaled_dot_product_attention, 374M parameters (LLAMA; llama_parameters()), each layer under
  torch.utils.checkpoint (use_reentrant=False), batch 8 (LLAMA_BATCH) with a sequence length
  drawn per step from 512..2048 (multiples of 64: LLAMA_SEQ, llama_lengths), bf16 autocast,
  AdamW.
- llama_rounds (llama_rounds_step): llama_step over train_bench's schedule for 60 timed steps
  (llama_warm_and_timed: each distinct length once, then the lengths drawn).

_llama_modules(torch) returns the model's class: fsdp_train and fabric_train (distributed.py)
and fit_bench.py build it too.
"""

import math
import random

from . import shared  # shared.finish_training_step, looked up at each call (host_time.py)


LLAMA = dict(vocab=32000, dim=1024, layers=24, heads=16, ffn=2816, max_seq=2048)
LLAMA_BATCH = 8
LLAMA_SEQ = (512, 2048, 64)  # lengths drawn from range(512, 2048 + 1, 64)


def llama_lengths(count, seed=0):
    """The sequence length of each step: the same list for every allocator."""
    rng = random.Random(seed)
    lo, hi, step = LLAMA_SEQ
    return [rng.randrange(lo, hi + 1, step) for _ in range(count)]


def llama_warm_and_timed(timed_steps, seed=0):
    """train_bench's Llama schedule: each distinct length of llama_lengths(timed_steps) once (in
    order of first appearance: the warm-up), then the timed steps. Returns (warm, timed)."""
    timed = llama_lengths(timed_steps, seed)
    return list(dict.fromkeys(timed)), timed


def llama_rounds_step(torch, steps):
    """llama_step over train_bench's schedule for 60 timed steps (24 lengths, 84 steps in all):
    the live run whose reserved memory climbs where lengths take turns, as a trace."""
    warm, timed = llama_warm_and_timed(60)
    lengths = (warm + timed)[:steps]
    return llama_step(torch, len(lengths), lengths=lengths)


def _llama_modules(torch):
    nn = torch.nn
    F = torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return xf.type_as(x) * self.weight

    def rotate(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)

    class Attention(nn.Module):
        def __init__(self, dim, heads):
            super().__init__()
            self.heads, self.head_dim = heads, dim // heads
            self.wq = nn.Linear(dim, dim, bias=False)
            self.wk = nn.Linear(dim, dim, bias=False)
            self.wv = nn.Linear(dim, dim, bias=False)
            self.wo = nn.Linear(dim, dim, bias=False)

        def forward(self, x, cos, sin):
            b, t, c = x.shape
            q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            k = self.wk(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            v = self.wv(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(y.transpose(1, 2).reshape(b, t, c))

    class MLP(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.w1 = nn.Linear(dim, hidden, bias=False)
            self.w3 = nn.Linear(dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self, dim, heads, hidden):
            super().__init__()
            self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, heads)
            self.mlp_norm, self.mlp = RMSNorm(dim), MLP(dim, hidden)

        def forward(self, x, cos, sin):
            h = x + self.attn(self.attn_norm(x), cos, sin)
            return h + self.mlp(self.mlp_norm(h))

    class Llama(nn.Module):
        def __init__(self, vocab, dim, layers, heads, ffn, max_seq, checkpoint=True):
            super().__init__()
            self.checkpoint = checkpoint
            self.embed = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
            self.norm = RMSNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)
            head_dim = dim // heads
            inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
            angles = torch.outer(torch.arange(max_seq).float(), inv_freq)
            angles = torch.cat((angles, angles), dim=-1)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                    nn.init.normal_(p, mean=0.0, std=std)

        def forward(self, ids, targets):
            t = ids.shape[1]
            cos, sin = self.cos[:t], self.sin[:t]
            x = self.embed(ids)
            for layer in self.layers:
                if self.checkpoint and self.training:
                    x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
                else:
                    x = layer(x, cos, sin)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    return Llama


def llama_parameters():
    c = LLAMA
    per_layer = 4 * c["dim"] ** 2 + 3 * c["dim"] * c["ffn"] + 2 * c["dim"]
    return 2 * c["vocab"] * c["dim"] + c["layers"] * per_layer + c["dim"]


def llama_step(torch, steps, seed=0, batch=LLAMA_BATCH, lengths=None):
    """Training steps of the Llama-style model; step i uses `lengths[i]`, by default
    llama_lengths(steps, seed)[i]."""
    import torch.utils.checkpoint  # noqa: F401 (torch.utils.checkpoint.checkpoint)

    torch.manual_seed(seed)
    lengths = list(lengths) if lengths is not None else llama_lengths(steps, seed)
    with torch.device("cuda"):
        model = _llama_modules(torch)(**LLAMA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    data = torch.Generator(device="cuda")
    data.manual_seed(seed + 1)

    def step(i):
        t = lengths[i]
        tokens = torch.randint(0, LLAMA["vocab"], (batch, t + 1), device="cuda", generator=data)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["seq %d" % t for t in lengths]
    return step
