"""Workloads shared by capture_traces.py (allocation traces) and train_bench.py (step times).

Each factory takes the imported torch module and the number of steps, builds its model on the GPU
(seeded, random init, nothing downloaded) and returns `step(i)`, which runs step i and returns a
float (the loss, or the number of tokens generated); `step.shapes[i]` says what step i works on.
What a step does depends on i (a sequence length, image sizes), the same for every allocator.
The step closure holds the model and optimizer: dropping it frees them.

- llama: a Llama-style decoder in plain torch (RMSNorm, SwiGLU MLP, rotary positions, causal
  attention through F.scaled_dot_product_attention), 374M parameters, each layer under
  torch.utils.checkpoint (use_reentrant=False), batch 8 with a sequence length drawn per step
  from 512..2048 (multiples of 64), bf16 autocast, AdamW.
- fasterrcnn: torchvision fasterrcnn_resnet50_fpn (weights=None, weights_backbone=None) training,
  4 random images a step whose sides are drawn from 400..1000 each (the model's transform resizes
  them to a shorter side of 800, so the batch's padded shape changes every step), 1..5 random
  boxes per image, SGD.
- gpt2_generate: transformers GPT-2 124M (random init) generate() with its KV cache, greedy, under
  torch.no_grad: a round of prompts of varying lengths (left padded) per step, batch and new tokens
  varying between rounds.
- gpt2_train_eval, resnet50_train_eval: training with an evaluation every few steps, the loop most
  programs run: three training steps, then an evaluation step (two batches of another shape under
  torch.no_grad in eval mode), and again; the two phases take turns over the same model.
  GPT-2 124M trains on batch 4 x 512 tokens (bf16 autocast, AdamW) and evaluates on 8 x 384;
  ResNet-50 trains on 32 images of 224 px (SGD) and evaluates on 64.
"""

import math
import random

LLAMA = dict(vocab=32000, dim=1024, layers=24, heads=16, ffn=2816, max_seq=2048)
LLAMA_BATCH = 8
LLAMA_SEQ = (512, 2048, 64)  # lengths drawn from range(512, 2048 + 1, 64)


def finish_training_step(optimizer, loss):
    """The end of every training step here: backward, the optimizer's step, the gradients set
    to None; returns the loss as a float (a host sync, as a training loop's logging makes)."""
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


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
        return finish_training_step(optimizer, loss)

    step.shapes = ["seq %d" % t for t in lengths]
    return step


def fasterrcnn_step(torch, steps, seed=0, batch=4):
    """Faster R-CNN training steps on random images of random sizes with random boxes."""
    import torchvision

    torch.manual_seed(seed)
    rng = random.Random(seed)
    plan = []  # per step: [(h, w, boxes, labels)] with boxes as [x1, y1, x2, y2] lists
    for _ in range(steps):
        images = []
        for _ in range(batch):
            h, w = rng.randrange(400, 1001), rng.randrange(400, 1001)
            boxes = []
            for _ in range(rng.randint(1, 5)):
                bw, bh = rng.randrange(16, w // 2), rng.randrange(16, h // 2)
                x1, y1 = rng.randrange(0, w - bw), rng.randrange(0, h - bh)
                boxes.append([x1, y1, x1 + bw, y1 + bh])
            images.append((h, w, boxes, [rng.randint(1, 90) for _ in boxes]))
        plan.append(images)
    model = torchvision.models.detection.fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None)
    model.cuda().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9, weight_decay=1e-4)

    def step(i):
        images = [torch.rand(3, h, w, device="cuda") for h, w, _, _ in plan[i]]
        targets = [dict(boxes=torch.tensor(b, dtype=torch.float32, device="cuda"),
                        labels=torch.tensor(l, dtype=torch.int64, device="cuda"))
                   for _, _, b, l in plan[i]]
        losses = model(images, targets)
        loss = sum(losses.values())
        return finish_training_step(optimizer, loss)

    step.shapes = [" ".join("%dx%d" % (h, w) for h, w, _, _ in images) for images in plan]
    return step


# One generate() call a step: (batch, shortest prompt, longest prompt, new tokens). Each new token
# costs about 390 allocations (1,160 trace events, 7.4 KB of gzipped trace): two rounds keep the
# trace under 1.5 MB.
GPT2_ROUNDS = [(24, 64, 256, 128), (8, 256, 768, 48)]


def gpt2_generate_step(torch, steps, seed=0):
    """GPT-2 generate() rounds; step i is GPT2_ROUNDS[i % len(GPT2_ROUNDS)] with fresh prompts."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = GPT2Config()
    model = GPT2LMHeadModel(config).cuda().eval()
    pad = config.eos_token_id
    plan = []
    for i in range(steps):
        batch, lo, hi, new = GPT2_ROUNDS[i % len(GPT2_ROUNDS)]
        plan.append(([rng.randint(lo, hi) for _ in range(batch)], new))

    def step(i):
        lengths, new = plan[i]
        longest = max(lengths)
        ids = torch.full((len(lengths), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(lengths), longest), dtype=torch.long)
        for row, n in enumerate(lengths):  # left padding, as generate() wants for a decoder
            ids[row, longest - n:] = torch.randint(0, config.vocab_size - 1, (n,))
            mask[row, longest - n:] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=pad)
        return float(out.shape[1] - longest)

    step.shapes = ["batch %d prompts %d..%d +%d" % (len(l), min(l), max(l), n) for l, n in plan]
    return step


# Training with an evaluation every TRAIN_EVAL_PERIOD steps: step i evaluates when
# i % TRAIN_EVAL_PERIOD == TRAIN_EVAL_PERIOD - 1, and trains otherwise.
TRAIN_EVAL_PERIOD = 4


def _train_eval(torch, model, optimizer, steps, train_batch, eval_batch, loss_of):
    """step(i) for a loop that trains and evaluates in turn; `train_batch(i)` and `eval_batch(i)`
    make an input on the GPU, `loss_of(batch)` runs the model on it."""

    def step(i):
        if i % TRAIN_EVAL_PERIOD == TRAIN_EVAL_PERIOD - 1:
            model.eval()
            total = 0.0
            with torch.no_grad():
                for k in range(2):
                    total += loss_of(eval_batch(2 * i + k)).item()
            model.train()
            return total / 2
        loss = loss_of(train_batch(i))
        return finish_training_step(optimizer, loss)

    step.shapes = ["eval" if i % TRAIN_EVAL_PERIOD == TRAIN_EVAL_PERIOD - 1 else "train"
                   for i in range(steps)]
    return step


def gpt2_train_eval_step(torch, steps, seed=0):
    """GPT-2 124M (transformers, random init): train on 4 x 512 tokens, evaluate on 8 x 384."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config()
    model = GPT2LMHeadModel(config).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.Generator(device="cuda")
    data.manual_seed(seed + 1)

    def tokens(batch, length):
        return torch.randint(0, config.vocab_size, (batch, length), device="cuda", generator=data)

    def loss_of(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(input_ids=ids, labels=ids).loss

    return _train_eval(torch, model, optimizer, steps, lambda i: tokens(4, 512),
                       lambda i: tokens(8, 384), loss_of)


def resnet50_train_eval_step(torch, steps, seed=0):
    """torchvision ResNet-50 (random init): train on 32 images of 224 px, evaluate on 64."""
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.resnet50().cuda().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def images(batch):
        return (torch.randn(batch, 3, 224, 224, device="cuda"),
                torch.randint(0, 1000, (batch,), device="cuda"))

    def loss_of(batch):
        x, labels = batch
        return torch.nn.functional.cross_entropy(model(x), labels)

    return _train_eval(torch, model, optimizer, steps, lambda i: images(32),
                       lambda i: images(64), loss_of)


# --- held-out workloads --------------------------------------------------------------------------
# Programs whose traces gmem's policy was never tuned on: captured to check that what holds on the
# traces in tests/data holds elsewhere (bench/torch/heldout.sh; docs/notes/2026-11-24-held-out-traces.md).


def vit_step(torch, steps, seed=0, batch=64):
    """torchvision ViT-B/16 (random init) training on 224 px images, bf16 autocast, AdamW: one
    shape every step."""
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.vit_b_16().cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        x = torch.randn(batch, 3, 224, 224, device="cuda")
        labels = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), labels)
        return finish_training_step(optimizer, loss)

    step.shapes = ["batch %d" % batch] * steps
    return step


