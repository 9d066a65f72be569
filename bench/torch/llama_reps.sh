#!/usr/bin/env bash
# The Llama run of train_bench.py (60 timed steps) under native PyTorch, gmem with step marks and
# gmem without, alternated REPS times (default 3), one process each: processes of one allocator
# differ by several percent on an H100, so one run per allocator does not settle a difference.
# Run on the GPU machine from the repository root; records go to $OUT/reps.jsonl (OUT defaults to
# build-gpu/llama-reps), and a line per run is printed: total, the second timed step (where plans
# are first followed and the plan region mapped) and the others.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-build-gpu/llama-reps}
mkdir -p "$OUT"
source bench/torch/build_gpu.sh
run() {  # allocator, GMEM_PLAN_STEPS
  GMEM_PLAN_STEPS=$2 python3 bench/torch/train_bench.py --model llama --allocator "$1" --steps 60 \
    --out "$OUT/reps.jsonl" >/dev/null 2>&1 || echo "FAILED $1 (GMEM_PLAN_STEPS=$2)"
}
for _ in $(seq "${REPS:-3}"); do
  run native 1
  run gmem 1
  run gmem 0
done
OUT=$OUT python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "reps.jsonl")):
    r = json.loads(line)
    steps = r.get("step_ms", [])
    marks = r.get("plan", {}).get("steps_marked", 0) if r["allocator"] == "gmem" else "-"
    if len(steps) < 2:
        print(r["allocator"], "no timed steps:", r.get("error") or r.get("oom_message"))
        continue
    print("%-7s marks %-3s total %6.0f ms  step 2 %4.0f ms  others %6.0f ms  reserved/allocated %s"
          % (r["allocator"], marks, r["total_ms"], steps[1], sum(steps) - steps[1],
             r.get("reserved_ratio")))
PY
