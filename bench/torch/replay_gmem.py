"""Replays traces through gmem on the GPU (its CUDA device, through the Python package): peak
allocated / reserved uncapped, and the smallest gmem memory limit that runs each without OOM,
found by the same bisection as replay_native.py. No PyTorch in this process.

    GMEM_LIBRARY=build-gpu/libgmem.so python3 bench/torch/replay_gmem.py [--out FILE] [TRACE...]
"""

import argparse
import os
import time

from common import emit, import_gmem, load_trace, smallest_cap, trace_paths

gmem = import_gmem()


def replay(events, cap=None):
    gmem.empty_cache()
    gmem.reset_peak_memory_stats()
    gmem.set_memory_limit(int(cap) if cap else 0)
    malloc, free = gmem.malloc, gmem.free
    live, ok = {}, True
    try:
        for is_alloc, addr, size in events:
            if is_alloc:
                live[addr] = malloc(size)
            else:
                ptr = live.pop(addr, None)
                if ptr is not None:
                    free(ptr)
    except gmem.OutOfMemoryError:
        ok = False
    for ptr in live.values():
        free(ptr)
    return ok, gmem.max_memory_allocated(), gmem.max_memory_reserved()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="*")
    parser.add_argument("--out")
    parser.add_argument("--max-iterations", type=int, default=10)
    args = parser.parse_args()
    for path in args.traces or trace_paths():
        events, start = load_trace(path), time.time()
        gmem.reset_accumulated_memory_stats()
        ok, peak_allocated, peak_reserved = replay(events)
        stats = gmem.memory_stats()
        cap, iterations = smallest_cap(replay, events, peak_allocated, peak_reserved,
                                       args.max_iterations)
        emit(dict(kind="replay", trace=os.path.basename(path).split(".")[0], allocator="gmem",
                  events=len(events), ok=ok, peak_allocated=peak_allocated,
                  peak_reserved=peak_reserved, min_capacity=cap, iterations=iterations,
                  reserved_ratio=round(peak_reserved / peak_allocated, 4),
                  min_cap_ratio=round(cap / peak_allocated, 4), s=round(time.time() - start, 1),
                  maps=stats.get("gmem.num_maps"), stitches=stats.get("gmem.num_stitches")),
             args.out)
    gmem.set_memory_limit(0)


if __name__ == "__main__":
    main()