def bert_lengths(count, seed=0):
    """bert_varlen's padded length of each step: the same list for every allocator."""
    rng = random.Random(seed)
    return [rng.randrange(64, 513, 32) for _ in range(count)]


def bert_varlen_step(torch, steps, seed=0, batch=16, lengths=None):
    """transformers BERT-base masked LM (random init) with dynamic padding: step i's batch is
    padded to `lengths[i]`, by default bert_lengths(steps, seed)[i] (64..512, multiples of 32),
    bf16 autocast, AdamW."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig()
    model = BertForMaskedLM(config).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths = list(lengths) if lengths is not None else bert_lengths(steps, seed)

    def step(i):
        ids = torch.randint(0, config.vocab_size, (batch, lengths[i]), device="cuda")
        labels = torch.where(torch.rand(ids.shape, device="cuda") < 0.15, ids, -100)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        return finish_training_step(optimizer, loss)

    step.shapes = ["seq %d" % t for t in lengths]
    return step


def t5_varlen_step(torch, steps, seed=0, batch=16):
    """transformers T5 (t5-small's shape, random init) encoder-decoder training: source length
    drawn from 128..512 and target from 32..128 each step, bf16 autocast, AdamW."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = T5Config(decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(config).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plan = [(rng.randrange(128, 513, 64), rng.randrange(32, 129, 32)) for _ in range(steps)]

    def step(i):
        source, target = plan[i]
        ids = torch.randint(0, config.vocab_size, (batch, source), device="cuda")
        labels = torch.randint(0, config.vocab_size, (batch, target), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        return finish_training_step(optimizer, loss)

    step.shapes = ["source %d target %d" % p for p in plan]
    return step


def gpt2_accum_step(torch, steps, seed=0, micro=4, accumulate=4):
    """GPT-2 124M (random init) with gradient accumulation: each step runs `accumulate`
    micro-batches of micro x 1024 tokens forward and backward, then one AdamW step."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config()
    model = GPT2LMHeadModel(config).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        total = 0.0
        for _ in range(accumulate):
            ids = torch.randint(0, config.vocab_size, (micro, 1024), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / accumulate
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    step.shapes = ["%d x %d x 1024" % (accumulate, micro)] * steps
    return step


def _encode_requests(torch, model, vocab_size, plan):
    """A step per entry of `plan`: each (batch, length) request through the encoder `model`
    under torch.inference_mode, with a host sync after each (as a server replies)."""

    def step(i):
        total = 0.0
        with torch.inference_mode():
            for batch, length in plan[i]:
                ids = torch.randint(0, vocab_size, (batch, length), device="cuda")
                total += model(input_ids=ids).last_hidden_state[:, 0].float().sum().item()
        return total

    step.shapes = [" ".join("%dx%d" % r for r in requests) for requests in plan]
    return step


def _generate_requests(torch, model, vocab_size, plan):
    """A step per entry of `plan`: each (prompt lengths, new tokens) request run through
    model.generate() under torch.inference_mode, prompts left padded to the longest."""

    def step(i):
        tokens = 0
        with torch.inference_mode():
            for lengths, new in plan[i]:
                longest = max(lengths)
                ids = torch.zeros((len(lengths), longest), dtype=torch.long)
                mask = torch.zeros((len(lengths), longest), dtype=torch.long)
                for row, n in enumerate(lengths):
                    ids[row, longest - n:] = torch.randint(3, vocab_size, (n,))
                    mask[row, longest - n:] = 1
                out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(),
                                     max_new_tokens=new, min_new_tokens=new, do_sample=False)
                tokens += out.shape[1] - longest
        return float(tokens)

    step.shapes = [" ".join("%dx%d+%d" % (len(l), max(l), n) for l, n in requests)
                   for requests in plan]
    return step


def bert_serve_step(torch, steps, seed=0):
    """BERT-base (random init) inference as a server sees it: under torch.inference_mode, each
    step runs 8 requests whose batch (1..64) and padded length (16..512) are drawn at random."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = BertConfig()
    model = BertModel(config).cuda().eval().to(torch.bfloat16)
    plan = [[(rng.randint(1, 64), rng.randrange(16, 513, 16)) for _ in range(8)]
            for _ in range(steps)]

    return _encode_requests(torch, model, config.vocab_size, plan)


# --- held-out, second batch (2026-11-24): programs of kinds not captured before ----------------


def llama_generate_step(torch, steps, seed=0):
    """transformers Llama (random init: 8 layers, 1024 wide, 16 heads, grouped-query attention
    with 4 KV heads, bf16) generate() with its KV cache as a server sees it: each step serves 2
    requests whose batch (1..16), prompt length (32..1024, left padded) and new tokens (8..96) are
    drawn at random, under torch.inference_mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                         max_position_embeddings=2048, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    model = LlamaForCausalLM(config).cuda().eval().to(torch.bfloat16)
    plan = [[([rng.randint(32, 1024) for _ in range(rng.randint(1, 16))], rng.randint(8, 96))
             for _ in range(2)] for _ in range(steps)]

    return _generate_requests(torch, model, config.vocab_size, plan)


def _unet(torch, channels=(128, 256, 256, 512), attention_at=(2, 3), groups=32):
    """A DDPM-style noise-prediction UNet in plain torch: two residual blocks per level (GroupNorm,
    SiLU, 3x3 convolutions, the timestep's embedding added), self-attention at the lower levels,
    strided convolutions down, nearest upsampling and skip connections up."""
    nn, F = torch.nn, torch.nn.functional

    class Res(nn.Module):
        def __init__(self, cin, cout, tdim):
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(groups, cin), nn.Conv2d(cin, cout, 3, padding=1)
            self.t = nn.Linear(tdim, cout)
            self.n2, self.c2 = nn.GroupNorm(groups, cout), nn.Conv2d(cout, cout, 3, padding=1)
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x, t):
            h = self.c1(F.silu(self.n1(x))) + self.t(t)[:, :, None, None]
            return self.skip(x) + self.c2(F.silu(self.n2(h)))

    class Attention(nn.Module):
        def __init__(self, c, heads=8):
            super().__init__()
            self.norm, self.qkv, self.out, self.heads = nn.GroupNorm(groups, c), nn.Linear(c, 3 * c), nn.Linear(c, c), heads

        def forward(self, x):
            b, c, hh, ww = x.shape
            h = self.norm(x).flatten(2).transpose(1, 2)
            q, k, v = self.qkv(h).view(b, hh * ww, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, hh * ww, c)
            return x + self.out(h).transpose(1, 2).reshape(b, c, hh, ww)

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            tdim = channels[0] * 4
            self.temb = nn.Sequential(nn.Linear(channels[0], tdim), nn.SiLU(), nn.Linear(tdim, tdim))
            self.inp = nn.Conv2d(3, channels[0], 3, padding=1)
            self.down, self.up = nn.ModuleList(), nn.ModuleList()
            skips, c = [channels[0]], channels[0]
            for level, cout in enumerate(channels):
                for _ in range(2):
                    self.down.append(nn.ModuleList([Res(c, cout, tdim),
                                                    Attention(cout) if level in attention_at else nn.Identity()]))
                    c = cout
                    skips.append(c)
                if level < len(channels) - 1:
                    self.down.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
                    skips.append(c)
            self.mid = nn.ModuleList([Res(c, c, tdim), Attention(c), Res(c, c, tdim)])
            for level, cout in reversed(list(enumerate(channels))):
                for _ in range(3):
                    self.up.append(nn.ModuleList([Res(c + skips.pop(), cout, tdim),
                                                  Attention(cout) if level in attention_at else nn.Identity()]))
                    c = cout
                if level > 0:
                    self.up.append(nn.Upsample(scale_factor=2, mode="nearest"))
            self.out = nn.Sequential(nn.GroupNorm(groups, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

        def forward(self, x, t):
            half = channels[0] // 2
            freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=x.device) / half)
            t = self.temb(torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], 1))
            h = self.inp(x)
            hs = [h]
            for m in self.down:
                h = m(h) if isinstance(m, nn.Conv2d) else m[1](m[0](h, t))
                hs.append(h)
            h = self.mid[2](self.mid[1](self.mid[0](h, t)), t)
            for m in self.up:
                h = m(h) if isinstance(m, nn.Upsample) else m[1](m[0](torch.cat([h, hs.pop()], 1), t))
            return self.out(h)

    return UNet()


def unet_step(torch, steps, seed=0, batch=48, size=64):
    """DDPM training of _unet() on random 64 px images: a random timestep per
    image, noise added by a cosine schedule, MSE on the noise; bf16 autocast, AdamW. One shape."""
    torch.manual_seed(seed)
    model = _unet(torch).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        x = torch.randn(batch, 3, size, size, device="cuda")
        t = torch.randint(0, 1000, (batch,), device="cuda").float()
        noise = torch.randn_like(x)
        a = torch.cos(t / 1000 * math.pi / 2)[:, None, None, None]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(a * x + (1 - a * a).sqrt() * noise, t), noise)
        return finish_training_step(optimizer, loss)

    step.shapes = ["batch %d x %d px" % (batch, size)] * steps
    return step


CONVNEXT_SIZES = (160, 192, 224, 256, 288)


def convnext_multiscale_step(torch, steps, seed=0, batch=64):
    """torchvision ConvNeXt-T (random init) multi-scale training: channels_last, fp16 autocast
    with a GradScaler, SGD with momentum; each step's image size is drawn from CONVNEXT_SIZES."""
    import torchvision

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = torchvision.models.convnext_tiny().cuda().train().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    sizes = [rng.choice(CONVNEXT_SIZES) for _ in range(steps)]

    def step(i):
        x = torch.randn(batch, 3, sizes[i], sizes[i], device="cuda").to(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step.shapes = ["%d px" % s for s in sizes]
    return step


def moe_step(torch, steps, seed=0, batch=8, length=1024, dim=768, layers=6, experts=8, ffn=2048):
    """A mixture-of-experts decoder in plain torch (6 layers, 768 wide, 8 SwiGLU experts a
    layer, top-2 routing, causal attention through SDPA), bf16 autocast, AdamW, batch 8 x 1024
    random tokens: each expert's tokens are gathered, run and scattered back, so the sizes of
    its blocks follow the router and change in every layer of every step."""
    nn, F = torch.nn, torch.nn.functional
    torch.manual_seed(seed)

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up, self.down = nn.Linear(dim, 2 * ffn, bias=False), nn.Linear(ffn, dim, bias=False)

        def forward(self, x):
            g, u = self.gate_up(x).chunk(2, -1)
            return self.down(F.silu(g) * u)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
            self.router = nn.Linear(dim, experts, bias=False)
            self.experts = nn.ModuleList(Expert() for _ in range(experts))

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, n, 3, 12, dim // 12).permute(2, 0, 3, 1, 4)
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, dim))
            h = self.n2(x).view(-1, dim)
            weights, chosen = torch.topk(self.router(h).softmax(-1), 2, dim=-1)
            out = torch.zeros_like(h)
            for e, expert in enumerate(self.experts):
                rows, slot = torch.nonzero(chosen == e, as_tuple=True)
                if rows.numel():
                    out.index_add_(0, rows, expert(h[rows]) * weights[rows, slot, None])
            return x + out.view(b, n, dim)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.blocks = nn.Embedding(32000, dim), nn.ModuleList(Block() for _ in range(layers))
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 32000, bias=False)

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    model = Model().cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        ids = torch.randint(0, 32000, (batch, length + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, 32000), ids[:, 1:].reshape(-1))
        return finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, length)] * steps
    return step


