#!/usr/bin/env bash
# Live: each training step followed by torch.cuda.empty_cache(), as many programs do (timed with
# the step), for MODELS (default: gpt2 resnet50) under each of ALLOCS (default: native expandable
# gmem gmemstrict; also gmem8, gmem at 8 MiB pages), STEPS timed steps (default 8) after 3 of
# warm-up. gmemstrict is gmem with GMEM_EMPTY_CACHE=strict: every call gives back everything.
# Run on the GPU machine; records in $OUT/empty_cache.jsonl (bench/results/*-empty-cache.jsonl).
cd "$(dirname "$0")/../.." || exit 1
source bench/torch/build_gpu.sh
unset PYTORCH_CUDA_ALLOC_CONF GMEM_DEVICE GMEM_EMPTY_CACHE GMEM_PAGE_SIZE
OUT=${OUT:-build-gpu/empty-cache}
mkdir -p "$OUT"
for model in ${MODELS:-gpt2 resnet50}; do
  for variant in ${ALLOCS:-native expandable gmem gmemstrict}; do
    allocator=$variant settings=()
    case $variant in
      gmemstrict) allocator=gmem settings=(GMEM_EMPTY_CACHE=strict) ;;
      gmem8) allocator=gmem settings=(GMEM_PAGE_SIZE=8M) ;;
    esac
    if ! env "${settings[@]}" python3 bench/torch/train_bench.py --model "$model" \
        --allocator "$allocator" --steps "${STEPS:-8}" --warmup 3 --empty-cache \
        --out "$OUT/$variant.jsonl" > /dev/null 2> "$OUT/err.txt"; then
      echo "$model $variant FAILED"; tail -3 "$OUT/err.txt"; continue
    fi
    grep -a "gmem: empty_cache()" "$OUT/err.txt" | head -1
    python3 - "$OUT/$variant.jsonl" "$variant" "$OUT/empty_cache.jsonl" <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])][-1]
r["variant"] = sys.argv[2]
open(sys.argv[3], "a").write(json.dumps(r, sort_keys=True) + "\n")
print(r["model"], sys.argv[2], "reserved/allocated %.4f, median %.1f ms, steps %s, maps after warm-up %s"
      % (r["reserved_ratio"], r.get("median_ms", 0), r.get("step_ms"), r.get("maps_after_warmup")))
PY
  done
done
