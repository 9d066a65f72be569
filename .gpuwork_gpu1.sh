set -x
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DGMEM_WITH_CUDA=ON -DGMEM_BUILD_BENCH=OFF -DGMEM_BUILD_TESTS=OFF >/dev/null && cmake --build build-gpu -j16 --target gmem_shared gmem_cli >/dev/null || exit 1
export GMEM_LIBRARY=$PWD/build-gpu/libgmem.so GMEM_CACHE_DIR=$PWD/build-gpu/gmem-cache PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
unset GMEM_DEVICE
# build the allocator once
python3 -c "import gmem.torch; gmem.torch.enable(); import torch; torch.empty(1,device='cuda'); print(gmem.torch.mode())"
for c in inference_leak kept_loss batch_too_large fragmentation; do
  (time python3 examples/oom_causes.py $c > $OUT/$c.txt 2> $OUT/$c.err) 2> $OUT/$c.time &
done
wait
for c in inference_leak kept_loss batch_too_large fragmentation; do echo "== $c"; head -4 $OUT/$c.txt; tail -3 $OUT/$c.err; grep real $OUT/$c.time; done
timeout 200 python3 bench/torch/graph_tracking_bench.py --out $OUT/graph_bench.jsonl
cd tests/python && timeout 300 python3 -m unittest -v test_torch_gpu.DiagnosticsOnGpuTest 2>&1 | tail -40
