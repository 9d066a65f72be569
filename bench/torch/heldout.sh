#!/usr/bin/env bash
# Held-out workloads, programs gmem's policy was not tuned on (models/; by default the first
# batch: vit, bert_varlen, t5_varlen, gpt2_accum, bert_serve; `batch2` names the second:
# llama_generate, unet, convnext_multiscale, moe, gpt2_compiled; `batch3` serving of GiBs:
# llama_serve_1b, bert_large_serve; `batch4` fine-tuning, compiled and diffusion: lora_llama,
# gpt2_dynamic, diffusion_sample; `batch5` shapes new every step, two optimizers, LSTM and CUDA
# graphs: gnn_random, dlrm_sparse, lstm_varlen, gpt2_cudagraphs; `batch6` what programs do
# around the model: graph_serve, prefetch_train, gan, offload_train; `batch7` training recipes
# as scripts write them, and beam search: empty_cache_varlen, beam_generate, amp_scaler,
# distill; `batch8` data parallel on one rank, threads and compiled serving: ddp_train,
# fsdp_train, threads_serve, compile_serve; `batch9` rollouts, EMA, static-cache generation and
# Lightning Fabric: rollout_train, ema_train, static_generate, fabric_train; `batch10`
# speculative decoding and CUDA graphs over bucketed lengths: spec_generate, cudagraphs_varlen;
# `batch11` weights streamed in, continuous batching, an evaluation gathering its outputs and
# contrastive towers: weights_stream_serve, continuous_batching, eval_collect, clip_train):
# `capture` records each one's allocation trace under
# the native allocator (and its peaks under expandable segments) for `gmem replay`; `live` runs each under native, expandable
# and gmem (4 warm-up + 8 timed steps) and prints reserved / allocated, time and gmem's maps
# step by step. docs/notes/2026-11-24-held-out-traces.md. On the GPU machine, from the repository root:
#   bench/torch/heldout.sh capture|live [batch2|program...]   (results under $OUT or /tmp)
set -u
cd "$(dirname "$0")/../.."
dir=${OUT:-/tmp}
mode=${1:-capture}
shift || true
programs=${*:-vit bert_varlen t5_varlen gpt2_accum bert_serve}
[ "$programs" = batch2 ] && programs="llama_generate unet convnext_multiscale moe gpt2_compiled"
[ "$programs" = batch3 ] && programs="llama_serve_1b bert_large_serve"
[ "$programs" = batch4 ] && programs="lora_llama gpt2_dynamic diffusion_sample"
[ "$programs" = batch5 ] && programs="gnn_random dlrm_sparse lstm_varlen gpt2_cudagraphs"
[ "$programs" = batch6 ] && programs="graph_serve prefetch_train gan offload_train"
[ "$programs" = batch7 ] && programs="empty_cache_varlen beam_generate amp_scaler distill"
[ "$programs" = batch8 ] && programs="ddp_train fsdp_train threads_serve compile_serve"
[ "$programs" = batch9 ] && programs="rollout_train ema_train static_generate fabric_train"
[ "$programs" = batch10 ] && programs="spec_generate cudagraphs_varlen"
[ "$programs" = batch11 ] && programs="weights_stream_serve continuous_batching eval_collect clip_train"
unset PYTORCH_CUDA_ALLOC_CONF GMEM_DEVICE
if [ "$mode" = capture ]; then
  python3 bench/torch/capture_traces.py --programs $programs --expandable --timeout 200 \
    --out-dir "$dir" --out "$dir/heldout_capture.jsonl" || echo "FAILED capture"
else
  source bench/torch/build_gpu.sh
  python3 bench/torch/train_bench.py --all --models $programs \
    --warmup 4 --steps 8 --out "$dir/heldout.jsonl" >/dev/null || echo "FAILED train_bench"
  python3 bench/torch/train_bench.py --show "$dir/heldout.jsonl"
fi
