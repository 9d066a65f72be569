"""The workloads shared by capture_traces.py (allocation traces), train_bench.py (step times) and
the other benchmarks here (heldout.sh, fsdp2_bench.py, distributed_bench.py, fit_bench.py,
host_time.py, ...): with bench/torch on sys.path, `import models`, then `models.<name>_step`.

Each factory takes the imported torch module and the number of steps, builds its model on the GPU
(seeded, random init, nothing downloaded) and returns `step(i)`, which runs step i and returns a
float (the loss, or the number of tokens generated); `step.shapes[i]` says what step i works on.
What a step does depends on i (a sequence length, image sizes), the same for every allocator.
The step closure holds the model and optimizer: dropping it frees them. Importing the package
imports no torch.

A module a family, each one's docstring naming its workloads; every name of theirs is also here,
as when they were one file (bench/torch/models.py):
  shared       finish_training_step, the end of a training step; the train/eval loop, a causal
               LM's training steps, modules built in bf16
  llama        the Llama-style decoder in plain torch and its schedules (llama, llama_rounds)
  language     language models trained (GPT-2, BERT, T5, a mixture of experts, LoRA, an LSTM, ...)
  vision       vision models trained (Faster R-CNN, ResNet, ViT, ConvNeXt, a GAN, CLIP, ...)
  diffusion    a DDPM UNet trained, sampled, and trained with an EMA
  sparse       a graph network on random graphs and a DLRM-style recommender
  serving      inference and generation as servers run them
  compiled     torch.compile and CUDA graphs, training and serving
  distributed  DDP, FSDP2 and Lightning Fabric

Held-out programs, all but llama, fasterrcnn, gpt2_generate, the train/eval pair and issue #56's
two: programs whose traces gmem's policy was never tuned on, captured to check that what holds on
the traces in tests/data holds elsewhere (bench/torch/heldout.sh;
docs/notes/2026-11-24-held-out-traces.md). Their batches:
  1 (2026-11-24) vit, bert_varlen, t5_varlen, gpt2_accum, bert_serve.
  2 (2026-11-24) programs of kinds not captured before: llama_generate, unet,
    convnext_multiscale, moe, gpt2_compiled.
  3 (2026-11-24) serving at the sizes served on one H100: llama_serve_1b, bert_large_serve.
    bert_serve and llama_generate hold 1.04x their peak under gmem, programs under 1 GiB where a
    page more or less is 0.25%. These two serve the same kinds of requests from models of GiBs,
    loaded in bf16 as from_pretrained(torch_dtype=torch.bfloat16) loads them (no fp32 copy first).
  4 (2026-11-24) the fine-tuning and compiled programs of today: lora_llama, gpt2_dynamic,
    diffusion_sample. Kinds the first three batches lack: parameter-efficient fine-tuning of a
    frozen model (most fine-tuning today), Inductor with dynamic shapes, and diffusion sampling
    at the resolutions a user asks for.
  5 (2026-11-25) shapes new every step, two optimizers, CUDA graphs: gnn_random, dlrm_sparse,
    lstm_varlen, gpt2_cudagraphs. Kinds the first four batches lack: training whose block sizes
    are drawn anew every step (graph networks on sampled subgraphs, recommendation models' sparse
    gradients), a loop with two optimizers (two optimizer steps per iteration), cuDNN's LSTM on
    packed sequences, and training replayed as CUDA graphs from a private pool (torch.compile's
    reduce-overhead).
  6 (2026-11-25) what programs do around the model: graph_serve, prefetch_train, gan,
    offload_train. CUDA graphs captured by hand into one shared pool, a side stream that
    prefetches the input, two models trained in turn, activations offloaded to the host.
  7 (2026-11-25) training recipes as scripts write them, and beam search: empty_cache_varlen,
    beam_generate, amp_scaler, distill.
  8 (2026-11-25) data parallel on one rank, threads, compiled serving: ddp_train, fsdp_train,
    threads_serve, compile_serve. What the first seven batches lack: the data-parallel wrappers
    most training runs under (DDP's gradient buckets; FSDP2's parameters gathered and freed per
    layer on streams of its own), a server whose requests run in threads each on a stream of its
    own, and serving compiled with CUDA graphs at a few padded shapes. One rank (NCCL over one
    GPU) runs the wrappers' real code: their buckets, streams and copies.
  9 (2026-11-25) rollouts and training taking turns, EMA with foreach ops, generation on a static
    cache under CUDA graphs, Lightning Fabric: rollout_train, ema_train, static_generate,
    fabric_train.
  10 (2026-11-25) speculative decoding, CUDA graphs over bucketed lengths: spec_generate,
    cudagraphs_varlen.
  11 (2026-11-25) weights streamed in, continuous batching, an evaluation that gathers its
    outputs, two towers trained contrastively: weights_stream_serve, continuous_batching,
    eval_collect, clip_train.
Issue #56 item 5 (2026-11-28): bert_mlm and fsdp2_varlen, the two programs whose live runs on an
H200 the engine's next version is measured against: a fixed-shape masked LM whose gmem layout
took 30-60 steps to settle (and never without step marks), and FSDP2 on several GPUs where gmem
held least but ran 2-5% slower than native.

Step marks. A captured trace names each allocation by its innermost frame in these files,
`file.py:LINE:FUNCTION`, and `gmem replay --step-at FRAME` ends a training step after the events
of a frame, as gmem.torch marks a step at optimizer.step(). Traces captured before this package
was split out of models.py (tests/data, bench/data, the held-out traces of then) name
`models.py:LINE` of that file: the marks that name those lines (bench/replay_traces.sh,
alloc_bench.py, the C++ tests) are theirs and stay. A trace captured since names these modules'
files: step_frame(program) finds the line that ends its steps (STEP_ENDS: a function and the
statement in it) in the code as it is now, so that an edit here moves the mark with the line.

finish_training_step lives in shared.py and every factory calls it as
`shared.finish_training_step`: to replace it, set `models.shared.finish_training_step`, as
host_time.py does (`models.finish_training_step` here is a copy of the name, read by fit_bench.py;
setting it changes no factory).
"""

