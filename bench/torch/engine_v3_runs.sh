#!/usr/bin/env bash
# Issue #56 item 5, what the next engine is measured against, in one call on a machine of two
# GPUs or more (H200 x2): models.bert_mlm_step (BERT-base masked LM, 16 x 512, bf16 autocast,
# AdamW) and fsdp2_varlen (a 1.1B transformers Llama under FSDP2, lengths drawn per step).
#
#   1. builds build-gpu/libgmem.so (build_gpu.sh) and gmem's PyTorch allocator (cached)
#   2. bert_mlm live, one process each (train_bench.py): native, expandable segments, gmem with
#      its default step marks, gmem without (GMEM_PLAN_STEPS=0); BERT_WARMUP + BERT_STEPS steps
#      (default 5 + 95): reserved / allocated, median step, gmem's maps step by step
#   3. fsdp2_varlen on 2 GPUs (fsdp2_bench.py): native, expandable, gmem; FSDP_WARMUP +
#      FSDP_STEPS steps (default 3 + 20): median and total per rank, reserved / allocated, maps
#      and host time in the driver's memory calls step by step
#   4. the traces, under the native allocator: bert_mlm (capture_traces.py, 80 steps, on the
#      second GPU while step 2 runs on the first) and fsdp2_varlen's rank 0 (fsdp2_bench.py --capture), each trimmed at a step's mark to under
#      TRACE_MAX bytes (default 15 MiB) when larger (capture_traces.py trim)
#   5. while the budget (BUDGET s, default 480) allows, fsdp2_varlen again in the reverse order
#      (gmem, expandable, native): runs of one allocator differ by a few percent
# SKIP_BERT=1 leaves out 2. and bert_mlm's trace.
#
# Files under $OUT (default /tmp/engine-v3): bert-mlm.jsonl, fsdp2-varlen.jsonl (train_bench's,
# fsdp2_bench's and the captures' JSON lines), bert_mlm.trace.csv.gz, fsdp2_varlen.trace.csv.gz,
# table.txt (printed last), log.txt. From the repository root:   bench/torch/engine_v3_runs.sh
set -u
cd "$(dirname "$0")/../.."
dir=${OUT:-/tmp/engine-v3}
mkdir -p "$dir"
budget=${BUDGET:-480}
start=$(date +%s)
log=$dir/log.txt
bert=$dir/bert-mlm.jsonl
fsdp=$dir/fsdp2-varlen.jsonl
elapsed() { echo $(( $(date +%s) - start )); }
say() { echo "[v3 $(elapsed)s] $*" | tee -a "$log"; }
unset PYTORCH_CUDA_ALLOC_CONF GMEM_DEVICE GMEM_PLAN_STEPS
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export GMEM_CACHE_DIR=$PWD/build-gpu/gmem-cache  # gmem's PyTorch allocator, compiled once

say "build"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DGMEM_WITH_CUDA=ON -DGMEM_BUILD_BENCH=OFF \
  -DGMEM_BUILD_TESTS=OFF >>"$log" 2>&1 && cmake --build build-gpu -j16 --target gmem_shared >>"$log" 2>&1 \
  || { say "BUILD FAILED"; tail -40 "$log"; exit 1; }
source bench/torch/build_gpu.sh  # built: sets GMEM_LIBRARY and PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$log" 2>&1
python3 -c "import torch, gmem._shim as s; print('torch', torch.__version__, 'gmem allocator', s.load_allocator(torch).path)" >>"$log" 2>&1 \
  || say "gmem's PyTorch allocator did not build: gmem runs take the pluggable route"
say "built"

