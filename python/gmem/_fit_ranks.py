"""Ranks agreeing during gmem.fit_batch_size, through torch.distributed's store.

Every rank runs the fit's decisions on the same numbers, so that all take the same branches and
run the same steps: the budget is the smallest rank's, and each step's measurements are the
tightest rank's, its peaks shifted by how much more budget that rank has than the smallest. A
batch then fits the job exactly when it fits every rank."""

import datetime
import json

from . import distributed
from .errors import FitError

# A probe's byte counts that ranks combine (the most, budget-shifted where they are peaks).
_PEAKS = ("peak_allocated", "peak_reserved", "needed")
_HELD = ("before", "after", "reserved_before")

class _Agreement:
    """Ranks agree on a value through the process group's store, with a timeout: a rank that
    died or hangs makes the others fail with FitError, never wait forever (no collective on the
    device is used, so one rank's out-of-memory cannot leave another stuck inside one)."""

    _fits = [0]  # fits begun in this process: every rank begins as many, in the same order

    def __init__(self, store, rank, world_size, timeout, prefix):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout = float(timeout)
        self.prefix = prefix
        self.rounds = 0

    @classmethod
    def for_job(cls, timeout):
        dist = distributed._dist()
        if dist is None or dist.get_world_size() < 2:
            return None
        store = distributed._store()
        if store is None:
            return None
        cls._fits[0] += 1
        return cls(store, dist.get_rank(), dist.get_world_size(), timeout,
                   "gmem/fit/%d/" % cls._fits[0])

    def _exchange(self, value):
        """Every rank's `value` (JSON), by rank; FitError naming the ranks that did not answer
        within the timeout."""
        self.rounds += 1
        key = "%s%d/" % (self.prefix, self.rounds)
        self.store.set(key + str(self.rank), json.dumps(value))
        keys = [key + str(r) for r in range(self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 (the store's timeout error differs by backend)
            missing = [r for r in range(self.world_size)
                       if not _has(self.store, key + str(r))]
            raise FitError("gmem.fit_batch_size: rank%s %s did not answer within %.0f s (%s)"
                           % ("s" if len(missing) != 1 else "",
                              ", ".join(map(str, missing)) or "?", self.timeout, e)) from None
        return [json.loads(_text(self.store.get(k))) for k in keys]

    def min(self, value):
        return min(self._exchange(int(value)))

    def all(self, flag):
        return all(self._exchange(bool(flag)))

    def combine(self, probe, own_budget, budget):
        """Makes `probe` the job's: run everywhere, the most held, the most needed of the budget
        (a rank's peak shifted by `budget - own_budget`), the most saved."""
        shift = budget - own_budget
        mine = {"ok": probe.ok, "error": probe.error, "saved": probe.saved_bytes}
        mine.update((name, getattr(probe, name) + shift) for name in _PEAKS)
        mine.update((name, getattr(probe, name)) for name in _HELD)
        ranks = self._exchange(mine)
        probe.ok = all(r["ok"] for r in ranks)
        if not probe.ok and not probe.error:
            failed = [i for i, r in enumerate(ranks) if not r["ok"]]
            probe.error = "rank %s ran out of memory at this batch size" % (
                ", ".join(map(str, failed)))
        for name in _PEAKS + _HELD:
            setattr(probe, name, max(r[name] for r in ranks))
        saved = [r["saved"] for r in ranks]
        probe.saved_bytes = None if None in saved else max(saved)
        return probe


def _has(store, key):
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001
        return False


def _text(value):
    return value.decode() if isinstance(value, bytes) else str(value)
