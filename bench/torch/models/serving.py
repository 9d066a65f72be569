"""Inference and generation as servers run them: no optimizer, so nothing marks their steps.
transformers models (random init) or models in plain torch, the requests' shapes drawn at
random; the held-out batch of each program is in parentheses (models/__init__.py). Serving under
torch.compile and CUDA graphs (graph_serve, compile_serve, static_generate) is in compiled.py.

- gpt2_generate: transformers GPT-2 124M generate() with its KV cache, greedy, under
  torch.no_grad: a round of prompts of varying lengths (left padded) per step, batch and new
  tokens varying between rounds (GPT2_ROUNDS).
- bert_serve (1), bert_large_serve (3): BERT-base and BERT-large encoders over requests of random
  batch and length (_encode_requests).
- llama_generate (2), llama_serve_1b (3): Llama generate() requests (_generate_requests), 8
  layers of 1024 and TinyLlama's 1.1B shape.
- beam_generate (7): GPT-2 generate() with beam search.
- threads_serve (8): BERT-base served by four threads, each on a CUDA stream of its own.
- spec_generate (10): speculative decoding (assisted generation) with a 2-layer draft.
- weights_stream_serve (11): a decoder whose weights stream in from pinned host memory a layer at
  a time, on a side stream.
- continuous_batching (11): continuous batching over KV caches grown by torch.cat every token.
"""

import random

from .shared import _bf16_on_gpu


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
