#!/usr/bin/env bash
# bench/torch/handovers_ab.sh (GPU machine, repository root; results under $OUT): threads_serve under gmem with stream handovers on and off, alternating; then static_generate
# and compile_serve under the three allocators.
source bench/torch/build_gpu.sh
o=$OUT/handovers.jsonl
for i in 1 2; do
  for h in on off; do
    GMEM_STREAM_HANDOVERS=$h timeout 150 python3 bench/torch/train_bench.py --model threads_serve --allocator gmem --warmup 4 --steps 8 --out $o >/dev/null || echo "FAILED $h"
  done
done
python3 bench/torch/train_bench.py --all --models static_generate compile_serve --warmup 4 --steps 8 --timeout 200 --out $OUT/heldout.jsonl >/dev/null || echo FAILED
python3 bench/torch/train_bench.py --show $o $OUT/heldout.jsonl
