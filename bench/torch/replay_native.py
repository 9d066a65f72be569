"""Replays traces through PyTorch's own caching allocator on the GPU: peak allocated / reserved
uncapped, and the smallest cap (set_per_process_memory_fraction) that runs each without OOM.
Adapted from shared/tools/replay_native.py (the bar gmem must beat); run it a second time with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for the other setting.

    python3 bench/torch/replay_native.py [--out FILE] [--max-iterations N] [TRACE...]
"""

import argparse
import os
import time

import torch

from common import emit, load_trace, smallest_cap, trace_paths

CONF = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
TOTAL = torch.cuda.get_device_properties(0).total_memory


def replay(events, cap=None):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / TOTAL) if cap else 1.0)
    alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete
    stream = torch.cuda.current_stream()
    live, ok = {}, True
    try:
        for is_alloc, addr, size in events:
            if is_alloc:
                live[addr] = alloc(size, 0, stream)
            else:
                ptr = live.pop(addr, None)
                if ptr is not None:
                    delete(ptr)
    except torch.OutOfMemoryError:
        ok = False
    for ptr in live.values():
        delete(ptr)
    return ok, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="*")
    parser.add_argument("--out")
    parser.add_argument("--max-iterations", type=int, default=10)
    args = parser.parse_args()
    allocator = "expandable" if "expandable_segments:True" in CONF else "native"
    for path in args.traces or trace_paths():
        events, start = load_trace(path), time.time()
        ok, peak_allocated, peak_reserved = replay(events)
        cap, iterations = smallest_cap(replay, events, peak_allocated, peak_reserved,
                                       args.max_iterations)
        emit(dict(kind="replay", trace=os.path.basename(path).split(".")[0], allocator=allocator,
                  events=len(events), ok=ok, peak_allocated=peak_allocated,
                  peak_reserved=peak_reserved, min_capacity=cap, iterations=iterations,
                  reserved_ratio=round(peak_reserved / peak_allocated, 4),
                  min_cap_ratio=round(cap / peak_allocated, 4), s=round(time.time() - start, 1)),
             args.out)
    torch.cuda.set_per_process_memory_fraction(1.0)


if __name__ == "__main__":
    main()
