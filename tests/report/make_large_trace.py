"""Writes a synthetic PyTorch trace CSV (gzip) of about N events, for `gmem report`'s scale test:
a training loop whose steps allocate and free activations at a few dozen sites, on top of
parameters allocated once, with segment events for the recorded allocator and one small leak
(a loss kept every step), so that every part of the report has something to draw.

    python3 tests/report/make_large_trace.py OUT.trace.csv.gz [EVENTS]   (default 2000000)
"""

import gzip
import sys

MiB = 1 << 20


def main(argv):
    out = argv[1]
    target = int(argv[2]) if len(argv) > 2 else 2_000_000
    lines = ["action,addr,size,stream,time_us,user_frame,lib_frame"]
    add = lines.append
    t = 1_700_000_000_000_000
    base = 0x7F0000000000
    seg = 0
    # Parameters: 40 blocks of 16 MiB in their own segments.
    for i in range(40):
        addr = base + i * 32 * MiB
        add("segment_alloc,%d,%d,0,%d,train.py:20:build,model.py:%d:init" % (addr, 32 * MiB, t, 10 + i % 8))
        add("alloc,%d,%d,0,%d,train.py:20:build,model.py:%d:init" % (addr, 16 * MiB, t + 1, 10 + i % 8))
        t += 10
    arena = base + 64 * 32 * MiB  # activations: one large segment, reused every step
    add("segment_alloc,%d,%d,0,%d,train.py:30:step," % (arena, 2048 * MiB, t))
    leak = base + 128 * 32 * MiB
    step = 0
    while len(lines) < target:
        step += 1
        live = []
        offset = 0
        # Forward: 600 activations of 64 KiB to 3 MiB at 24 layers; backward frees them.
        for i in range(600):
            size = (64 << 10) * (1 + (i * 7 + step) % 48)
            addr = arena + offset
            offset += size
            add("alloc,%d,%d,0,%d,train.py:31:forward,model.py:%d:forward" % (addr, size, t, 100 + i % 24))
            live.append(addr)
            t += 3
        for addr in reversed(live):
            add("free_requested,%d,0,0,%d,train.py:32:backward," % (addr, t))
            add("free_completed,%d,0,0,%d,train.py:32:backward," % (addr, t))
            t += 2
        # The leak: a 4 KiB loss kept every step.
        add("alloc,%d,4096,0,%d,train.py:40:train," % (leak + step * 4096, t))
        t += 200
    with gzip.open(out, "wt", compresslevel=1) as f:
        f.write("\n".join(lines))
        f.write("\n")
    print("%s: %d events, %d steps" % (out, len(lines) - 1, step))


if __name__ == "__main__":
    main(sys.argv)
