"""What Python call sites cost per malloc: gmem.malloc + gmem.free pairs under tracking with
stacks="thread" (the anchor: no stack taken) and stacks="python" (libgmem reads the Python stack
from C++), at a given Python stack depth, each in its own process, interleaved, best of three.
Prints ns per pair and the difference; not a test.

    GMEM_DEVICE=sim PYTHONPATH=python GMEM_LIBRARY=build/libgmem.so python3 bench/python_stacks_bench.py
"""

import json
import os
import subprocess
import sys

WORKER = r"""
import sys, time, gmem
mode, depth, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
gmem.enable_tracking(stacks=mode)
def nest(k):
    if k > 0:
        return nest(k - 1)
    malloc, free = gmem.malloc, gmem.free
    for _ in range(n // 10):  # warm-up: the stack is interned on first sight
        free(malloc(4096))
    best = None
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            free(malloc(4096))
        took = (time.perf_counter() - t) / n
        best = took if best is None else min(best, took)
    return best
print(nest(depth) * 1e9)
"""


def run(mode, depth, n):
    out = subprocess.run([sys.executable, "-c", WORKER, mode, str(depth), str(n)],
                         stdout=subprocess.PIPE, universal_newlines=True, check=True)
    return float(out.stdout.strip())


def main():
    n = int(os.environ.get("GMEM_BENCH_PAIRS", "20000"))
    rows = []
    for depth in (5, 30):
        # Interleaved, best of three each: the machine's other load moves single runs a lot.
        anchor = python = float("inf")
        for _ in range(3):
            anchor = min(anchor, run("thread", depth, n))
            python = min(python, run("python", depth, n))
        rows.append({"depth": depth, "thread_ns": round(anchor), "python_ns": round(python),
                     "stack_ns": round(python - anchor), "ratio": round(python / anchor, 3)})
        print("depth %2d: stacks=thread %6.0f ns a pair, stacks=python %6.0f ns (+%.0f ns, %.2fx)"
              % (depth, anchor, python, python - anchor, python / anchor))
    if "--json" in sys.argv:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
