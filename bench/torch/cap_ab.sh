#!/usr/bin/env bash
# bench/torch/cap_ab.sh OLD_OVERLAY RATIO MODEL... (GPU machine, repository root; results under
# $OUT or /tmp): each MODEL of train_bench.py under gmem (defaults: map-ahead on) capped at RATIO
# times its peak allocated (PEAK_<model> in bytes from the environment, else a native run first),
# twice, alternating this tree with a copy of it whose files are replaced by those under
# OLD_OVERLAY (the same paths: e.g. the engine files of an earlier commit). Prints each run's
# median step, reserved / allocated and whether it ran out of memory.
set -u
overlay=$1 ratio=$2
shift 2
dir=${OUT:-/tmp}
root=$PWD
source bench/torch/build_gpu.sh || exit 1
new_lib=$GMEM_LIBRARY
old=/tmp/cap-ab-old
rm -rf "$old" && mkdir -p "$old" && tar -c --exclude='./build*' --exclude=./.git . | tar -x -C "$old"
cp -r "$overlay"/. "$old"/
(cd "$old" && cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DGMEM_WITH_CUDA=ON \
  -DGMEM_BUILD_BENCH=OFF -DGMEM_BUILD_TESTS=OFF >/dev/null && cmake --build build-gpu -j16 --target gmem_shared >/dev/null) ||
  { echo "OLD BUILD FAILED"; exit 1; }
old_lib=$old/build-gpu/libgmem.so
for model in "$@"; do
  var=PEAK_$model
  peak=${!var:-}
  if [ -z "$peak" ]; then
    python3 bench/torch/train_bench.py --model "$model" --allocator native --out "$dir/cap-ab-$model-native.jsonl" >/dev/null
    peak=$(python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])['peak_allocated'])" "$dir/cap-ab-$model-native.jsonl")
  fi
  cap=$(python3 -c "print(int($ratio * $peak))")
  for i in 1 2; do
    for which in old new; do
      lib=$new_lib
      [ "$which" = old ] && lib=$old_lib
      GMEM_LIBRARY=$lib timeout 300 python3 bench/torch/train_bench.py --model "$model" --allocator gmem \
        --cap-bytes "$cap" --out "$dir/cap-ab-$model-$which.jsonl" >/dev/null || echo "FAILED $which $model"
    done
  done
  for which in old new; do
    echo "== $model $which (cap $cap bytes, $ratio x $peak)"
    python3 - "$dir/cap-ab-$model-$which.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print("  median %s ms, reserved/allocated %s, oom %s %s" % (r.get("median_ms"), r.get("reserved_ratio"),
          r.get("oom", False), (r.get("oom_message") or "")[:160]))
PY
  done
done