def gpt2_compiled_step(torch, steps, seed=0, batch=8, length=512):
    """transformers GPT-2 124M (random init) under torch.compile (default mode) training on
    8 x 512 random tokens, bf16 autocast, AdamW: Inductor's buffers instead of eager's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config()
    model = GPT2LMHeadModel(config).cuda().train()
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return _causal_lm_steps(torch, compiled, config.vocab_size, optimizer, batch, [length] * steps)


# --- held-out, third batch (2026-11-24): serving at the sizes served on one H100 ---------------
# bert_serve and llama_generate hold 1.04x their peak under gmem, programs under 1 GiB where a
# page more or less is 0.25%. These two serve the same kinds of requests from models of GiBs,
# loaded in bf16 as from_pretrained(torch_dtype=torch.bfloat16) loads them (no fp32 copy first).


def _bf16_on_gpu(torch, build):
    """Builds a module with bf16 parameters on the GPU directly (as a checkpoint is loaded)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return build().eval()
    finally:
        torch.set_default_dtype(dtype)


def llama_serve_1b_step(torch, steps, seed=0):
    """transformers Llama of TinyLlama's shape (1.1B: 22 layers, 2048 wide, 32 heads, 4 KV heads,
    bf16) generate() as a server sees it: each step serves 2 requests whose batch (1..16), prompt
    length (32..2048, left padded) and new tokens (8..64) are drawn at random, under
    torch.inference_mode; the KV cache grows token by token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                         max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    model = _bf16_on_gpu(torch, lambda: LlamaForCausalLM(config))
    plan = [[([rng.randint(32, 2048) for _ in range(rng.randint(1, 16))], rng.randint(8, 64))
             for _ in range(2)] for _ in range(steps)]

    return _generate_requests(torch, model, config.vocab_size, plan)


def bert_large_serve_step(torch, steps, seed=0):
    """BERT-large (random init, bf16) inference as a server sees it: under torch.inference_mode,
    each step runs 8 requests whose batch (1..128) and padded length (16..512) are drawn at
    random."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096)
    model = _bf16_on_gpu(torch, lambda: BertModel(config))
    plan = [[(rng.randint(1, 128), rng.randrange(16, 513, 16)) for _ in range(8)]
            for _ in range(steps)]

    return _encode_requests(torch, model, config.vocab_size, plan)


# --- held-out, fourth batch (2026-11-24): the fine-tuning and compiled programs of today -------
# Programs of kinds the first three batches lack: parameter-efficient fine-tuning of a frozen
# model (most fine-tuning today), Inductor with dynamic shapes, and diffusion sampling at the
# resolutions a user asks for.


def _causal_lm_steps(torch, model, vocab_size, optimizer, batch, lengths):
    """Training steps of a transformers causal LM (`model`, compiled or not) on random tokens:
    step i is batch x lengths[i] under bf16 autocast, the labels the inputs (the model shifts
    them), then finish_training_step."""

    def step(i):
        ids = torch.randint(0, vocab_size, (batch, lengths[i]), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        return finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, t) for t in lengths]
    return step


def _lora(torch, base, rank=16, alpha=32):
    """`base` (an nn.Linear, frozen) plus a trainable low-rank update B @ A scaled by alpha/rank,
    B starting at zero, as LoRA adapters are (fp32 adapter weights on a bf16 base)."""
    nn = torch.nn

    class LoRALinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = base
            self.a = nn.Parameter(torch.randn(rank, base.in_features, device="cuda") / rank)
            self.b = nn.Parameter(torch.zeros(base.out_features, rank, device="cuda"))
            self.scale = alpha / rank

        def forward(self, x):
            return self.base(x) + (x @ self.a.t().to(x.dtype)) @ self.b.t().to(x.dtype) * self.scale

    return LoRALinear()


