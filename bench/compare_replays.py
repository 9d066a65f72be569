#!/usr/bin/env python3
"""Compares two outputs of bench/replay_traces.sh trace by trace: reserved and smallest cap over
peak allocated, late device calls and modelled device ms a step, before → after, a `*` on every
line that moved; then the totals (means, sums, and how many traces meet reserved <= 1.02 and cap
<= 1.01).

    python3 bench/compare_replays.py BEFORE.txt AFTER.txt [--changed]

--changed prints only the traces that moved, and the totals.
"""
import sys


def read(path):
    """trace -> (reserved, cap, late calls, ms/step), from replay_traces.sh's lines."""
    rows = {}
    with open(path) as f:
        for line in f:
            w = line.split()
            if len(w) >= 11 and w[2] == 'reserved' and w[4] == 'cap':
                rows[w[0]] = (float(w[3]), float(w[5]), int(w[8]), float(w[10]))
    return rows


def main():
    args = [a for a in sys.argv[1:] if a != '--changed']
    if len(args) != 2:
        sys.exit(__doc__)
    changed_only = '--changed' in sys.argv
    before, after = read(args[0]), read(args[1])
    common = [t for t in before if t in after]
    if not common:
        sys.exit('no trace is in both files')
    for t in common:
        b, a = before[t], after[t]
        if changed_only and a == b:
            continue
        print('%-20s reserved %.3f → %.3f  cap %.3f → %.3f  late %6d → %6d  ms/step %6.2f → %6.2f%s'
              % (t, b[0], a[0], b[1], a[1], b[2], a[2], b[3], a[3], '' if a == b else '  *'))
    n = len(common)

    def total(rows, k):
        return sum(rows[t][k] for t in common)

    def meeting(rows, k, bound):
        return sum(rows[t][k] <= bound for t in common)

    print('%d traces: mean reserved %.4f → %.4f, mean cap %.4f → %.4f, late calls %d → %d, '
          'ms/step summed %.1f → %.1f; reserved <= 1.02: %d → %d, cap <= 1.01: %d → %d'
          % (n, total(before, 0) / n, total(after, 0) / n, total(before, 1) / n, total(after, 1) / n,
             total(before, 2), total(after, 2), total(before, 3), total(after, 3),
             meeting(before, 0, 1.02), meeting(after, 0, 1.02), meeting(before, 1, 1.01),
             meeting(after, 1, 1.01)))
    missing = sorted(set(before) ^ set(after))
    if missing:
        print('in one file only: ' + ', '.join(missing))


if __name__ == '__main__':
    main()
