#!/usr/bin/env bash
# Training with an evaluation every fourth step (models.py: gpt2_train_eval, resnet50_train_eval):
# captures each program's allocation trace under the native allocator (and its peaks under
# expandable segments), then runs it live under native, expandable and gmem (16 steps: 4 warm-up,
# 12 timed) and prints each run's reserved / allocated, its time and gmem's maps step by step.
# docs/engine.md, "Phases that come back". Run on the GPU machine from the repository root:
#   bench/torch/train_eval.sh        (traces and results under $OUT or /tmp)
set -u
cd "$(dirname "$0")/../.."
dir=${OUT:-/tmp}
source bench/torch/build_gpu.sh
unset PYTORCH_CUDA_ALLOC_CONF GMEM_DEVICE
python3 bench/torch/capture_traces.py --programs gpt2_train_eval resnet50_train_eval --expandable \
  --out-dir "$dir" --out "$dir/train_eval_capture.jsonl" >/dev/null || echo "FAILED capture"
python3 bench/torch/train_bench.py --all --models gpt2_train_eval resnet50_train_eval \
  --warmup 4 --steps 12 --out "$dir/train_eval.jsonl" >/dev/null || echo "FAILED train_bench"
python3 - "$dir" <<'PY'
import json, sys
for line in open(sys.argv[1] + "/train_eval_capture.jsonl"):
    r = json.loads(line)
    print(f"capture {r.get('program')} {r.get('allocator')}: reserved/allocated {r.get('reserved_ratio')} "
          f"events {r.get('events')} {r.get('error', '')}")
for line in open(sys.argv[1] + "/train_eval.jsonl"):
    r = json.loads(line)
    print(f"{r['model']:20} {r['allocator']:10} total {r.get('total_ms', 0):7.0f} ms  "
          f"reserved/allocated {r.get('reserved_ratio')}  maps after warm-up {r.get('maps_after_warmup')} "
          f"{r.get('error', '')}")
    if r.get("step_maps"):
        print("   maps", r["step_maps"])
    print("   ms", r.get("step_ms"))
PY
