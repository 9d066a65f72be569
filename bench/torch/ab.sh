#!/usr/bin/env bash
# bench/torch/ab.sh BASE_DIR PROGRAM... (GPU machine, repository root; results under $OUT or
# /tmp): each program (train_bench.py's models) under gmem built from BASE_DIR (an earlier tree,
# e.g. `git archive REV | tar x -C BASE_DIR`) and from this tree, alternating, twice, 4 warm-up
# and 8 timed steps each; then both sets side by side (time, reserved, maps, host waits).
set -u
base=$1
shift
dir=${OUT:-/tmp}
o=$dir/ab.jsonl
(cd "$base" && source bench/torch/build_gpu.sh) || exit 1
source bench/torch/build_gpu.sh
new_library=$GMEM_LIBRARY
for i in 1 2; do
  for which in base new; do
    lib=$new_library
    [ "$which" = base ] && lib=$PWD/$base/build-gpu/libgmem.so
    for program in "$@"; do
      GMEM_LIBRARY=$lib GMEM_AB=$which timeout 200 python3 bench/torch/train_bench.py --model "$program" \
        --allocator gmem --warmup 4 --steps 8 --out "$o.$which" >/dev/null || echo "FAILED $which $program"
    done
  done
done
for which in base new; do echo "== $which"; python3 bench/torch/train_bench.py --show "$o.$which"; done