def lora_llama_step(torch, steps, seed=0, batch=4):
    """LoRA fine-tuning of a transformers Llama of 1.5B parameters (TinyLlama's 22 layers of
    2048 with Llama 3's vocabulary of 128,256; random init, bf16, frozen), rank-16 adapters on
    every attention and MLP projection, gradient checkpointing (use_reentrant=False), AdamW over
    the adapters, batch 4 with a sequence length drawn per step from 256..2048 (multiples of
    128): the logits and their fp32 loss are blocks of GiBs whose size follows the length."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                         max_position_embeddings=4096)
    model = _bf16_on_gpu(torch, lambda: LlamaForCausalLM(config))
    model.requires_grad_(False)
    for layer in model.model.layers:
        for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                             (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                setattr(owner, name, _lora(torch, getattr(owner, name)))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    adapters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapters, lr=1e-4)
    lengths = [rng.randrange(256, 2049, 128) for _ in range(steps)]
    return _causal_lm_steps(torch, model, config.vocab_size, optimizer, batch, lengths)


def gpt2_dynamic_step(torch, steps, seed=0, batch=8):
    """transformers GPT-2 124M (random init) under torch.compile(dynamic=True) training on a
    sequence length drawn per step from 128..1024 (multiples of 64), bf16 autocast, AdamW: one
    graph with symbolic shapes, Inductor's buffers sized at run time."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = GPT2Config()
    model = GPT2LMHeadModel(config).cuda().train()
    compiled = torch.compile(model, dynamic=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths = [rng.randrange(128, 1025, 64) for _ in range(steps)]
    return _causal_lm_steps(torch, compiled, config.vocab_size, optimizer, batch, lengths)


def diffusion_sample_step(torch, steps, seed=0, iterations=12):
    """Sampling from _unet() (random init, bf16) as a server of image requests runs it: each
    step is a request of 1..8 images at a resolution drawn from 32..128 px (multiples of 16),
    with classifier-free guidance (the batch doubled), `iterations` denoising steps of a DDIM-like
    update, under torch.inference_mode and bf16 autocast."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = _bf16_on_gpu(torch, lambda: _unet(torch))
    requests = [(rng.randint(1, 8), rng.randrange(32, 129, 16)) for _ in range(steps)]

    def step(i):
        images, size = requests[i]
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            x = torch.randn(images, 3, size, size, device="cuda", dtype=torch.bfloat16)
            for k in range(iterations, 0, -1):
                t = torch.full((2 * images,), k * 1000.0 / iterations, device="cuda")
                both = model(torch.cat([x, x]), t)
                uncond, cond = both.chunk(2)
                eps = uncond + 7.5 * (cond - uncond)
                a = math.cos(k / iterations * math.pi / 2)
                x = (x - math.sqrt(max(1 - a * a, 0.0)) * eps * 0.1).clamp(-3, 3)
            return x.float().mean().item()

    step.shapes = ["%d x %d px" % r for r in requests]
    return step


# --- held-out, fifth batch (2026-11-25): shapes new every step, two optimizers, CUDA graphs ----
# Kinds the first four batches lack: training whose block sizes are drawn anew every step (graph
# networks on sampled subgraphs, recommendation models' sparse gradients), a loop with two
# optimizers (two optimizer steps per iteration), cuDNN's LSTM on packed sequences, and training
# replayed as CUDA graphs from a private pool (torch.compile's reduce-overhead).


def gnn_random_step(torch, steps, seed=0, features=256, hidden=512, layers=3, classes=40):
    """A graph network of three GCN-style layers (Linear, then messages gathered along the edges
    and summed into their targets with index_add_, divided by the in-degree, ReLU) trained with
    AdamW under bf16 autocast on a random graph a step: 20k..200k nodes of 256 features, 4..16
    edges a node. No two steps share a shape, as when training on sampled subgraphs."""
    nn = torch.nn
    torch.manual_seed(seed)
    rng = random.Random(seed)

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            dims = [features] + [hidden] * (layers - 1) + [classes]
            self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

        def forward(self, x, src, dst, norm):
            for k, lin in enumerate(self.lins):
                x = lin(x)
                x = torch.zeros_like(x).index_add_(0, dst, x[src]) * norm[:, None]
                if k < len(self.lins) - 1:
                    x = torch.relu(x)
            return x

    model = GCN().cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graphs = [(rng.randint(20000, 200000), rng.randint(4, 16)) for _ in range(steps)]

    def step(i):
        nodes, degree = graphs[i]
        x = torch.randn(nodes, features, device="cuda")
        src = torch.randint(0, nodes, (nodes * degree,), device="cuda")
        dst = torch.randint(0, nodes, (nodes * degree,), device="cuda")
        norm = torch.bincount(dst, minlength=nodes).clamp(min=1).float().reciprocal()
        labels = torch.randint(0, classes, (nodes,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, src, dst, norm)
        loss = torch.nn.functional.cross_entropy(out.float(), labels)
        return finish_training_step(optimizer, loss)

    step.shapes = ["%d nodes x %d edges" % (n, n * d) for n, d in graphs]
    return step


def dlrm_sparse_step(torch, steps, seed=0, batch=16384, tables=8, rows=1000000, dim=64):
    """A recommendation model of DLRM's form: 8 tables of 1M x 64 (fp32, 2 GiB in all) read
    by EmbeddingBag(mode="sum", sparse=True) over bags of 1..60 random ids a sample, a bottom
    MLP over 13 dense features, the pairwise dot products of the 9 vectors, a top MLP; batch
    16,384. Two optimizers, as DLRM trains: SGD on the tables' sparse gradients (sized by the
    ids drawn, so different every step) and AdamW on the MLPs."""
    nn = torch.nn
    torch.manual_seed(seed)

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
                                        for _ in range(tables))
            self.bottom = nn.Sequential(nn.Linear(13, 512), nn.ReLU(), nn.Linear(512, 256),
                                        nn.ReLU(), nn.Linear(256, dim), nn.ReLU())
            pairs = (tables + 1) * tables // 2
            self.top = nn.Sequential(nn.Linear(dim + pairs, 1024), nn.ReLU(),
                                     nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))

        def forward(self, dense, bags):
            x = self.bottom(dense)
            z = torch.stack([x] + [t(ids, offsets) for t, (ids, offsets) in zip(self.tables, bags)],
                            dim=1)
            dots = torch.bmm(z, z.transpose(1, 2))
            li, lj = torch.tril_indices(tables + 1, tables + 1, offset=-1, device=z.device)
            return self.top(torch.cat([x, dots[:, li, lj]], dim=1)).squeeze(1)

    with torch.device("cuda"):
        model = DLRM().train()
    sparse = torch.optim.SGD(model.tables.parameters(), lr=0.01)
    dense = torch.optim.AdamW(list(model.bottom.parameters()) + list(model.top.parameters()),
                              lr=1e-3)

    def step(i):
        bags = []
        for _ in range(tables):
            lengths = torch.randint(1, 61, (batch,), device="cuda")
            offsets = torch.cumsum(lengths, 0) - lengths
            bags.append((torch.randint(0, rows, (int(lengths.sum()),), device="cuda"), offsets))
        dense_x = torch.randn(batch, 13, device="cuda")
        labels = torch.randint(0, 2, (batch,), device="cuda").float()
        loss = nn.functional.binary_cross_entropy_with_logits(model(dense_x, bags), labels)
        loss.backward()
        sparse.step()
        dense.step()
        sparse.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
        return loss.item()

    step.shapes = ["batch %d, bags of 1..60" % batch] * steps
    return step


def lstm_varlen_step(torch, steps, seed=0, batch=64, vocab=32000, dim=1024, layers=2):
    """An LSTM language model (embedding, cuDNN LSTM of 2 layers of 1024, output over 32,000
    tokens; fp32) trained with AdamW on packed batches (pack_padded_sequence) of 64 sequences,
    each of a length drawn from 16..512: the packed total and the longest differ every step."""
    nn = torch.nn
    torch.manual_seed(seed)
    rng = random.Random(seed)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.lstm = nn.LSTM(dim, dim, layers, batch_first=True)
            self.out = nn.Linear(dim, vocab)

        def forward(self, ids, lengths):
            packed = nn.utils.rnn.pack_padded_sequence(self.embed(ids), lengths, batch_first=True,
                                                       enforce_sorted=False)
            hidden, _ = self.lstm(packed)
            return self.out(hidden.data)

    model = LM().cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = [[rng.randint(16, 512) for _ in range(batch)] for _ in range(steps)]

    def step(i):
        lengths = plan[i]
        ids = torch.randint(0, vocab, (batch, max(lengths)), device="cuda")
        logits = model(ids, lengths)
        labels = torch.randint(0, vocab, (logits.shape[0],), device="cuda")
        return finish_training_step(optimizer, nn.functional.cross_entropy(logits, labels))

    step.shapes = ["%d sequences, %d tokens, longest %d" % (batch, sum(p), max(p)) for p in plan]
    return step


def gpt2_cudagraphs_step(torch, steps, seed=0, batch=8, length=512):
    """transformers GPT-2 124M (random init) training under torch.compile(mode="reduce-overhead"):
    forward and backward replayed as CUDA graphs out of cudagraph trees' private pool, bf16
    autocast, AdamW, 8 x 512 random tokens, cudagraph_mark_step_begin() before each step as the
    docs ask of a training loop."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config()
    model = GPT2LMHeadModel(config).cuda().train()
    loss_of = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss,
                            mode="reduce-overhead")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        torch.compiler.cudagraph_mark_step_begin()
        ids = torch.randint(0, config.vocab_size, (batch, length), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(ids)
        return finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, length)] * steps
    return step


# --- held-out, sixth batch (2026-11-25): what programs do around the model ----------------------
# CUDA graphs captured by hand into one shared pool, a side stream that prefetches the input,
# two models trained in turn, activations offloaded to the host.


