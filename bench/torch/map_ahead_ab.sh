#!/usr/bin/env bash
# bench/torch/map_ahead_ab.sh [MODEL] [STEPS] (GPU machine, repository root; results under $OUT or
# /tmp): train_bench.py's MODEL (default llama, gpu-check's schedule: each length once, then
# STEPS timed steps, default 10) under native PyTorch, gmem with GMEM_MAP_AHEAD=off and gmem with
# it on, taking turns, twice; then each set (time, reserved, maps, maps made ahead).
set -u
model=${1:-llama}
steps=${2:-10}
dir=${OUT:-/tmp}
o=$dir/map-ahead-ab.jsonl
source bench/torch/build_gpu.sh || exit 1
for i in 1 2; do
  for which in native off on; do
    if [ "$which" = native ]; then
      run=(env -u GMEM_MAP_AHEAD python3 bench/torch/train_bench.py --allocator native)
    else
      run=(env GMEM_MAP_AHEAD=$which python3 bench/torch/train_bench.py --allocator gmem)
    fi
    timeout 300 "${run[@]}" --model "$model" --steps "$steps" --out "$o.$which" >/dev/null ||
      echo "FAILED $which $model"
  done
done
for which in native off on; do echo "== $which"; python3 bench/torch/train_bench.py --show "$o.$which"; done