if [ -z "${SKIP_BERT:-}" ]; then
  # bert_mlm's trace on the second GPU meanwhile (its times are no result)
  say "capture bert_mlm on GPU 1, in the background"
  CUDA_VISIBLE_DEVICES=1 python3 bench/torch/capture_traces.py --programs bert_mlm --timeout 200 \
    --out-dir "$dir" --out "$dir/bert-capture.jsonl" >"$dir/capture.log" 2>&1 &
  capture=$!
  say "bert_mlm live on GPU 0: native, expandable, gmem"
  CUDA_VISIBLE_DEVICES=0 python3 bench/torch/train_bench.py --all --models bert_mlm --warmup "${BERT_WARMUP:-5}" \
    --steps "${BERT_STEPS:-95}" --timeout 180 --out "$bert" >>"$log" 2>&1 || say "FAILED: a bert_mlm run"
  say "bert_mlm live: gmem without step marks"
  CUDA_VISIBLE_DEVICES=0 GMEM_PLAN_STEPS=0 python3 bench/torch/train_bench.py --all --models bert_mlm --allocators gmem \
    --warmup "${BERT_WARMUP:-5}" --steps "${BERT_STEPS:-95}" --timeout 180 --out "$bert" >>"$log" 2>&1 \
    || say "FAILED: bert_mlm under gmem without marks"

  wait "$capture" || say "FAILED: bert_mlm capture"
  cat "$dir/bert-capture.jsonl" >>"$bert" 2>/dev/null
  cat "$dir/capture.log" >>"$log"
  rm -f "$dir/bert-capture.jsonl" "$dir/capture.log"
else
  say "bert_mlm skipped (SKIP_BERT)"
fi

fsdp_args=(--gpus 2 --warmup "${FSDP_WARMUP:-3}" --steps "${FSDP_STEPS:-20}" --timeout 240 --out "$fsdp")
say "fsdp2_varlen: native, expandable, gmem"
python3 bench/torch/fsdp2_bench.py "${fsdp_args[@]}" --runs native,expandable,gmem >>"$log" 2>&1 \
  || say "FAILED: an fsdp2_varlen run"

say "capture fsdp2_varlen (rank 0)"
python3 bench/torch/fsdp2_bench.py "${fsdp_args[@]}" --capture "$dir" >>"$log" 2>&1 \
  || say "FAILED: fsdp2_varlen capture"

# Trims a trace larger than TRACE_MAX at the mark of the last step that keeps it under (the full
# one goes to /tmp); the trim's line joins the JSON lines.
trim() {  # trace, jsonl, kind of the capture's record
  local trace=$1
  [ -f "$trace" ] || return
  local size
  size=$(stat -c %s "$trace")
  (( size <= ${TRACE_MAX:-15728640} )) && return
  local mark
  mark=$(python3 - "$2" "$3" "$size" "${TRACE_MAX:-15728640}" <<'PY'
import json, sys
path, kind, size, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
records = [json.loads(l) for l in open(path) if l.startswith("{")]
if kind == "capture":
    marks = [s["end_us"] for r in records if r.get("kind") == "capture" and r.get("allocator") == "native" for s in r["per_step"]]
else:
    marks = [m for r in records if r.get("kind") == "fsdp2" and r.get("run") == "c" and r.get("rank") == 0 for m in r["end_us"]]
keep = max(1, int(len(marks) * limit * 0.95 / size))
print(marks[keep - 1])
PY
)
  [ -n "$mark" ] || { say "trim: no step marks for $trace"; return; }
  mv "$trace" "/tmp/full-$(basename "$trace")"
  python3 bench/torch/capture_traces.py trim "/tmp/full-$(basename "$trace")" "$trace" \
    --before-us "$mark" >>"$2" 2>>"$log"
  say "trimmed $(basename "$trace") from $size to $(stat -c %s "$trace") bytes at $mark"
}
trim "$dir/bert_mlm.trace.csv.gz" "$bert" capture
trim "$dir/fsdp2_varlen.trace.csv.gz" "$fsdp" fsdp2

if (( $(elapsed) < budget - 150 )); then
  say "fsdp2_varlen again: gmem, expandable, native"
  python3 bench/torch/fsdp2_bench.py "${fsdp_args[@]}" --runs gmem,expandable,native --run-base 3 \
    >>"$log" 2>&1 || say "FAILED: an fsdp2_varlen repeat"
else
  say "no time left for the fsdp2_varlen repeats"
