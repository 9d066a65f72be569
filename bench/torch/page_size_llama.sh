#!/usr/bin/env bash
# Live Llama (train_bench's checkpointed, varying-length run) under native and under gmem at
# several page sizes (GMEM_PAGE_SIZE), alternated for ROUNDS rounds of STEPS timed steps each;
# prints each run's total time, the slowest step, reserved / allocated and the maps made after
# warm-up. docs/notes/2026-11-24-page-size-the-driver-prices-a-call-per-chunk-not-per-byte.md. Run on the GPU machine from the repository root:
#   STEPS=10 ROUNDS=2 SIZES="2M 4M 8M" bench/torch/page_size_llama.sh  (results under $OUT or /tmp)
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}/page_size_llama.jsonl
source bench/torch/build_gpu.sh
unset PYTORCH_CUDA_ALLOC_CONF GMEM_DEVICE
for round in $(seq "${ROUNDS:-2}"); do
  python3 bench/torch/train_bench.py --model llama --allocator native --steps "${STEPS:-10}" --out "$out" >/dev/null || echo "FAILED native"
  for size in ${SIZES:-2M 4M 8M}; do
    GMEM_PAGE_SIZE=$size python3 bench/torch/train_bench.py --model llama --allocator gmem --steps "${STEPS:-10}" --out "$out" >/dev/null || echo "FAILED gmem $size"
  done
done
python3 - "$out" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    steps = r.get("step_ms") or []
    page = f"{r['page_size'] >> 20}M" if r.get("page_size") else ""  # train_bench: gmem's page
    print(f"{r['allocator']:7} {page:4} total {r.get('total_ms', 0):7.0f} ms  slowest {max(steps) if steps else 0:6.0f} ms  "
          f"reserved/allocated {r.get('reserved_ratio')}  maps after warm-up {r.get('maps_after_warmup')}")
    print("   steps", steps)
PY