def graph_serve_step(torch, steps, seed=0, buckets=(32, 16, 8, 4, 2, 1), length=256, dim=1024,
                     layers=8):
    """Serving through CUDA graphs captured by hand, as inference engines do: a Transformer
    encoder (8 layers, 1024 wide, bf16) captured once per batch bucket (32, 16, ..., 1 x 256
    tokens), largest first, into one pool (torch.cuda.graph_pool_handle()), each warmed up on a
    side stream first as the CUDA-graphs docs ask, all before step 0 as a server does. A step
    serves 8 requests of a random batch (1..32): the input copied into the smallest bucket that
    holds it, its graph replayed, the rows wanted cloned out, under torch.inference_mode."""
    nn = torch.nn
    torch.manual_seed(seed)
    rng = random.Random(seed)
    layer = nn.TransformerEncoderLayer(dim, 16, 4 * dim, batch_first=True, norm_first=True)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    model = model.cuda().eval().to(torch.bfloat16)
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    with torch.inference_mode():
        for bucket in buckets:
            static_in = torch.randn(bucket, length, dim, device="cuda", dtype=torch.bfloat16)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    model(static_in)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                static_out = model(static_in)
            graphs[bucket] = (graph, static_in, static_out)
    plan = [[rng.randint(1, buckets[0]) for _ in range(8)] for _ in range(steps)]

    def step(i):
        total = 0.0
        with torch.inference_mode():
            for batch in plan[i]:
                bucket = min(b for b in buckets if b >= batch)
                graph, static_in, static_out = graphs[bucket]
                request = torch.randn(batch, length, dim, device="cuda", dtype=torch.bfloat16)
                static_in[:batch].copy_(request)
                graph.replay()
                reply = static_out[:batch].float().clone()
                total += float(reply.mean())
        return total

    step.shapes = ["requests of batch " + ",".join(map(str, p)) for p in plan]
    step.model = model  # the graphs read its weights: dropped with this frame, they read freed memory
    return step


def prefetch_train_step(torch, steps, seed=0, batch=128, size=160, pinned=4):
    """ResNet-18 (torchvision, random init) training fed as fast loaders feed it: uint8 batches
    in pinned host memory (a ring of 4), each copied to the GPU with non_blocking=True and
    normalized on a side stream one step ahead, the main stream waiting for it and calling
    record_stream on what it takes over (timm's and apex's prefetchers); bf16 autocast,
    channels_last, SGD with momentum."""
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.resnet18(weights=None).cuda().train()
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    host = [torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8).pin_memory()
            for _ in range(pinned)]
    labels_host = [torch.randint(0, 1000, (batch,)).pin_memory() for _ in range(pinned)]
    mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255
    copier = torch.cuda.Stream()
    ahead = {}

    def prefetch(i):
        with torch.cuda.stream(copier):
            x = host[i % pinned].cuda(non_blocking=True)
            y = labels_host[i % pinned].cuda(non_blocking=True)
            x = x.float().sub_(mean).div_(std).contiguous(memory_format=torch.channels_last)
        ahead[i] = (x, y)

    def step(i):
        if i not in ahead:
            prefetch(i)
        main = torch.cuda.current_stream()
        main.wait_stream(copier)
        x, y = ahead.pop(i)
        x.record_stream(main)
        y.record_stream(main)
        prefetch(i + 1)  # the next batch copies while this one trains
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        return finish_training_step(optimizer, loss)

    step.shapes = ["%d x 3 x %d x %d" % (batch, size, size)] * steps
    return step


def gan_step(torch, steps, seed=0, batch=128, latent=128, size=64):
    """DCGAN at 64 px: a generator and a discriminator trained in turn, each with its own Adam
    (the discriminator's step on real and generated images, then the generator's), so two
    optimizer steps a training step, over different models; fp32, random "real" images."""
    nn = torch.nn
    torch.manual_seed(seed)
    g = nn.Sequential(
        nn.ConvTranspose2d(latent, 512, 4, 1, 0, bias=False), nn.BatchNorm2d(512), nn.ReLU(True),
        nn.ConvTranspose2d(512, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True),
        nn.ConvTranspose2d(256, 128, 4, 2, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(True),
        nn.ConvTranspose2d(128, 64, 4, 2, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(True),
        nn.ConvTranspose2d(64, 3, 4, 2, 1, bias=False), nn.Tanh()).cuda()
    d = nn.Sequential(
        nn.Conv2d(3, 64, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True),
        nn.Conv2d(64, 128, 4, 2, 1, bias=False), nn.BatchNorm2d(128), nn.LeakyReLU(0.2, True),
        nn.Conv2d(128, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.LeakyReLU(0.2, True),
        nn.Conv2d(256, 512, 4, 2, 1, bias=False), nn.BatchNorm2d(512), nn.LeakyReLU(0.2, True),
        nn.Conv2d(512, 1, 4, 1, 0, bias=False), nn.Flatten()).cuda()
    opt_g = torch.optim.Adam(g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    ones = torch.ones(batch, 1, device="cuda")
    zeros = torch.zeros(batch, 1, device="cuda")

    def step(i):
        real = torch.rand(batch, 3, size, size, device="cuda") * 2 - 1
        fake = g(torch.randn(batch, latent, 1, 1, device="cuda"))
        loss_d = bce(d(real), ones) + bce(d(fake.detach()), zeros)
        loss_d.backward()
        opt_d.step()
        opt_d.zero_grad(set_to_none=True)
        loss_g = bce(d(fake), ones)
        loss_g.backward()
        opt_g.step()
        opt_g.zero_grad(set_to_none=True)
        d.zero_grad(set_to_none=True)  # the generator's backward also filled d's gradients
        return loss_d.item() + loss_g.item()

    step.shapes = ["%d x %d px" % (batch, size)] * steps
    return step


def offload_train_step(torch, steps, seed=0, batch=8, length=1024, dim=1024, layers=12):
    """A Transformer encoder (12 layers, 1024 wide, pre-norm) trained with its saved activations
    offloaded to pinned host memory (torch.autograd.graph.save_on_cpu(pin_memory=True)), the
    way programs fit a larger batch in the GPU: each activation is copied out in the forward and
    back in the backward; bf16 autocast, AdamW, 8 x 1024 random tokens."""
    nn = torch.nn
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(dim, 16, 4 * dim, batch_first=True, norm_first=True)
    model = nn.Sequential(nn.Embedding(32000, dim),
                          nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                          nn.Linear(dim, 32000)).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        ids = torch.randint(0, 32000, (batch, length), device="cuda")
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids)
                loss = nn.functional.cross_entropy(logits.view(-1, 32000).float(), ids.view(-1))
        return finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, length)] * steps
    return step


# --- held-out, seventh batch (2026-11-25): training recipes as scripts write them, beam search --


def empty_cache_varlen_step(torch, steps, seed=0, batch=32):
    """BERT-base (transformers, random init) fine-tuned for sequence classification on batches of
    a length drawn per step (64..512, multiples of 8), bf16 autocast, AdamW, with gc.collect()
    and torch.cuda.empty_cache() after every step, as notebooks and fine-tuning scripts do to
    fight the fragmentation that varying lengths cause."""
    import gc
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = BertConfig(num_labels=4)
    model = BertForSequenceClassification(config).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    lengths = [rng.randrange(64, 513, 8) for _ in range(steps)]

    def step(i):
        ids = torch.randint(0, config.vocab_size, (batch, lengths[i]), device="cuda")
        labels = torch.randint(0, 4, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        value = finish_training_step(optimizer, loss)
        gc.collect()
        torch.cuda.empty_cache()
        return value

    step.shapes = ["%d x %d" % (batch, n) for n in lengths]
    return step


def beam_generate_step(torch, steps, seed=0, beams=4):
    """transformers GPT-2 124M (random init, bf16) generate() with beam search (4 beams) as a
    server runs it: each step serves 3 requests whose batch (1..8), prompt length (16..384, left
    padded) and new tokens (16..64) are drawn at random, under torch.inference_mode. Beam search
    reorders the KV cache by beam after every token."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = GPT2Config()
    model = GPT2LMHeadModel(config).cuda().eval().to(torch.bfloat16)
    pad = config.eos_token_id
    plan = [[([rng.randint(16, 384) for _ in range(rng.randint(1, 8))], rng.randint(16, 64))
             for _ in range(3)] for _ in range(steps)]

    def step(i):
        tokens = 0
        with torch.inference_mode():
            for lengths, new in plan[i]:
                longest = max(lengths)
                ids = torch.full((len(lengths), longest), pad, dtype=torch.long)
                mask = torch.zeros((len(lengths), longest), dtype=torch.long)
                for row, n in enumerate(lengths):
                    ids[row, longest - n:] = torch.randint(0, config.vocab_size - 1, (n,))
                    mask[row, longest - n:] = 1
                out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(),
                                     max_new_tokens=new, min_new_tokens=new, num_beams=beams,
                                     do_sample=False, pad_token_id=pad)
                tokens += out.shape[1] - longest
        return float(tokens)

    step.shapes = [" ".join("%dx%d+%d" % (len(l), max(l), n) for l, n in requests)
                   for requests in plan]
    return step


def amp_scaler_step(torch, steps, seed=0, batch=96, size=224):
    """torchvision EfficientNet-B0 (random init) trained as AMP recipes do: fp16 autocast,
    torch.amp.GradScaler, gradients unscaled and clipped (clip_grad_norm_ at 1.0) before the
    scaler's step, fused AdamW, channels_last; one shape every step."""
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.efficientnet_b0().cuda().train()
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")

    def step(i):
        x = torch.randn(batch, 3, size, size, device="cuda")
        x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step.shapes = ["%d x %d px" % (batch, size)] * steps
    return step


def distill_step(torch, steps, seed=0, batch=128, size=192, temperature=4.0):
    """Knowledge distillation: a ResNet-50 teacher (torchvision, random init, eval mode, under
    torch.no_grad) and a ResNet-18 student trained on the teacher's softened outputs (KL
    divergence at temperature 4) plus the labels; bf16 autocast, SGD with momentum; one shape
    every step."""
    import torchvision

    F = torch.nn.functional
    torch.manual_seed(seed)
    teacher = torchvision.models.resnet50().cuda().eval()
    student = torchvision.models.resnet18().cuda().train()
    optimizer = torch.optim.SGD(student.parameters(), lr=0.05, momentum=0.9)

    def step(i):
        x = torch.randn(batch, 3, size, size, device="cuda")
        y = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.no_grad():
                soft = F.softmax(teacher(x).float() / temperature, dim=1)
            logits = student(x).float()
            kl = F.kl_div(F.log_softmax(logits / temperature, dim=1), soft,
                          reduction="batchmean")
            loss = kl * temperature ** 2 + F.cross_entropy(logits, y)
        return finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d px" % (batch, size)] * steps
    return step


# --- held-out, eighth batch (2026-11-25): data parallel on one rank, threads, compiled serving ---
# What the first seven batches lack: the data-parallel wrappers most training runs under (DDP's
# gradient buckets; FSDP2's parameters gathered and freed per layer on streams of its own), a
# server whose requests run in threads each on a stream of its own, and serving compiled with
# CUDA graphs at a few padded shapes. One rank (NCCL over one GPU) runs the wrappers' real code:
# their buckets, streams and copies.


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
        return finish_training_step(optimizer, loss)

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
        return finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, t) for t in lengths]
    return step


