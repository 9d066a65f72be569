#!/usr/bin/env python3
"""Replays traces through gmem at several page sizes (`gmem replay --page-size`) and prints, for
each trace and page size: peak reserved / peak allocated, the smallest capacity / peak allocated,
device calls (creates + maps + unmaps) over the whole replay and in its second half, and the
modelled host time in device calls (kDeviceCallPrices: each map, set-access and unmap priced per
chunk, as gpu/chunk_size_calls.cu measured). docs/notes/2026-11-24-page-size-the-driver-prices-a-call-per-chunk-not-per-byte.md, has its numbers.

    python3 bench/replay_page_sizes.py [--gmem build/gmem] [--sizes 2M,4M,8M,16M] TRACE...
"""
import argparse
import json
import subprocess
import sys


def replay(gmem, trace, page_size, extra):
    out = subprocess.run([gmem, "replay", "--json", "--page-size", page_size, *extra, trace],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gmem", default="build/gmem")
    parser.add_argument("--sizes", default="2M,4M,8M,16M,32M")
    parser.add_argument("--step-at", default=None, help="passed to gmem replay")
    parser.add_argument("traces", nargs="+")
    args = parser.parse_args()
    extra = ["--step-at", args.step_at] if args.step_at else []
    sizes = args.sizes.split(",")
    print(f"{'trace':22} {'page':>5} {'reserved':>9} {'min cap':>8} {'calls':>7} {'late':>6} "
          f"{'call ms':>8}")
    for trace in args.traces:
        for size in sizes:
            r = replay(args.gmem, trace, size, extra)
            calls = r["creates"] + r["maps"] + r["unmaps"]
            print(f"{r['trace']:22} {size:>5} {r['reserved_ratio']:9.4f} "
                  f"{r['min_capacity_ratio']:8.4f} {calls:7d} {r['late_device_calls']:6d} "
                  f"{r['device_call_us'] / 1000:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
