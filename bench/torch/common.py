"""Helpers shared by the PyTorch benchmarks: repository paths, the gmem package, JSON output."""

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PYTHON_DIR = os.path.join(REPO, "python")
TRACES = ["resnet50", "gpt2", "deeplab_varsize", "leak_losses"]


def import_gmem():
    """The gmem package from this repository (GMEM_LIBRARY picks the library)."""
    if PYTHON_DIR not in sys.path:
        sys.path.insert(0, PYTHON_DIR)
    import gmem

    return gmem


def trace_paths(names=None):
    return [os.path.join(REPO, "tests", "data", "%s.trace.csv.gz" % n) for n in (names or TRACES)]


def emit(record, out=None):
    """Prints one JSON line and appends it to `out` when given."""
    line = json.dumps(record, sort_keys=True)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def torchrun(script, gpus, script_args=(), module=None, env=None, timeout=300):
    """Runs `script --worker SCRIPT_ARGS` on `gpus` ranks of one host (through `python -m
    module` when given), with the gmem package and this folder on PYTHONPATH and `env` over the
    environment. Returns (exit code, or None when it timed out; its output; seconds)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(gpus)]
    command += ["-m", module, os.path.abspath(script)] if module else [os.path.abspath(script)]
    command += ["--worker"] + list(script_args)
    environment = dict(os.environ, **(env or {}))
    environment["PYTHONPATH"] = os.pathsep.join(
        [PYTHON_DIR, HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    environment.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.monotonic()
    try:
        done = subprocess.run(command, env=environment, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, universal_newlines=True, timeout=timeout)
        return done.returncode, done.stdout, time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode("utf-8", "replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out, time.monotonic() - t0


def read_json_lines(path):
    """The records `emit` appended to `path`, in order; none when it does not exist. Lines that
    are not JSON objects (a run's other output) are skipped."""
    records = []
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    records.append(json.loads(line))
    return records


def trace_rows(path):
    """A trace's block events, in order, each with the index of its row among the trace's data
    rows (the event numbers `gmem replay` reports): (row, (1, addr, size)) for alloc, (row, (0,
    addr, size)) for the completed free (see /work/shared/traces/README.md for the columns)."""
    import gzip

    with gzip.open(path, "rt") as f:
        next(f)
        for row, line in enumerate(f):
            action, addr, size = line.split(",", 3)[:3]
            if action == "alloc":
                yield row, (1, int(addr), int(size))
            elif action == "free_completed":
                yield row, (0, int(addr), int(size))


def load_trace(path):
    """trace_rows' events without their rows, as a list."""
    return [event for _, event in trace_rows(path)]


def smallest_cap(replay, events, peak_allocated, peak_reserved, max_iterations):
    """Bisection for the smallest memory cap under which `replay(events, cap)` succeeds, between
    the peak allocated (a lower bound for any allocator) and just above the uncapped peak.
    Precision: 2 MiB (gmem's page) or 0.1% of the peak, whichever is larger; both allocators are
    searched alike."""
    lo, hi = peak_allocated, int(peak_reserved * 1.02) + (2 << 20)
    iterations = 0
    while hi - lo > max(2 << 20, peak_allocated // 1000) and iterations < max_iterations:
        mid = (lo + hi) // 2
        if replay(events, mid)[0]:
            hi = mid
        else:
            lo = mid
        iterations += 1
    return hi, iterations