def threads_serve_step(torch, steps, seed=0, workers=4, per_worker=2):
    """BERT-base (random init, bf16) served by `workers` threads at once, each on a CUDA stream
    of its own, as a threaded server runs requests: in each step every thread runs `per_worker`
    requests of a batch (1..32) and padded length (16..512) drawn at random, under
    torch.inference_mode, and syncs after each (a reply); the step ends when all are done."""
    import threading

    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = BertConfig()
    model = _bf16_on_gpu(torch, lambda: BertModel(config))
    streams = [torch.cuda.Stream() for _ in range(workers)]
    plan = [[[(rng.randint(1, 32), rng.randrange(16, 513, 16)) for _ in range(per_worker)]
             for _ in range(workers)] for _ in range(steps)]
    device = torch.cuda.current_device()

    def serve(requests, stream, totals, k):
        try:
            torch.cuda.set_device(device)
            total = 0.0
            with torch.cuda.stream(stream), torch.inference_mode():
                for batch, length in requests:
                    ids = torch.randint(0, config.vocab_size, (batch, length), device="cuda")
                    total += model(input_ids=ids).last_hidden_state[:, 0].float().sum().item()
            totals[k] = total
        except BaseException as error:  # re-raised by the step, on the main thread
            totals[k] = error

    def step(i):
        totals = [None] * workers
        threads = [threading.Thread(target=serve, args=(plan[i][k], streams[k], totals, k))
                   for k in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for result in totals:
            if not isinstance(result, float):
                raise RuntimeError("a serving thread failed: %r" % (result,))
        return sum(totals)

    step.shapes = [" | ".join(" ".join("%dx%d" % r for r in w) for w in s) for s in plan]
    return step


def compile_serve_step(torch, steps, seed=0, requests=4, batches=(1, 8), lengths=(128, 512)):
    """transformers GPT-2 124M (random init, bf16) forward served under
    torch.compile(mode="reduce-overhead"): requests padded to a few shapes (batch 1 or 8, length
    128 or 512; each shape compiled and captured as a CUDA graph at its first requests), 4
    requests a step drawn at random, under torch.no_grad; the logits' last row read back."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = GPT2Config()
    model = _bf16_on_gpu(torch, lambda: GPT2LMHeadModel(config))
    forward = torch.compile(lambda ids: model(input_ids=ids).logits[:, -1].float().sum(),
                            mode="reduce-overhead")
    plan = [[(rng.choice(batches), rng.choice(lengths)) for _ in range(requests)]
            for _ in range(steps)]

    def step(i):
        total = 0.0
        with torch.no_grad():
            for batch, length in plan[i]:
                torch.compiler.cudagraph_mark_step_begin()
                ids = torch.randint(0, config.vocab_size, (batch, length), device="cuda")
                total += forward(ids).item()
        return total

    step.shapes = [" ".join("%dx%d" % r for r in requests) for requests in plan]
    return step


def rollout_train_step(torch, steps, seed=0, batch=8):
    """Reinforcement learning from rollouts, as GRPO/PPO-style fine-tuning loops run it:
    transformers GPT-2 124M (random init) samples completions for a batch of prompts (prompt
    lengths 32..128 left padded, 32..160 new tokens, both drawn per step; generate() with its KV
    cache under torch.no_grad in eval mode), then trains on prompt + completion in train mode: the
    completion's log-probabilities weighted by a random advantage per sequence (bf16 autocast,
    AdamW). Generation and training take turns over the same model every step."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = GPT2Config()
    model = GPT2LMHeadModel(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    pad = config.eos_token_id
    plan = [([rng.randint(32, 128) for _ in range(batch)], rng.randint(32, 160))
            for _ in range(steps)]
    F = torch.nn.functional

    def step(i):
        lengths, new = plan[i]
        longest = max(lengths)
        ids = torch.full((batch, longest), pad, dtype=torch.long)
        mask = torch.zeros((batch, longest), dtype=torch.long)
        for row, n in enumerate(lengths):
            ids[row, longest - n:] = torch.randint(0, config.vocab_size - 1, (n,))
            mask[row, longest - n:] = 1
        ids, mask = ids.cuda(), mask.cuda()
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                 min_new_tokens=new, do_sample=True, top_k=50, pad_token_id=pad)
        model.train()
        full_mask = torch.cat([mask, torch.ones_like(out[:, longest:])], dim=1)
        advantage = torch.randn(batch, 1, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=out, attention_mask=full_mask).logits[:, longest - 1:-1]
            logp = torch.gather(F.log_softmax(logits.float(), dim=-1), 2,
                                out[:, longest:, None]).squeeze(2)
            loss = -(logp * advantage).mean()
        return finish_training_step(optimizer, loss)

    step.shapes = ["batch %d prompts %d..%d +%d" % (batch, min(l), max(l), n) for l, n in plan]
    return step


