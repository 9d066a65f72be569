"""Ranks agreeing on a value during gmem.fit_batch_size, through torch.distributed's store."""

from .errors import FitError

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
        from . import distributed
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
        import datetime
        self.rounds += 1
        key = "%s%d/" % (self.prefix, self.rounds)
        self.store.set(key + str(self.rank), str(value))
        keys = [key + str(r) for r in range(self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 (the store's timeout error differs by backend)
            missing = [r for r in range(self.world_size)
                       if not _has(self.store, key + str(r))]
            raise FitError("gmem.fit_batch_size: rank%s %s did not answer within %.0f s (%s)"
                           % ("s" if len(missing) != 1 else "",
                              ", ".join(map(str, missing)) or "?", self.timeout, e)) from None
        return [int(float(_text(self.store.get(k)))) for k in keys]

    def min(self, value):
        return min(self._exchange(int(value)))

    def all(self, flag):
        return min(self._exchange(1 if flag else 0)) == 1


def _has(store, key):
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001
        return False


def _text(value):
    return value.decode() if isinstance(value, bytes) else str(value)