import inspect
import os

from . import shared  # models.shared.finish_training_step (see above)
from .shared import (finish_training_step, TRAIN_EVAL_PERIOD, _train_eval,  # noqa: F401
                     _bf16_on_gpu, _causal_lm_steps)
from .llama import (LLAMA, LLAMA_BATCH, LLAMA_SEQ, llama_lengths,  # noqa: F401
                    llama_warm_and_timed, llama_rounds_step, _llama_modules, llama_parameters,
                    llama_step)
from .language import (gpt2_train_eval_step, bert_lengths, bert_varlen_step,  # noqa: F401
                       t5_varlen_step, gpt2_accum_step, moe_step, _lora, lora_llama_step,
                       lstm_varlen_step, offload_train_step, empty_cache_varlen_step,
                       rollout_train_step, bert_mlm_step)
from .vision import (fasterrcnn_step, resnet50_train_eval_step, vit_step,  # noqa: F401
                     CONVNEXT_SIZES, convnext_multiscale_step, prefetch_train_step, gan_step,
                     amp_scaler_step, distill_step, eval_collect_step, clip_train_step)
from .diffusion import _unet, unet_step, diffusion_sample_step, ema_train_step  # noqa: F401
from .sparse import gnn_random_step, dlrm_sparse_step  # noqa: F401
from .serving import (GPT2_ROUNDS, gpt2_generate_step, _encode_requests,  # noqa: F401
                      _generate_requests, bert_serve_step, llama_generate_step,
                      llama_serve_1b_step, bert_large_serve_step, beam_generate_step,
                      threads_serve_step, spec_generate_step, weights_stream_serve_step,
                      continuous_batching_step)
from .compiled import (gpt2_compiled_step, gpt2_dynamic_step, gpt2_cudagraphs_step,  # noqa: F401
                       graph_serve_step, compile_serve_step, static_generate_step,
                       cudagraphs_varlen_step)
from .distributed import (_one_rank_group, ddp_train_step, fsdp_train_step,  # noqa: F401
                          fabric_train_step, FSDP2_LLAMA, FSDP2_SEQ, fsdp2_varlen_lengths,
                          fsdp2_varlen_step)

# program (a trace's name) -> (function, statement): the statement whose allocations end a
# training step, where gmem.torch marks one (the optimizer's step), for the training programs
# bench/replay_traces.sh marks at a line. distill and eval_collect end at zero_grad: their SGD
# allocates nothing after its first step, and zero_grad's frees follow it.
_OPTIMIZER_STEP = (shared.finish_training_step, "optimizer.step()")
STEP_ENDS = dict.fromkeys(
    ("llama_rounds", "moe", "t5_varlen", "bert_varlen", "gpt2_compiled", "lora_llama",
     "gpt2_dynamic", "unet", "vit", "gnn_random", "lstm_varlen", "gpt2_cudagraphs",
     "cudagraphs_varlen", "empty_cache_varlen", "ddp_train", "fsdp_train", "rollout_train",
     "clip_train", "bert_mlm", "fsdp2_varlen"), _OPTIMIZER_STEP)
STEP_ENDS.update(
    distill=(shared.finish_training_step, "optimizer.zero_grad(set_to_none=True)"),
    eval_collect=(shared.finish_training_step, "optimizer.zero_grad(set_to_none=True)"),
    # its own step (replay_traces.sh's models.py:39 for it names a line its steps never run)
    convnext_multiscale=(convnext_multiscale_step, "scaler.step(optimizer)"),
    gpt2_accum=(gpt2_accum_step, "optimizer.step()"),
    dlrm_sparse=(dlrm_sparse_step, "dense.step()"),  # the second of its two optimizer steps
    amp_scaler=(amp_scaler_step, "scaler.step(optimizer)"),
    ema_train=(ema_train_step, "optimizer.step()"),
    fabric_train=(fabric_train_step, "optimizer.step()"),
)


def step_frame(program):
    """`file.py:LINE` of the statement that ends a training step of `program` (STEP_ENDS), read
    from the code as it is now: `gmem replay --step-at` for a trace captured from this package.
    LookupError where the function has not exactly one line that is the statement."""
    function, statement = STEP_ENDS[program]
    lines, first = inspect.getsourcelines(function)
    found = [first + k for k, line in enumerate(lines) if line.strip() == statement]
    if len(found) != 1:
        raise LookupError("%s: %d lines of %s read %r" % (program, len(found), function.__name__,
                                                          statement))
    return "%s:%d" % (os.path.basename(inspect.getsourcefile(function)), found[0])
