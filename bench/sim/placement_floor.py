#!/usr/bin/env python3
"""How many 2 MiB pages a trace's live blocks touch at once under an online placement, and what
two ideas would save: a study behind docs/notes/2026-11-26-the-partial-pages-floor-simulated-and-moving-off-pages-that-would-wait.md.

  python3 bench/sim/placement_floor.py ends TRACE...     pages at the peak under six placements
  python3 bench/sim/placement_floor.py share TRACE...    chunks shared by partial pages: the
                                                          bound at the peak, and online
Traces: PyTorch trace CSVs (.csv.gz, as bench/replay_traces.sh reads). Blocks of every size are
ranges here (gmem puts those up to 128 KiB in slabs), one address space a stream, exact best fit;
no chunks, stitching or streams' lag: only where blocks go and which pages they touch. Pure
Python: about a second per 10k mallocs per placement.
"""
import bisect
import csv
import gzip
import sys

PAGE = 2 << 20
SPACE = 1 << 40  # the end of an address space: the free range ending here is its endless tail


def load(path):
    events = []
    with gzip.open(path, 'rt') if path.endswith('.gz') else open(path) as f:
        rows = csv.reader(f)
        next(rows)
        for row in rows:
            if row[0] == 'alloc':
                events.append((True, int(row[1]), int(row[2]), int(row[3])))
            elif row[0] == 'free_requested':
                events.append((False, int(row[1]), int(row[2]), int(row[3])))
    return events


