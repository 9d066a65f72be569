#!/usr/bin/env bash
# Training with an evaluation every fourth step (models/: gpt2_train_eval, resnet50_train_eval):
# captures each program's allocation trace under the native allocator (and its peaks under
# expandable segments), then runs it live under native, expandable and gmem (16 steps: 4 warm-up,
# 12 timed) and prints each run's reserved / allocated, its time and gmem's maps step by step.
# docs/notes/2026-11-24-training-with-an-evaluation.md. Run on the GPU machine from the repository root:
#   bench/torch/train_eval.sh        (traces and results under $OUT or /tmp)
set -u
cd "$(dirname "$0")/../.."
dir=${OUT:-/tmp}
source bench/torch/build_gpu.sh
unset PYTORCH_CUDA_ALLOC_CONF GMEM_DEVICE
python3 bench/torch/capture_traces.py --programs gpt2_train_eval resnet50_train_eval --expandable \
  --out-dir "$dir" --out "$dir/train_eval_capture.jsonl" || echo "FAILED capture"
python3 bench/torch/train_bench.py --all --models gpt2_train_eval resnet50_train_eval \
  --warmup 4 --steps 12 --out "$dir/train_eval.jsonl" >/dev/null || echo "FAILED train_bench"
python3 bench/torch/train_bench.py --show "$dir/train_eval.jsonl"
