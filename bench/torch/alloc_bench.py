"""Allocation speed: gmem vs PyTorch's caching allocator vs cudaMallocAsync, all driven by the
same C++ loops (alloc_bench.cpp, compiled here against the installed torch) in one process.

    GMEM_LIBRARY=build-gpu/libgmem.so python3 bench/torch/alloc_bench.py [--out FILE]
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/torch/alloc_bench.py --only torch

Prints one JSON line: nanoseconds per malloc+free pair (4 KiB, 16 MiB) and per churn op (free a
random one of 1000 live blocks, allocate a new size log-uniform in 512 B..64 MiB; 100k ops
timed after 100k ops of warm-up). With gmem, also "gmem_tracked": the same loops with
gmem.enable_tracking() on, alternated with untracked runs (medians of 7 each, pairs 10x longer), and
"tracking_overhead": tracked / untracked per loop.

And per trace (--trace, default: tests/data's gpt2 and llama_rounds): nanoseconds per op (a malloc
or a free) replaying the trace's mallocs and frees in their order and sizes, the whole trace three
times in a row (set-up, steps, and everything freed at its end, as a program that builds its model
again), the last pass reported ("_first_pass": the first, from an empty allocator). gmem is told
where the trace's optimizer steps end where STEP_AT knows its optimizer's frame (llama_rounds), as
gmem.torch marks them: there it follows its planned layouts as shapes take turns. No kernels run:
host cost alone.
"""

import argparse
import ctypes
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys

import torch

from common import HERE, REPO, emit, import_gmem, trace_rows

BACKENDS = {"torch": 0, "gmem": 1, "cudaMallocAsync": 2}
PAIR_SIZES = {"pair_4KiB": 4 << 10, "pair_16MiB": 16 << 20}
TRACES = [os.path.join(REPO, "tests", "data", name + ".trace.csv.gz")
          for name in ("gpt2", "llama_rounds")]
# Where a trace's optimizer steps are known, the frame that ends one (`gmem replay --step-at`): gmem
# is told of the steps gmem.torch would mark. Other traces replay without marks: steps found at
# minima of live memory (gmem replay's guess) split llama_rounds' steps, and on the simulated
# device its planned layouts then kept moving (5,000 maps a pass against 8 with the real steps).
# The frame is tests/data's llama_rounds' own, a line of models.py as it was at its capture (a
# capture from bench/torch/models/ today would end its steps at models.step_frame("llama_rounds")).
STEP_AT = {"llama_rounds": "models.py:168:step"}


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


class Trace:
    """A trace as alloc_bench.cpp's arrays: ops (slot to malloc into, or -slot - 1 to free),
    sizes, and marks (1 where a training step ends before the op)."""

    def __init__(self, path, cli):
        self.name = os.path.basename(path).split(".")[0]
        step_ends = self.step_ends(path, self.name, cli)
        ops, sizes, marks = [], [], []
        slot_of, free_slots, slots = {}, [], 0
        ends = iter(step_ends)
        next_end = next(ends, None)
        for row, (is_alloc, addr, size) in trace_rows(path):
            mark = 0
            while next_end is not None and next_end < row:
                mark, next_end = 1, next(ends, None)
            if is_alloc:
                slot = free_slots.pop() if free_slots else slots
                slots = max(slots, slot + 1)
                slot_of[addr] = slot
                ops.append(slot)
            elif addr in slot_of:
                slot = slot_of.pop(addr)
                free_slots.append(slot)
                ops.append(-slot - 1)
            else:  # freed, but allocated before the trace began
                continue
            sizes.append(size)
            marks.append(mark)
        if step_ends and marks:
            marks[0] = 1  # a pass ends a step: the next pass begins its first step again
        self.n, self.slots, self.steps = len(ops), slots, len(step_ends)
        self.ops = (ctypes.c_int * self.n)(*ops)
        self.sizes = (ctypes.c_size_t * self.n)(*sizes)
        self.marks = (ctypes.c_ubyte * self.n)(*marks)

    @staticmethod
    def step_ends(path, name, cli):
        """The trace events after which an optimizer step ends (none where STEP_AT does not know
        the trace's optimizer frame, or without gmem's CLI)."""
        at = STEP_AT.get(name)
        if not cli or not at:
            return []
        result = subprocess.run([cli, "replay", "--json", "--steps", "--step-at", at, path],
                                stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, universal_newlines=True)
        if result.returncode != 0:
            return []
        return [s["event"] for s in json.loads(result.stdout.splitlines()[0]).get("per_step", [])]

    def run(self, bench, backend, passes=3):
        out = (ctypes.c_double * passes)()
        bench.gmem_bench_trace(backend, self.ops, self.sizes, self.marks, self.n, self.slots,
                               passes, out)
        return [round(x, 1) for x in out]


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