def ema_train_step(torch, steps, seed=0, batch=48, size=64, decay=0.999):
    """Diffusion training as diffusers' scripts run it: the DDPM training of unet_step with a
    fused AdamW (fused=True), gradients clipped with clip_grad_norm_ (foreach), and an EMA copy
    of the weights updated after every optimizer step with torch._foreach_lerp_ over all
    parameters at once (diffusers' EMAModel with foreach); bf16 autocast, one shape."""
    torch.manual_seed(seed)
    model = _unet(torch).cuda().train()
    ema = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def step(i):
        x = torch.randn(batch, 3, size, size, device="cuda")
        t = torch.randint(0, 1000, (batch,), device="cuda").float()
        noise = torch.randn_like(x)
        a = torch.cos(t / 1000 * math.pi / 2)[:, None, None, None]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(a * x + (1 - a * a).sqrt() * noise, t), noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)
        return loss.item()

    step.shapes = ["batch %d x %d px" % (batch, size)] * steps
    return step


def static_generate_step(torch, steps, seed=0, batch=4, prompts=(64, 128), new=64):
    """Generation as transformers' docs make it fast: a Llama-style LlamaForCausalLM (random
    init, bf16, 8 layers of 1024) whose generate() runs on a static KV cache
    (cache_implementation="static") with the model's forward under torch.compile in
    reduce-overhead mode (CUDA graphs): transformers compiles it itself where its version does so
    (GenerationConfig.compile_config), otherwise it is compiled here as its docs say. Greedy, a
    batch of 4 prompts left padded to 64 or 128 tokens (drawn per request), 64 new tokens, two
    requests a step, under torch.inference_mode."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                         max_position_embeddings=1024, pad_token_id=0)
    model = _bf16_on_gpu(torch, lambda: LlamaForCausalLM(config))
    model.generation_config.cache_implementation = "static"
    model.generation_config.pad_token_id = 0
    if not hasattr(transformers.GenerationConfig(), "compile_config"):
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    plan = [[rng.choice(prompts) for _ in range(2)] for _ in range(steps)]

    def step(i):
        tokens = 0
        with torch.inference_mode():
            for longest in plan[i]:
                lengths = [rng.randint(longest // 2, longest) for _ in range(batch)]
                ids = torch.zeros((batch, longest), dtype=torch.long)
                mask = torch.zeros((batch, longest), dtype=torch.long)
                for row, n in enumerate(lengths):
                    ids[row, longest - n:] = torch.randint(3, config.vocab_size, (n,))
                    mask[row, longest - n:] = 1
                out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(),
                                     max_new_tokens=new, min_new_tokens=new, do_sample=False)
                tokens += out.shape[1] - longest
        return float(tokens)

    step.shapes = [" ".join("%dx%d+%d" % (batch, p, new) for p in requests) for requests in plan]
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


# --- held-out, tenth batch (2026-11-25): speculative decoding, CUDA graphs over bucketed lengths -


def spec_generate_step(torch, steps, seed=0, requests=2):
    """Speculative decoding as transformers runs it (assisted generation): a GPT-2 124M target and
    a 2-layer GPT-2 draft (random init, bf16) under torch.inference_mode, batch 1, prompts of
    32..256 tokens and 32..96 new ones drawn per request. The draft proposes tokens, the target
    checks them in one forward, and both KV caches are cut back to the tokens accepted."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = GPT2Config()
    target = GPT2LMHeadModel(config).cuda().eval().to(torch.bfloat16)
    draft = GPT2LMHeadModel(GPT2Config(n_layer=2)).cuda().eval().to(torch.bfloat16)
    pad = config.eos_token_id
    plan = [[(rng.randint(32, 256), rng.randint(32, 96)) for _ in range(requests)]
            for _ in range(steps)]

    def step(i):
        tokens = 0
        with torch.inference_mode():
            for prompt, new in plan[i]:
                ids = torch.randint(0, config.vocab_size - 1, (1, prompt), device="cuda")
                out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      assistant_model=draft, max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=pad)
                tokens += out.shape[1] - prompt
        return float(tokens)

    step.shapes = [" ".join("1x%d+%d" % r for r in requests) for requests in plan]
    return step


