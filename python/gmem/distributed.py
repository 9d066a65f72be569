"""gmem across the ranks of a torch.distributed job: one table of every rank's memory, and what
the other ranks held when one of them runs out.

    import gmem.distributed
    gmem.distributed.summary()       # a collective: every rank calls it; rank 0 prints the table
    gmem.distributed.publish()       # cheap, not a collective: this rank's row into the store
                                     # (gmem.step() does; gmem.torch after optimizer steps too)
    gmem.distributed.peers()         # the rows the other ranks published last (never waits long)

Ranks are rarely balanced (the last pipeline stage, the rank holding the embedding shard), and
NCCL and the CUDA context hold memory outside any caching allocator; each row therefore says what
gmem holds *and* what others hold on that GPU (the device's total less its free memory less gmem's
reserved). `gmem.step()` publishes the row while a process group is up, and gmem.torch does after
optimizer steps (at most once a second), so that an out-of-memory on one rank can say what the
others held without asking them (they are busy, or waiting on it in a collective): `gmem.run`
prints that when a rank dies of an out-of-memory error.
"""

import json
import socket
import sys
import time

from . import memory, observe
from ._format import format_bytes

# The key each rank's row is published under in the process group's store.
STORE_PREFIX = "gmem/rank/"

ROW_FIELDS = ("rank", "world_size", "host", "device", "allocated", "peak_allocated", "reserved",
              "peak_reserved", "outside", "device_total", "top_sites", "time")


def _dist():
    """torch.distributed when a process group is up, else None. Never imports torch itself: a
    program that has not imported it has no process group."""
    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def top_sites(device=None, top=3):
    """The call sites holding the most live memory, [(site, bytes)], largest first; empty unless
    tracking is on (gmem.enable_tracking) and has seen the allocations."""
    if top <= 0:
        return []
    return [(g["site"], g["bytes"]) for g in observe._top_sites(top, device)]  # no warning: rows go out now and then


def rank_row(device=None, top=3, rank=0, world_size=1):
    """This process's row: what gmem holds on `device` and what others hold there."""
    stats = memory.memory_stats(device)
    return {
        "rank": rank,
        "world_size": world_size,
        "host": socket.gethostname(),
        "device": memory._device_ordinal(device),
        "allocated": stats.get("allocated_bytes.all.current", 0),
        "peak_allocated": stats.get("allocated_bytes.all.peak", 0),
        "reserved": stats.get("reserved_bytes.all.current", 0),
        "peak_reserved": stats.get("reserved_bytes.all.peak", 0),
        "outside": stats.get("gmem.outside_bytes", 0),
        "device_total": stats.get("gmem.device_total_bytes", 0),
        "top_sites": [list(site) for site in top_sites(device, top)],
        "time": time.time(),
    }


def format_table(rows):
    """The rows as one table, a line per rank, then the imbalance and the top sites of the rank
    that sets the peak."""
    rows = sorted(rows, key=lambda r: r["rank"])
    lines = ["%-5s %-16s %12s %12s %12s %12s %14s" % (
        "rank", "host:device", "allocated", "peak alloc", "reserved", "peak reserved",
        "outside gmem")]
    for r in rows:
        lines.append("%-5d %-16s %12s %12s %12s %12s %14s" % (
            r["rank"], ("%s:%s" % (r["host"], r["device"]))[:16], format_bytes(r["allocated"]),
            format_bytes(r["peak_allocated"]), format_bytes(r["reserved"]),
            format_bytes(r["peak_reserved"]), format_bytes(r["outside"])))
    if not rows:
        return "\n".join(lines)
    peak = max(rows, key=lambda r: r["peak_reserved"])
    mean = sum(r["peak_reserved"] for r in rows) / len(rows)
    lowest = min(r["peak_reserved"] for r in rows)
    if mean > 0:
        lines.append("imbalance: rank %d peaks at %s, %.2fx the mean over ranks (%s), %s above the "
                     "lowest" % (peak["rank"], format_bytes(peak["peak_reserved"]),
                                 peak["peak_reserved"] / mean, format_bytes(int(mean)),
                                 format_bytes(peak["peak_reserved"] - lowest)))
    if peak["top_sites"]:
        lines.append("rank %d holds most at:" % peak["rank"])
        for site, size in peak["top_sites"]:
            lines.append("  %10s  %s" % (format_bytes(size), site))
    elif len(rows) > 1:
        lines.append("(call sites need gmem.enable_tracking() on every rank)")
    return "\n".join(lines)


