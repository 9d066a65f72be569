#!/usr/bin/env bash
# The clash rule's purchases taken away one part at a time: each variant edits a constant of
# src/engine/clash_rule.hpp, rebuilds, replays every trace (bench/replay_traces.sh) and compares
# with the default; the file is restored at the end. Figures of docs/notes/2026-11-28-what-the-misses-are-made-of.md. Needs a Release build in build/ (README); about a minute.
#   bench/sim/clash_rule_ablation.sh > bench/results/DATE-vm-clash-rule-ablation.txt
set -u
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
keep=$tmp/clash_rule.hpp
cp src/engine/clash_rule.hpp "$keep"
trap 'cp "$keep" src/engine/clash_rule.hpp; cmake --build build -j2 >/dev/null 2>&1; rm -rf "$tmp"' EXIT
cmake --build build -j2 >/dev/null 2>&1; bash bench/replay_traces.sh > "$tmp"/abl_default.txt
run() {
  cp "$keep" src/engine/clash_rule.hpp
  for e in "${@:2}"; do sed -i "$e" src/engine/clash_rule.hpp; done
  cmake --build build -j2 >/dev/null 2>&1
  bash bench/replay_traces.sh > "$tmp"/abl_$1.txt
  echo; echo "== $1: ${*:2}"
  python3 bench/compare_replays.py "$tmp"/abl_default.txt "$tmp"/abl_$1.txt --changed
}
echo "== default (HEAD $(git rev-parse --short HEAD))"; cat "$tmp"/abl_default.txt
run no_cost_growth 's/kMinShare = 8;/kMinShare = 100;/'
run no_fixed_pages 's/kPages = 4;/kPages = 0;/'
run both 's/kMinShare = 8;/kMinShare = 100;/' 's/kPages = 4;/kPages = 0;/'
run buy_at_8th_clash 's/kClashesToBuy = 3;/kClashesToBuy = 7;/'
run no_purchases 's/kClashesToBuy = 3;/kClashesToBuy = 1000000;/'