def empty_cache(name, gmem):
    torch.cuda.synchronize()
    if name == "torch":
        torch.cuda.empty_cache()
    elif name == "gmem":
        gmem.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--only", choices=sorted(BACKENDS), action="append")
    parser.add_argument("--build-dir", default=os.path.join(REPO, "build-gpu", "torch-bench"))
    parser.add_argument("--pair-iterations", type=int, default=20000)
    parser.add_argument("--churn-ops", type=int, default=100000)
    parser.add_argument("--trace", action="append", help="default: %s" % ", ".join(
        os.path.relpath(t, REPO) for t in TRACES))
    parser.add_argument("--cli", default=os.path.join(REPO, "build-gpu", "gmem"),
                        help="gmem's CLI, to find the traces' steps")
    args = parser.parse_args()

    torch.cuda.init()
    torch.empty(1, device="cuda")  # contexts and the caching allocator up before timing
    bench = ctypes.CDLL(build(args.build_dir))
    bench.gmem_bench_bind.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    bench.gmem_bench_bind_mark_step.argtypes = [ctypes.c_void_p]
    bench.gmem_bench_pair.restype = ctypes.c_double
    bench.gmem_bench_pair.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    bench.gmem_bench_churn.restype = ctypes.c_double
    bench.gmem_bench_churn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_size_t,
                                       ctypes.c_size_t, ctypes.c_uint]
    bench.gmem_bench_trace.restype = ctypes.c_double
    bench.gmem_bench_trace.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_void_p]
    cli = args.cli if os.access(args.cli, os.X_OK) else None
    traces = [Trace(path, cli) for path in args.trace or TRACES]
    backends = args.only or sorted(BACKENDS)
    gmem = None
    if "gmem" in backends:
        gmem = import_gmem()
        from gmem import _lib

        bench.gmem_bench_bind(_lib.address_of("gmem_malloc"), _lib.address_of("gmem_free"))
        bench.gmem_bench_bind_mark_step(_lib.address_of("gmem_mark_step"))

    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    label = {name: name for name in backends}
    if "torch" in label and "expandable_segments:True" in conf:
        label["torch"] = "torch_expandable"
    results = {}
    for name in backends:
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
        results[label[name]] = row
        print("alloc_bench: %s %s" % (label[name], row), file=sys.stderr, flush=True)
    if gmem is not None:
        results.update(tracking_cost(bench, gmem, args))
        print("alloc_bench: %s" % results["tracking_overhead"], file=sys.stderr, flush=True)
    # Last: once gmem has been told of steps, its planner records every range malloc between marks
    # (the loops above mark none).
    for name in backends:
        row = results[label[name]]
        for t in traces:
            empty_cache(name, gmem)
            passes = t.run(bench, BACKENDS[name])
            row["trace_" + t.name] = passes[-1]
            row["trace_%s_first_pass" % t.name] = passes[0]
        print("alloc_bench: %s traces %s" % (name, {k: v for k, v in row.items()
                                                   if k.startswith("trace_")}),
              file=sys.stderr, flush=True)
    emit(dict(kind="alloc", unit="ns", results=results,
              traces={t.name: {"ops": t.n, "steps_marked": t.steps} for t in traces}), args.out)


if __name__ == "__main__":
    main()
