"""torch.compile and CUDA graphs: Inductor's buffers, cudagraph trees' private pool, graphs
captured by hand. A training step ends in shared.finish_training_step; the held-out batch of
each program is in parentheses (models/__init__.py).

- gpt2_compiled (2): transformers GPT-2 124M trained under torch.compile (default mode).
- gpt2_dynamic (4): the same under torch.compile(dynamic=True), a length drawn per step.
- gpt2_cudagraphs (5): trained under mode="reduce-overhead": forward and backward replayed as CUDA
  graphs.
- graph_serve (6): serving through CUDA graphs captured by hand, one per batch bucket, in one pool.
- compile_serve (8): GPT-2's forward served under reduce-overhead at a few padded shapes.
- static_generate (9): generate() on a static KV cache, the forward under reduce-overhead.
- cudagraphs_varlen (10): gpt2_cudagraphs over three length buckets, graphs for each.
"""

import random

from . import shared  # shared.finish_training_step, looked up at each call (host_time.py)
from .shared import _bf16_on_gpu, _causal_lm_steps


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
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, length)] * steps
    return step


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
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, t) for t in plan]
    return step
