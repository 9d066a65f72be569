"""Language models trained on random tokens: transformers models (random init) and models in
plain torch. A step ends in shared.finish_training_step unless said otherwise; the held-out
batch of each program is in parentheses (models/__init__.py).

- gpt2_train_eval: GPT-2 124M trained on batch 4 x 512 tokens (bf16 autocast, AdamW) and
  evaluated on 8 x 384 every TRAIN_EVAL_PERIOD steps (shared._train_eval).
- bert_varlen (1): BERT-base masked LM with dynamic padding, a length per step (bert_lengths).
- t5_varlen (1): a T5 encoder-decoder, source and target lengths drawn per step.
- gpt2_accum (1): GPT-2 with gradient accumulation; its own optimizer step.
- moe (2): a mixture-of-experts decoder in plain torch, top-2 routing.
- lora_llama (4): LoRA fine-tuning of a frozen 1.5B Llama under gradient checkpointing.
- lstm_varlen (5): a cuDNN LSTM language model on packed sequences.
- offload_train (6): a Transformer encoder whose saved activations go to pinned host memory.
- empty_cache_varlen (7): BERT fine-tuned with gc.collect() and empty_cache() after every step.
- rollout_train (9): completions generated, then trained on, in turn (GRPO/PPO-style).
- bert_mlm (issue #56 item 5): BERT-base masked LM at one shape, 16 x 512.
"""

import random

from . import shared  # shared.finish_training_step, looked up at each call (host_time.py)
from .shared import _bf16_on_gpu, _causal_lm_steps, _train_eval


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
        return shared.finish_training_step(optimizer, loss)

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
        return shared.finish_training_step(optimizer, loss)

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
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, length)] * steps
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
        return shared.finish_training_step(optimizer, nn.functional.cross_entropy(logits, labels))

    step.shapes = ["%d sequences, %d tokens, longest %d" % (batch, sum(p), max(p)) for p in plan]
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
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, length)] * steps
    return step


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
        value = shared.finish_training_step(optimizer, loss)
        gc.collect()
        torch.cuda.empty_cache()
        return value

    step.shapes = ["%d x %d" % (batch, n) for n in lengths]
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
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["batch %d prompts %d..%d +%d" % (batch, min(l), max(l), n) for l, n in plan]
    return step


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
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, length)] * steps
    return step