fi

python3 - "$bert" "$fsdp" <<'PY' | tee "$dir/table.txt"
import json, statistics, sys
sys.path.insert(0, "bench/torch")
GiB = 2.0 ** 30

def records(path):
    try:
        return [json.loads(l) for l in open(path) if l.startswith("{")]
    except OSError:
        return []

def last_map(maps):
    mapped = [i for i, n in enumerate(maps) if n]
    return mapped[-1] if mapped else None

def per_ten(values):
    return [sum(values[i:i + 10]) for i in range(0, len(values), 10)]

print("bert_mlm (16 x 512, BERT-base MLM, bf16 autocast, AdamW), one process each; steps from 0, warm-up included")
for r in records(sys.argv[1]):
    if r.get("kind") == "capture":
        if "error" in r:
            print("  capture %s FAILED: %s" % (r["allocator"], r["error"]))
        else:
            print("  capture %s: %d steps, %d events, %.1f MiB, reserved / allocated %.3f (%.2f / %.2f GiB)" % (
                r["allocator"], r["steps"], r.get("events", 0), r.get("trace_bytes", 0) / 2**20,
                r["reserved_ratio"], r["peak_reserved"] / GiB, r["peak_allocated"] / GiB))
        continue
    if r.get("kind") != "train":
        if "kept" in r:
            print("  trimmed trace: %d events kept, %.1f MiB" % (r["kept"], r["bytes"] / 2**20))
        continue
    name = r["allocator"]
    if name == "gmem":
        name += " marks" if r.get("plan", {}).get("steps_marked") else " no marks"
    if "error" in r or "median_ms" not in r:
        print("  %-16s FAILED: %s" % (name, r.get("error") or r.get("oom_message")))
        continue
    print("  %-16s reserved / allocated %.4f (%.2f / %.2f GiB)  median %.1f ms  total %.0f ms (%d timed)" % (
        name, r["reserved_ratio"], r["peak_reserved"] / GiB, r["peak_allocated"] / GiB,
        r["median_ms"], r["total_ms"], r["steps"]))
    if "step_maps" in r:
        maps = r["step_maps"]
        print("      maps %d, after warm-up %d, last step that mapped: %s of %d; driver calls %.0f ms" % (
            sum(maps), r.get("maps_after_warmup") or 0, last_map(maps), len(maps),
            sum(r.get("step_call_us", [])) / 1e3))
        print("      maps per 10 steps", per_ten(maps))
        print("      maps per step", maps)

print()
print("fsdp2_varlen (1.1B Llama, FSDP2, 2 GPUs, batch 8 a rank, lengths 256..2048 drawn per step)")
rows = records(sys.argv[2])
import fsdp2_bench
print(fsdp2_bench.show(rows))
by = {}
for r in rows:
    if r.get("kind") == "fsdp2" and "error" not in r and r.get("run") != "c":
        by.setdefault(r["allocator"], []).append(r)
print("  per allocator, over its runs and ranks: total of the timed steps (mean, each), median step, reserved / allocated")
native = None
for name in ("native", "expandable", "gmem", "gmem-nomarks"):
    rs = by.get(name)
    if not rs:
        continue
    mean = statistics.mean(r["total_ms"] for r in rs)
    native = native or (mean if name == "native" else None)
    rel = " (%.3f x native)" % (mean / native) if native else ""
    print("  %-12s total %.0f ms%s  each %s  median %.1f ms  reserved / allocated %s" % (
        name, mean, rel, [round(r["total_ms"]) for r in rs],
        statistics.median(r["median_ms"] for r in rs), sorted({r["reserved_ratio"] for r in rs})))
    for r in rs:
        if "step_maps" in r and r["rank"] == 0:
            print("      run %s rank 0 maps per step %s" % (r["run"], r["step_maps"]))
            print("      run %s rank 0 driver calls ms per step %s" % (
                r["run"], [round(u / 1e3) for u in r["step_call_us"]]))
PY
ls -la "$dir" >>"$log"
say "done"