def summary(group=None, device=None, top=3, file=None, print_rank=0, as_json=False):
    """Gathers every rank's row over the process group (a collective: every rank must call it)
    and returns the rows, ordered by rank, on every rank. Rank `print_rank` prints the table to
    `file` (default stdout; print_rank=None: no rank prints), or JSON with as_json=True. Without a
    process group, the table has this process alone. Also publishes this rank's row (publish())."""
    dist = _dist()
    if dist is None:
        rank, world = 0, 1
        rows = [rank_row(device, top)]
    else:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        mine = rank_row(device, top, rank, world)
        rows = [None] * world
        dist.all_gather_object(rows, mine, group=group)
        publish(mine)
    rows = sorted(rows, key=lambda r: r["rank"])
    if print_rank is not None and rank == print_rank:
        out = file if file is not None else sys.stdout
        out.write((json.dumps(rows) if as_json else format_table(rows)) + "\n")
        out.flush()
    return rows


def _store():
    dist = _dist()
    if dist is None:
        return None
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:  # no default group, or a torch without it: publishing is best effort
        return None


def publish(row=None, store=None, device=None):
    """Puts this rank's row (rank_row() when None) into the process group's store, for peers()
    to read when a rank runs out of memory. Not a collective; a no-op without a process group.
    Returns whether it published."""
    store = store if store is not None else _store()
    if store is None:
        return False
    if row is None:  # no call sites: a snapshot walk each step would cost too much
        dist = _dist()
        rank = dist.get_rank() if dist is not None else 0
        world = dist.get_world_size() if dist is not None else 1
        row = rank_row(device, top=0, rank=rank, world_size=world)
    try:
        store.set(STORE_PREFIX + str(row["rank"]), json.dumps(row))
    except Exception:  # a store that went away must not break the training step
        return False
    return True


# publish_now_and_then's pace: a row a second costs a training loop nothing it would notice (a
# store write, tens of microseconds) and is fresh enough to say what a rank held.
PUBLISH_EVERY_S = 1.0
_last_published = [float("-inf")]


def publish_now_and_then(device=None):
    """publish(), at most once every PUBLISH_EVERY_S seconds (the first call publishes): what
    gmem.torch runs after each optimizer step. A no-op without a process group. Returns whether
    it published."""
    if _dist() is None:
        return False
    now = time.monotonic()
    if now - _last_published[0] < PUBLISH_EVERY_S:
        return False
    _last_published[0] = now
    return publish(device=device)


def _publish_at_step():
    publish()


# gmem.step() publishes this rank's row, first of what runs at a step (observe is below this
# module and does not import it; gmem/__init__ imports this one, so it is always in place).
if _publish_at_step not in observe.step_listeners:
    observe.step_listeners.insert(0, _publish_at_step)


def peers(world_size=None, rank=None, store=None, timeout=2.0):
    """What the other ranks published last: {rank: row}, without ranks that never published or
    did not answer within `timeout` seconds in all (the store may be down: never hangs longer)."""
    store = store if store is not None else _store()
    if store is None:
        return {}
    dist = _dist()
    if world_size is None:
        world_size = dist.get_world_size() if dist is not None else 1
    if rank is None:
        rank = dist.get_rank() if dist is not None else 0
    out = {}
    deadline = time.monotonic() + timeout
    for other in range(world_size):
        if other == rank:
            continue
        key = STORE_PREFIX + str(other)
        try:
            # check() does not wait; get() on a key that is absent would block.
            if not store.check([key]):
                continue
            out[other] = json.loads(store.get(key))
        except Exception:
            continue
        if time.monotonic() > deadline:
            break
    return out


def oom_context(device=None, timeout=2.0):
    """Text for an out-of-memory on this rank: which rank it is, and what the others held when
    they last published (gmem.step() publishes). Empty without a process group."""
    dist = _dist()
    if dist is None:
        return ""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = rank_row(device, top=0, rank=rank, world_size=world)
    others = peers(world, rank, timeout=timeout)
    lines = ["rank %d of %d ran out of memory on %s:%s" % (rank, world, mine["host"],
                                                             mine["device"])]
    now = time.time()
    rows = [mine] + [others[r] for r in sorted(others)]
    lines.append(format_table(rows))
    for r in sorted(others):
        lines.append("  (rank %d: as of %.0f s ago)" % (r, max(0.0, now - others[r]["time"])))
    missing = [r for r in range(world) if r != rank and r not in others]
    if missing:
        lines.append("no word from rank%s %s (ranks publish at gmem.step(), and under gmem.torch "
                     "after optimizer steps)" % ("s" if len(missing) > 1 else "",
                                                 ", ".join(map(str, missing))))
    return "\n".join(lines)
