#!/usr/bin/env bash
# The fit benchmark on a GPU machine, in two calls of under ten minutes:
#   bench/torch/fit_suite.sh models      gmem.fit_batch_size on GPT-2 (with the what-if table),
#                                        ResNet-50 and Llama, each under 16 and 24 GiB caps
#   bench/torch/fit_suite.sh lightning   Lightning's BatchSizeFinder (binsearch) under PyTorch's
#                                        allocator and under gmem, and gmem's FitBatchSize, on
#                                        GPT-2 under a 24 GiB cap
# JSON lines go to $OUT/fit.jsonl (or build-gpu/fit.jsonl); bench/torch/fit_report.py tables them.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
source bench/torch/build_gpu.sh
export GMEM_CACHE_DIR=$PWD/build-gpu/gmem-cache PYTHONUNBUFFERED=1
out=${OUT:-build-gpu}/fit.jsonl
python=${PYTHON:-python3}
status=0
case "${1:-models}" in
  models)
    for model in gpt2 resnet50 llama; do
      extra=(); [ "$model" = gpt2 ] && extra=(--what-if)
      timeout 200 "$python" bench/torch/fit_bench.py "$model" --caps "${CAPS:-16,24}" \
        --out "$out" "${extra[@]}" || { echo "fit_bench $model: exit $?"; status=1; }
    done ;;
  lightning)
    GMEM=0 timeout 150 "$python" bench/torch/fit_lightning.py --finder lightning --cap 24 --out "$out" || status=1
    timeout 150 "$python" -m gmem.run bench/torch/fit_lightning.py --finder lightning --cap 24 --out "$out" || status=1
    timeout 150 "$python" -m gmem.run bench/torch/fit_lightning.py --finder gmem --cap 24 --out "$out" || status=1
    ;;
  *) echo "usage: $0 [models|lightning]"; exit 2 ;;
esac
"$python" bench/torch/fit_report.py "$out" || status=1
exit $status
