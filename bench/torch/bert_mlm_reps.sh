#!/usr/bin/env bash
# models.bert_mlm_step (BERT-base masked LM, 16 x 512, bf16 autocast, AdamW) live on one GPU:
# native, gmem, and gmem without step marks (GMEM_PLAN_STEPS=0), one process each, the three
# alternated REPS times (default 2; runs of one allocator differ by a few percent); then, after
# 40 warm steps, 5 steps of native and of gmem under torch.profiler: wall time against the sum
# of GPU kernel times (profile_steps.py), to tell the host's time from the GPU's.
# Files under $OUT (default /tmp/bert-reps): bert-mlm-reps.jsonl (train_bench.py's lines),
# bert-mlm-profile.jsonl; the table is printed last. From the repository root:
#   bench/torch/bert_mlm_reps.sh
set -u
cd "$(dirname "$0")/../.."
dir=${OUT:-/tmp/bert-reps}
mkdir -p "$dir"
unset PYTORCH_CUDA_ALLOC_CONF GMEM_DEVICE GMEM_PLAN_STEPS
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export GMEM_CACHE_DIR=$PWD/build-gpu/gmem-cache  # gmem's PyTorch allocator, compiled once
source bench/torch/build_gpu.sh  # builds build-gpu/libgmem.so; sets GMEM_LIBRARY and PYTHONPATH
runs=$dir/bert-mlm-reps.jsonl
for rep in $(seq "${REPS:-2}"); do
  echo "[bert_mlm_reps] round $rep"
  python3 bench/torch/train_bench.py --all --models bert_mlm --allocators native gmem \
    --warmup 5 --steps "${STEPS:-60}" --timeout 150 --out "$runs" || echo "FAILED: a run"
  GMEM_PLAN_STEPS=0 python3 bench/torch/train_bench.py --all --models bert_mlm --allocators gmem \
    --warmup 5 --steps "${STEPS:-60}" --timeout 150 --out "$runs" || echo "FAILED: gmem unmarked"
done
for alloc in native gmem; do
  MODEL=bert_mlm WARM=40 STEPS=5 ALLOC=$alloc python3 bench/torch/profile_steps.py \
    >>"$dir/bert-mlm-profile.jsonl" || echo "FAILED: profile $alloc"
done
python3 bench/torch/train_bench.py --show "$runs"
cat "$dir/bert-mlm-profile.jsonl"