def cudagraphs_varlen_step(torch, steps, seed=0, batch=8, lengths=(256, 512, 1024)):
    """gpt2_cudagraphs on batches bucketed by length (256, 512 or 1,024 tokens, drawn per step):
    transformers GPT-2 124M trained under torch.compile(mode="reduce-overhead"), each bucket's
    forward and backward recorded as CUDA graphs of their own in cudagraph trees' one pool, bf16
    autocast, AdamW, cudagraph_mark_step_begin() before each step."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = GPT2Config()
    model = GPT2LMHeadModel(config).cuda().train()
    loss_of = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss,
                            mode="reduce-overhead", dynamic=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plan = [rng.choice(lengths) for _ in range(steps)]

    def step(i):
        torch.compiler.cudagraph_mark_step_begin()
        ids = torch.randint(0, config.vocab_size, (batch, plan[i]), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(ids)
        return finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, t) for t in plan]
    return step


# --- held-out, eleventh batch (2026-11-25): weights streamed in, continuous batching, an
# evaluation that gathers its outputs, two towers trained contrastively ------------------------


def weights_stream_serve_step(torch, steps, seed=0, layers=16, dim=2048, ffn=5632, requests=4):
    """Serving a model whose weights live in pinned host memory and stream to the GPU a layer at
    a time, as accelerate's CPU offload and ZeRO-Inference run a model larger than the GPU: a
    Llama-style decoder (16 layers, 2048 wide, 16 heads, SwiGLU of 5632; plain torch, bf16) whose
    next layer's seven matrices a side stream copies while the compute stream runs this one; the
    compute stream waits for the copy, calls record_stream on the weights it takes over, and
    drops them after the layer. Each step serves 4 requests whose batch (1..8) and length
    (64..1024) are drawn at random, under torch.inference_mode."""
    F = torch.nn.functional
    torch.manual_seed(seed)
    rng = random.Random(seed)
    heads = 16
    shapes = [(dim, dim)] * 4 + [(ffn, dim), (ffn, dim), (dim, ffn)]  # q k v o, gate up down
    host = [[torch.randn(s, dtype=torch.bfloat16).mul_(0.02).pin_memory() for s in shapes]
            for _ in range(layers)]
    copier = torch.cuda.Stream()
    plan = [[(rng.randint(1, 8), rng.randrange(64, 1025, 64)) for _ in range(requests)]
            for _ in range(steps)]

    def fetch(layer):
        with torch.cuda.stream(copier):
            return [w.cuda(non_blocking=True) for w in host[layer]]

    def run_layer(x, w):
        b, t, _ = x.shape
        h = F.layer_norm(x, (dim,))
        q, k, v = (F.linear(h, m).view(b, t, heads, -1).transpose(1, 2) for m in w[:3])
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(a.transpose(1, 2).reshape(b, t, dim), w[3])
        h = F.layer_norm(x, (dim,))
        return x + F.linear(F.silu(F.linear(h, w[4])) * F.linear(h, w[5]), w[6])

    def step(i):
        total = 0.0
        main = torch.cuda.current_stream()
        with torch.inference_mode():
            for batch, length in plan[i]:
                x = torch.randn(batch, length, dim, device="cuda", dtype=torch.bfloat16)
                ahead = fetch(0)
                for layer in range(layers):
                    main.wait_stream(copier)
                    weights, ahead = ahead, None
                    for w in weights:
                        w.record_stream(main)
                    if layer + 1 < layers:
                        ahead = fetch(layer + 1)
                    x = run_layer(x, weights)
                    del weights
                total += x.float().sum().item()
        return total

    step.shapes = [" ".join("%dx%d" % r for r in requests) for requests in plan]
    return step


def continuous_batching_step(torch, steps, seed=0, slots=32, decode=64):
    """A generation server's continuous batching with the KV cache each request grows by
    torch.cat every token (as transformers' DynamicCache grows it): a Llama-style decoder in plain
    torch (8 layers, 1024 wide, 16 heads, grouped-query attention with 4 KV heads, bf16) under
    torch.inference_mode; requests (prompts of 16..1024 tokens, 16..256 new ones, drawn at
    random) are prefilled alone and join the running batch, up to 32, as others finish; each
    decode step pads the running requests' caches to the longest (pad_sequence) and masks the
    padding. A step is 64 decode steps."""
    F = torch.nn.functional
    torch.manual_seed(seed)
    rng = random.Random(seed)
    dim, layers, heads, kv_heads, ffn, vocab = 1024, 8, 16, 4, 2816, 32000
    hd = dim // heads

    def weight(rows, cols):
        return torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02

    embed = weight(vocab, dim)
    model = [dict(q=weight(dim, dim), k=weight(kv_heads * hd, dim), v=weight(kv_heads * hd, dim),
                  o=weight(dim, dim), g=weight(ffn, dim), u=weight(ffn, dim), d=weight(dim, ffn))
             for _ in range(layers)]
    queue = [(rng.randint(16, 1024), rng.randint(16, 256)) for _ in range(steps * 64)]
    running = []  # [cache: per layer [k, v] of (1, kv_heads, length, hd), tokens left, last id]

    def mlp(x, w):
        h = F.layer_norm(x, (dim,))
        return x + F.linear(F.silu(F.linear(h, w["g"])) * F.linear(h, w["u"]), w["d"])

    def prefill(prompt, new):
        ids = torch.randint(0, vocab, (1, prompt), device="cuda")
        x = embed[ids]
        cache = []
        for w in model:
            h = F.layer_norm(x, (dim,))
            q = F.linear(h, w["q"]).view(1, prompt, heads, hd).transpose(1, 2)
            k = F.linear(h, w["k"]).view(1, prompt, kv_heads, hd).transpose(1, 2).contiguous()
            v = F.linear(h, w["v"]).view(1, prompt, kv_heads, hd).transpose(1, 2).contiguous()
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = mlp(x + F.linear(a.transpose(1, 2).reshape(1, prompt, dim), w["o"]), w)
            cache.append([k, v])
        last = F.linear(x[:, -1], embed).argmax(-1)
        running.append([cache, new, last])

    def decode_step():
        b = len(running)
        x = embed[torch.cat([r[2] for r in running])].unsqueeze(1)  # (b, 1, dim)
        lengths = [r[0][0][0].shape[2] + 1 for r in running]
        longest = max(lengths)
        mask = (torch.arange(longest, device="cuda")[None, :] <
                torch.tensor(lengths, device="cuda")[:, None]).view(b, 1, 1, longest)
        for layer, w in enumerate(model):
            h = F.layer_norm(x, (dim,))
            q = F.linear(h, w["q"]).view(b, 1, heads, hd).transpose(1, 2)
            k = F.linear(h, w["k"]).view(b, kv_heads, 1, hd)
            v = F.linear(h, w["v"]).view(b, kv_heads, 1, hd)
            for row, r in enumerate(running):
                kv = r[0][layer]
                kv[0] = torch.cat([kv[0], k[row:row + 1]], dim=2)
                kv[1] = torch.cat([kv[1], v[row:row + 1]], dim=2)
            keys, values = (torch.nn.utils.rnn.pad_sequence(
                [r[0][layer][j][0].transpose(0, 1) for r in running], batch_first=True)
                .transpose(1, 2) for j in (0, 1))
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = mlp(x + F.linear(a.transpose(1, 2).reshape(b, 1, dim), w["o"]), w)
        ids = F.linear(x[:, 0], embed).argmax(-1)
        for row, r in enumerate(running):
            r[1] -= 1
            r[2] = ids[row:row + 1]
        running[:] = [r for r in running if r[1] > 0]
        return b

    def step(i):
        tokens = 0
        with torch.inference_mode():
            for _ in range(decode):
                while len(running) < slots and queue:
                    prefill(*queue.pop(0))
                tokens += decode_step()
            torch.cuda.synchronize()
        return float(tokens)

    step.shapes = ["%d decode steps" % decode] * steps
    return step


def eval_collect_step(torch, steps, seed=0, batch=8, size=320, every=4, eval_batches=16):
    """Segmentation training with an evaluation that gathers its outputs on the GPU, as many
    scripts compute a dataset's metric: torchvision FCN-ResNet50 (random init, 21 classes) trained
    on batches of 8 random 320 px images (SGD, bf16 autocast); every 4th step is instead an
    evaluation of 16 batches under torch.no_grad whose logits and labels are appended to lists
    on the GPU, concatenated at the end for the confusion matrix and mean IoU, then dropped."""
    import torchvision

    torch.manual_seed(seed)
    classes = 21
    model = torchvision.models.segmentation.fcn_resnet50(
        weights=None, weights_backbone=None, num_classes=classes, aux_loss=False).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def images():
        return (torch.randn(batch, 3, size, size, device="cuda"),
                torch.randint(0, classes, (batch, size, size), device="cuda"))

    def step(i):
        if i % every != every - 1:
            model.train()
            x, y = images()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x)["out"], y)
            return finish_training_step(optimizer, loss)
        model.eval()
        outputs, labels = [], []
        with torch.no_grad():
            for _ in range(eval_batches):
                x, y = images()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    outputs.append(model(x)["out"].float())
                labels.append(y)
            predicted = torch.cat(outputs).argmax(1)
            truth = torch.cat(labels)
            confusion = torch.bincount(truth.flatten() * classes + predicted.flatten(),
                                       minlength=classes * classes).view(classes, classes)
            union = confusion.sum(0) + confusion.sum(1) - confusion.diag()
            return (confusion.diag() / union.clamp(min=1)).mean().item()

    step.shapes = ["eval" if i % every == every - 1 else "train" for i in range(steps)]
    return step


def clip_train_step(torch, steps, seed=0, batch=128, size=160, tokens=77):
    """CLIP-style contrastive training of two towers: a ViT-B/16 image tower (torchvision, 160 px,
    its head a 512-wide projection) and a 12-layer text Transformer (512 wide, 8 heads,
    pre-norm, 77 tokens, its last token projected), the batch's image-text similarity matrix with
    a learned temperature and the symmetric cross entropy; bf16 autocast, AdamW."""
    import torchvision

    torch.manual_seed(seed)
    nn = torch.nn
    width, vocab = 512, 49408
    image_tower = torchvision.models.vit_b_16(weights=None, image_size=size, num_classes=width)
    text_layer = nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True,
                                            norm_first=True, activation="gelu")
    text = nn.ModuleDict(dict(
        embed=nn.Embedding(vocab, width), blocks=nn.TransformerEncoder(
            text_layer, 12, enable_nested_tensor=False), norm=nn.LayerNorm(width),
        project=nn.Linear(width, width, bias=False)))
    positions = nn.Parameter(torch.randn(tokens, width, device="cuda") * 0.01)
    scale = nn.Parameter(torch.tensor(math.log(1 / 0.07), device="cuda"))
    model = nn.ModuleDict(dict(image=image_tower, text=text)).cuda()
    params = list(model.parameters()) + [positions, scale]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    causal = nn.Transformer.generate_square_subsequent_mask(tokens, device="cuda")

    def step(i):
        x = torch.randn(batch, 3, size, size, device="cuda")
        ids = torch.randint(0, vocab, (batch, tokens), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            image = torch.nn.functional.normalize(model["image"](x), dim=-1)
            t = text["blocks"](text["embed"](ids) + positions, mask=causal, is_causal=True)
            t = torch.nn.functional.normalize(text["project"](text["norm"](t[:, -1])), dim=-1)
            logits = scale.exp() * image @ t.t()
            target = torch.arange(batch, device="cuda")
            loss = (torch.nn.functional.cross_entropy(logits, target) +
                    torch.nn.functional.cross_entropy(logits.t(), target)) / 2
        return finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d px + %d tokens" % (batch, size, tokens)] * steps
    return step


# --- issue #56 item 5 (2026-11-28): BERT masked LM at one shape, FSDP2 over lengths drawn per step
# The two programs whose live runs on an H200 the engine's next version is measured against: a
# fixed-shape masked LM whose gmem layout took 30-60 steps to settle (and never without step
# marks), and FSDP2 on several GPUs where gmem held least but ran 2-5% slower than native.


def bert_mlm_step(torch, steps, seed=0, batch=16, length=512):
    """transformers BERT-base masked LM (BertForMaskedLM(BertConfig()), random init) at one
    shape, 16 x 512 random token ids: 15% of the positions drawn as labels (the others -100) and
    replaced by [MASK] (id 103) in the input, bf16 autocast, AdamW; one shape every step."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig()
    model = BertForMaskedLM(config).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mask_id = 103  # bert-base-uncased's [MASK]

    def step(i):
        ids = torch.randint(1000, config.vocab_size, (batch, length), device="cuda")
        masked = torch.rand(ids.shape, device="cuda") < 0.15
        labels = torch.where(masked, ids, -100)
        inputs = torch.where(masked, mask_id, ids)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=inputs, labels=labels).loss
        return finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, length)] * steps
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
        return finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, t) for t in lengths]
    return step
