"""Allocation speed: gmem vs PyTorch's caching allocator vs cudaMallocAsync, all driven by the
same C++ loops (alloc_bench.cpp, compiled here against the installed torch) in one process.

    GMEM_LIBRARY=build-gpu/libgmem.so python3 bench/torch/alloc_bench.py [--out FILE]
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/torch/alloc_bench.py --only torch

Prints one JSON line: nanoseconds per malloc+free pair (4 KiB, 16 MiB) and per churn op (free a
random one of 1000 live blocks, allocate a new size log-uniform in 512 B..64 MiB; 100k ops
timed after 100k ops of warm-up). With gmem, also "gmem_tracked": the same loops with
gmem.enable_tracking() on, alternated with untracked runs (medians of 7 each, pairs 10x longer), and
"tracking_overhead": tracked / untracked per loop.
"""

import argparse
import statistics
import ctypes
import glob
import os
import shutil
import subprocess
import sys

import torch

from common import HERE, REPO, emit, import_gmem

BACKENDS = {"torch": 0, "gmem": 1, "cudaMallocAsync": 2}
PAIR_SIZES = {"pair_4KiB": 4 << 10, "pair_16MiB": 16 << 20}


def cuda_paths():
    """(include dir with cuda_runtime_api.h, path of libcudart to link)."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots.append("/usr/local/cuda")
    for root in filter(None, roots):
        include = os.path.join(root, "include")
        libs = sorted(glob.glob(os.path.join(root, "lib64", "libcudart.so*")) +
                      glob.glob(os.path.join(root, "targets", "*", "lib", "libcudart.so*")))
        if os.path.isfile(os.path.join(include, "cuda_runtime_api.h")) and libs:
            return include, libs[0]
    raise SystemExit("alloc_bench: CUDA toolkit not found (set CUDA_HOME)")


def build(build_dir):
    torch_dir = os.path.dirname(torch.__file__)
    include, cudart = cuda_paths()
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    os.makedirs(build_dir, exist_ok=True)
    out = os.path.join(build_dir, "libgmem_alloc_bench.so")
    source = os.path.join(HERE, "alloc_bench.cpp")
    if os.path.isfile(out) and os.path.getmtime(out) > os.path.getmtime(source):
        return out
    cxx = os.environ.get("CXX") or "c++"
    log = ""
    for std in ("c++17", "c++20"):
        cmd = [cxx, "-std=" + std, "-O2", "-shared", "-fPIC", "-D_GLIBCXX_USE_CXX11_ABI=%d" % abi,
               "-isystem", os.path.join(torch_dir, "include"), "-isystem", include, source,
               "-o", out, "-L" + os.path.join(torch_dir, "lib"), "-lc10", "-lc10_cuda", cudart,
               "-Wl,-rpath," + os.path.join(torch_dir, "lib")]
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                universal_newlines=True)
        if result.returncode == 0:
            return out
        log = result.stdout
    raise SystemExit("alloc_bench: build failed:\n%s" % log[-4000:])


def tracking_cost(bench, gmem, args, rounds=7):
    """gmem's loops without and with tracking (its default history), alternated: the difference
    is a few ns, less than the machine drifts over a run."""
    def loops():
        row = {key: bench.gmem_bench_pair(1, size, 10 * args.pair_iterations)
               for key, size in PAIR_SIZES.items()}
        row["churn"] = bench.gmem_bench_churn(1, 1000, args.churn_ops, 512, 64 << 20, 12345)
        return row

    # "gmem_tracked": the engine's tracking, call sites from the thread's frames; "gmem_pystacks":
    # Python call sites too (the default from Python: libgmem takes the GIL and reads the
    # calling thread's stack at each malloc; the loops run on the Python thread).
    plain, tracked, pystacks = [], [], []
    for _ in range(rounds):
        plain.append(loops())
        for stacks, out in (("thread", tracked), ("python", pystacks)):
            gmem.enable_tracking(stacks=stacks)
            try:
                out.append(loops())
            finally:
                gmem.disable_tracking()

    def medians(runs):
        return {key: statistics.median(r[key] for r in runs) for key in plain[0]}
    base, t, py = medians(plain), medians(tracked), medians(pystacks)
    return {"gmem_tracked": {key: round(v, 1) for key, v in t.items()},
            "gmem_pystacks": {key: round(v, 1) for key, v in py.items()},
            "tracking_overhead": {key: round(t[key] / base[key], 3) for key in base},
            "pystacks_overhead": {key: round(py[key] / base[key], 3) for key in base}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--only", choices=sorted(BACKENDS), action="append")
    parser.add_argument("--build-dir", default=os.path.join(REPO, "build-gpu", "torch-bench"))
    parser.add_argument("--pair-iterations", type=int, default=20000)
    parser.add_argument("--churn-ops", type=int, default=100000)
    args = parser.parse_args()

    torch.cuda.init()
    torch.empty(1, device="cuda")  # contexts and the caching allocator up before timing
    bench = ctypes.CDLL(build(args.build_dir))
    bench.gmem_bench_bind.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    bench.gmem_bench_pair.restype = ctypes.c_double
    bench.gmem_bench_pair.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    bench.gmem_bench_churn.restype = ctypes.c_double
    bench.gmem_bench_churn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_size_t,
                                       ctypes.c_size_t, ctypes.c_uint]
    backends = args.only or sorted(BACKENDS)
    gmem = None
    if "gmem" in backends:
        gmem = import_gmem()
        from gmem import _lib

        bench.gmem_bench_bind(_lib.address_of("gmem_malloc"), _lib.address_of("gmem_free"))

    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    results = {}
    for name in backends:
        label = name
        if name == "torch":
            label = "torch_expandable" if "expandable_segments:True" in conf else "torch"
        row = {}
        for key, size in PAIR_SIZES.items():
            row[key] = round(bench.gmem_bench_pair(BACKENDS[name], size, args.pair_iterations), 1)
        row["churn"] = round(bench.gmem_bench_churn(BACKENDS[name], 1000, args.churn_ops, 512,
                                                    64 << 20, 12345), 1)
        if name == "torch":
            row["peak_reserved"] = torch.cuda.max_memory_reserved()
            torch.cuda.empty_cache()
        elif name == "gmem":
            row["peak_reserved"] = gmem.max_memory_reserved()
            gmem.empty_cache()
        results[label] = row
        print("alloc_bench: %s %s" % (label, row), file=sys.stderr, flush=True)
    if gmem is not None:
        results.update(tracking_cost(bench, gmem, args))
        print("alloc_bench: %s" % results["tracking_overhead"], file=sys.stderr, flush=True)
    emit(dict(kind="alloc", unit="ns", results=results), args.out)


if __name__ == "__main__":
    main()
