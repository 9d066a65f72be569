#!/usr/bin/env bash
# bench/torch/held_frees_ab.sh BASE_DIR (GPU machine, repository root; results under $OUT): the
# programs whose side stream's blocks the compute stream holds (record_stream: streamed weights,
# a prefetched batch) under gmem built from BASE_DIR (an earlier tree) and from this one,
# alternating, twice. docs/engine.md, "Frees held for other streams".
set -u
base=$1
o=$OUT/held_frees.jsonl
(cd "$base" && source bench/torch/build_gpu.sh) || exit 1
source bench/torch/build_gpu.sh
new_library=$GMEM_LIBRARY
for i in 1 2; do
  for which in base new; do
    lib=$new_library
    [ $which = base ] && lib=$PWD/$base/build-gpu/libgmem.so
    for program in weights_stream_serve prefetch_train; do
      GMEM_LIBRARY=$lib GMEM_AB=$which timeout 200 python3 bench/torch/train_bench.py --model $program \
        --allocator gmem --warmup 4 --steps 8 --out $o.$which >/dev/null || echo "FAILED $which $program"
    done
  done
done
for which in base new; do echo "== $which"; python3 bench/torch/train_bench.py --show $o.$which; done
