#!/usr/bin/env bash
# Replays every trace as gmem.torch would run its program: training marked at its optimizer step
# (the line of optimizer.step() in the capturing script, where gmem.torch marks steps; traces
# whose line is not known here are marked where live memory falls back to its baseline), serving
# and generation unmarked (they have no optimizer, so nothing marks them). One line a trace:
# reserved and smallest cap over peak allocated, device calls in the second half and modelled
# device ms a step there, and the calls made in new steps / steps seen once before / steps seen
# twice or more (`gmem replay --steps`), and the share of the buffers the trace's allocator made
# anew in their place (same address, same size) that gmem put back in theirs too. The figures
# of the notebook's tables (docs/notes/) and the closing notes come from here.
#   bench/replay_traces.sh [GMEM_BINARY]   (tests/data, then bench/data's traces that miss the
#   target, then held-out traces from $HELDOUT, default .gpuwork/heldout, those of a name already
#   replayed left out; more replay options from $REPLAY_ARGS, e.g. REPLAY_ARGS=--map-ahead)
# Two runs side by side, trace by trace, with the totals: bench/compare_replays.py BEFORE AFTER.
set -u
cd "$(dirname "$0")/.."
gmem=${1:-build/gmem}
heldout=${HELDOUT:-.gpuwork/heldout}
# trace name -> how its program is marked (a --step-at frame, "minima" or "unmarked"). The
# models.py:LINE frames are lines of bench/torch/models.py as it was when the traces of tests/data,
# bench/data and the held-out ones of then were captured; they stay as they are.
marks() {
  case $1 in
    deeplab_varsize) echo capture2.py:31 ;;
    llama_rounds) echo models.py:168 ;;
    moe|t5_varlen|bert_varlen|gpt2_compiled|lora_llama|gpt2_dynamic|unet|convnext_multiscale|vit) echo models.py:39 ;;
    gnn_random|lstm_varlen|gpt2_cudagraphs|cudagraphs_varlen) echo models.py:39 ;;
    dlrm_sparse) echo models.py:971 ;;  # dense.step(), the second of its two optimizer steps
    gpt2_accum) echo models.py:424 ;;
    empty_cache_varlen) echo models.py:39 ;;
    amp_scaler) echo models.py:1295 ;;  # scaler.step(optimizer)
    distill) echo models.py:40 ;;  # SGD allocates nothing after its first step: zero_grad's frees
    ddp_train|fsdp_train|rollout_train|clip_train|bert_mlm|fsdp2_varlen) echo models.py:39 ;;
    eval_collect) echo models.py:40 ;;  # SGD, as distill
    ema_train) echo models.py:1548 ;;  # its own optimizer.step()
    fabric_train) echo models.py:1627 ;;  # its own optimizer.step()

    gpt2_generate|bert_serve|llama_generate|bert_large_serve|llama_serve_1b|diffusion_sample|tiny_leak|graph_serve|beam_generate|threads_serve|compile_serve|static_generate) echo unmarked ;;
    weights_stream_serve|continuous_batching) echo unmarked ;;
    *) echo minima ;;
  esac
}
# The frame that ends a training step of a program captured from bench/torch/models/ (step_frame)
step_frame() {
  python3 -c 'import sys; sys.path.insert(0, "bench/torch"); import models
print(models.step_frame(sys.argv[1]))' "$1"
}
seen=" "
for f in tests/data/*.trace.csv.gz bench/data/*.trace.csv.gz "$heldout"/*.trace.csv.gz; do
  [ -f "$f" ] || continue
  name=$(basename "$f" .trace.csv.gz)
  case $seen in *" $name "*) continue ;; esac
  seen="$seen$name "
  how=$(marks "$name")
  case $how in
    models.py:*)  # captured since bench/torch/models.py became the package bench/torch/models/,
      # a trace names no frame of models.py: its program's mark is the same statement, found in
      # the code as it is now (models.STEP_ENDS, models.step_frame)
      zcat "$f" 2>/dev/null | grep -q -m1 ',models\.py:' || how=$(step_frame "$name") ;;
  esac
  case $how in
    unmarked) args=(--no-plan) ;;
    minima) args=() ;;
    *) args=(--step-at "$how") ;;
  esac
  # shellcheck disable=SC2086
  "$gmem" replay --json --steps ${REPLAY_ARGS:-} "${args[@]}" "$f" | python3 -c '
import json, sys
r = json.load(sys.stdin)
calls = r.get("device_calls_by_times_seen", [0, 0, 0])
ms = r["device_ms_per_step"]
kept = 100.0 * r["same_place_kept"] / r["same_place_recorded"] if r["same_place_recorded"] else 100.0
print("%-20s %-15s reserved %.3f  cap %.3f  late calls %6d  ms/step %6.2f  calls new/once/twice %d/%d/%d"
      "  same place %5.1f%%"
      % (r["trace"], sys.argv[1], r["reserved_ratio"], r["min_capacity_ratio"], r["late_device_calls"],
         ms if ms is not None else 0.0, *calls, kept))' "$how"
done