class Space:
    """One stream's address space: free ranges by address, pages' overlapping block counts."""

    def __init__(self, where):
        self.starts, self.ends = [0], {0: SPACE}
        self.refs, self.pages = {}, 0
        self.where = where  # (start, end, size) of the best fit -> address

    def _pages(self, a, b, d):
        for p in range(a // PAGE, (b - 1) // PAGE + 1):
            r = self.refs.get(p, 0) + d
            self.pages += (r > 0) - (r - d > 0)
            if r:
                self.refs[p] = r
            else:
                del self.refs[p]

    def take(self, a, b):  # [a, b) is free
        i = bisect.bisect_right(self.starts, a) - 1
        st = self.starts.pop(i)
        en = self.ends.pop(st)
        if st < a:
            bisect.insort(self.starts, st)
            self.ends[st] = a
        if b < en:
            bisect.insort(self.starts, b)
            self.ends[b] = en

    def put(self, a, b):  # [a, b) becomes free, merged with its neighbours
        i = bisect.bisect_left(self.starts, b)
        if i < len(self.starts) and self.starts[i] == b:
            b = self.ends.pop(b)
            self.starts.pop(i)
        i = bisect.bisect_left(self.starts, a) - 1
        if i >= 0 and self.ends[self.starts[i]] == a:
            self.ends[self.starts[i]] = b
        else:
            bisect.insort(self.starts, a)
            self.ends[a] = b

    def is_free(self, a, b):
        i = bisect.bisect_right(self.starts, a) - 1
        return i >= 0 and self.starts[i] <= a and b <= self.ends[self.starts[i]]

    def malloc(self, size):
        best = min(((en - st, st) for st, en in self.ends.items() if en - st >= size))
        st = best[1]
        a = self.where(st, self.ends[st], size)
        self.take(a, a + size)
        self._pages(a, a + size, 1)
        return a

    def free(self, a, size):
        self._pages(a, a + size, -1)
        self.put(a, a + size)


# Where a block goes in its best fit [st, en). Every rule places at the bottom of the endless tail
# (en == SPACE), as gmem does: the top of the address space is no place to pack against.
def gmem_ends(st, en, size):  # gmem's: 16 MiB and more at the top of the fit, the rest at the bottom
    return en - size if size >= 16 << 20 and en != SPACE else st


def top_from(bytes_):
    return lambda st, en, size: en - size if size >= bytes_ and en != SPACE else st


def page_aligned(st, en, size):  # gmem's, and a block of a page or more starts on a page if it can
    if size >= 16 << 20 and en != SPACE:
        return en - size
    a = -(-st // PAGE) * PAGE
    return a if size >= PAGE and a + size <= en else st


def top_end_aligned(st, en, size):  # gmem's, a top block ending on a page boundary if it can
    if size >= 16 << 20 and en != SPACE:
        e = en // PAGE * PAGE
        return e - size if e - size >= st else en - size
    return st


PLACEMENTS = [('gmem (16 MiB up at the top)', gmem_ends), ('all at the bottom', lambda st, en, s: st),
              ('page-aligned starts', page_aligned), ('top blocks end on a page', top_end_aligned),
              ('4 MiB up at the top', top_from(4 << 20)), ('64 MiB up at the top', top_from(64 << 20))]


def rounded(size):
    return (size + 511) // 512 * 512


def peak_allocated(events):
    """The trace's own peak of requested bytes, the denominator of gmem replay's ratios too (the
    simulated blocks are rounded to 512 B, so a ratio includes that rounding, as gmem's do)."""
    live, cur, peak = {}, 0, 0
    for is_alloc, addr, size, _ in events:
        if is_alloc:
            live[addr] = size
            cur += size
            peak = max(peak, cur)
        elif addr in live:
            cur -= live.pop(addr)
    return peak


def replay(events, where, at_peak=None):
    """Most pages touched at once; at_peak(blocks) is called with the live blocks each time it rises."""
    spaces, live, most = {}, {}, 0
    for is_alloc, addr, size, stream in events:
        if is_alloc:
            s = spaces.setdefault(stream, Space(where))
            n = rounded(size)
            live[addr] = (s, s.malloc(n), n)
            pages = sum(x.pages for x in spaces.values())
            if pages > most:
                most = pages
                if at_peak:
                    at_peak(live.values())
        elif addr in live:
            s, a, n = live.pop(addr)
            s.free(a, n)
    return most


def chunks_shared_at_peak(blocks):
    """At one moment (the live blocks given): pages touched, and the chunks they would need if
    partial pages could share chunks, any number of pages of any streams to a chunk as long as
    their used offsets are disjoint, packed first fit decreasing (a heuristic, not the optimum).
    An estimate of what choosing the pairs at the peak could save, not a bound."""
    pages = {}
    for s, a, n in blocks:
        for p in range(a // PAGE, (a + n - 1) // PAGE + 1):
            lo, hi = max(a, p * PAGE) - p * PAGE, min(a + n, (p + 1) * PAGE) - p * PAGE
            pages.setdefault((id(s), p), []).append((lo, hi))
    full = sum(1 for v in pages.values() if sum(h - l for l, h in v) == PAGE)
    partial = sorted((v for v in pages.values() if sum(h - l for l, h in v) < PAGE),
                     key=lambda v: -sum(h - l for l, h in v))
    chunks = []
    for v in partial:  # first fit decreasing
        for c in chunks:
            if all(h1 <= l2 or h2 <= l1 for l1, h1 in c for l2, h2 in v):
                c.extend(v)
                break
        else:
            chunks.append(list(v))
    return full + len(partial), full + len(chunks)


def shared_online(events):
    """Online: a page that one block's end uses alone (the rest of it free) shares a chunk with
    another such page of its stream whose used offsets are disjoint, when the chunks would
    otherwise pass their most; the rest of both pages is then taken (nothing else may land
    there) until either block goes. The partner is the first such page found (pages in the
    order they were first used), not the best one. Returns the most chunks held at once."""
    spaces, live, live_size, users, shares, shared, most = {}, {}, {}, {}, {}, 0, 0

    def sole_use(s, p):
        """(lo, hi): the offsets of page p that one block alone uses, the rest free; else None."""
        u = users.get((id(s), p))
        if not u or len(u) != 1 or (id(s), p) in shares:
            return None
        a = next(iter(u))
        n = live_size[(id(s), a)]
        lo, hi = max(a, p * PAGE), min(a + n, (p + 1) * PAGE)
        if hi - lo == PAGE or (lo > p * PAGE and not s.is_free(p * PAGE, lo)) or \
                (hi < (p + 1) * PAGE and not s.is_free(hi, (p + 1) * PAGE)):
            return None
        return lo - p * PAGE, hi - p * PAGE

    for is_alloc, addr, size, stream in events:
        if is_alloc:
            s = spaces.setdefault(stream, Space(gmem_ends))
            n = rounded(size)
            a = s.malloc(n)
            live[addr] = (s, a, n)
            live_size[(id(s), a)] = n
            for p in range(a // PAGE, (a + n - 1) // PAGE + 1):
                users.setdefault((id(s), p), set()).add(a)
            pages = sum(x.pages for x in spaces.values())
            for p in {a // PAGE, (a + n - 1) // PAGE}:
                if pages - shared <= most:
                    break
                used_p = sole_use(s, p)
                if used_p is None:
                    continue
                for (sid, q) in list(users):
                    used_q = sid == id(s) and q != p and sole_use(s, q)
                    if not used_q or not (used_p[1] <= used_q[0] or used_q[1] <= used_p[0]):
                        continue
                    held = []  # the free rest of both pages, taken while they share a chunk
                    for page, (lo, hi) in ((p, used_p), (q, used_q)):
                        for r in ((page * PAGE, page * PAGE + lo), (page * PAGE + hi, (page + 1) * PAGE)):
                            if r[1] > r[0]:
                                s.take(*r)
                                held.append(r)
                    # Both pages name each other; the held bytes are kept with one of them.
                    shares[(id(s), p)] = ((id(s), q), held)
                    shares[(id(s), q)] = ((id(s), p), [])
                    shared += 1
                    break
            most = max(most, pages - shared)
        elif addr in live:
            s, a, n = live.pop(addr)
            del live_size[(id(s), a)]
            s.free(a, n)
            for p in range(a // PAGE, (a + n - 1) // PAGE + 1):
                users[(id(s), p)].discard(a)
            for p in {a // PAGE, (a + n - 1) // PAGE}:
                if (id(s), p) in shares:  # the share ends with either block: its held bytes go back
                    other, held = shares.pop((id(s), p))
                    _, held_by_other = shares.pop(other)
                    for r in held + held_by_other:
                        s.put(*r)
                    shared -= 1
            for p in range(a // PAGE, (a + n - 1) // PAGE + 1):
                if not users[(id(s), p)]:
                    del users[(id(s), p)]
    return most


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ('ends', 'share'):
        sys.exit(__doc__)
    for path in sys.argv[2:]:
        events = load(path)
        peak = peak_allocated(events)
        name = path.split('/')[-1].split('.')[0]
        if sys.argv[1] == 'ends':
            ratios = ['%.4f' % (replay(events, where) * PAGE / peak) for _, where in PLACEMENTS]
            print('%-22s %s' % (name, '  '.join(ratios)))
        else:
            at_peak = []  # the estimate at the latest rise of the pages touched: at their most
            most = replay(events, gmem_ends,
                          lambda blocks: at_peak.append(chunks_shared_at_peak(list(blocks))))
            touched, shared_chunks = at_peak[-1]
            assert touched == most
            print('%-22s pages at the peak %.4f, partial pages sharing chunks %.4f; online %.4f; '
                  'whole pages %.4f' % (name, most * PAGE / peak, shared_chunks * PAGE / peak,
                                        shared_online(events) * PAGE / peak,
                                        -(-peak // PAGE) * PAGE / peak))
    if sys.argv[1] == 'ends':
        print('columns: ' + ' | '.join(n for n, _ in PLACEMENTS))


if __name__ == '__main__':
    main()
