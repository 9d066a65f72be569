"""Running one step of the user's at a batch size, and what gmem measures of it: the Probe,
out-of-memory caught and cleaned up, the bytes autograd saves, the memory gmem may use, and the
state a fit puts back afterwards. gmem.fit's search decides which steps to run; this runs them."""

import gc
import time

from . import memory, observe
from ._format import format_bytes
from .errors import InvalidArgumentError, OutOfMemoryError


# A probe whose memory kept after the step grew by more than this created state (the optimizer's,
# gradients kept with set_to_none=False): its peak is not yet the steady one.
_STATE_GREW = 1 << 20


class Probe:
    """One step the fit ran: its batch size, what it was for, and what gmem measured."""

    __slots__ = ("batch_size", "kind", "ok", "peak_allocated", "peak_reserved", "before",
                 "after", "reserved_before", "needed", "saved_bytes", "seconds", "error")

    def __init__(self, batch_size, kind):
        self.batch_size = batch_size
        self.kind = kind            # "probe", "verify" or "search"
        self.ok = False             # the step ran without running out of memory
        self.peak_allocated = 0     # peak allocated bytes during the step
        self.peak_reserved = 0      # peak reserved bytes during the step (gmem's)
        self.before = 0             # allocated bytes when the step began (weights, state)
        self.after = 0              # allocated bytes when it ended
        self.reserved_before = 0    # reserved bytes when the step began
        self.needed = 0             # out of memory: allocated + the request that failed, at least
                                    # what the step's peak would have been
        self.saved_bytes = None     # bytes autograd saved for backward in the step (torch only)
        self.seconds = 0.0          # wall time of the step
        self.error = ""             # the out-of-memory message, when it ran out

    @property
    def steady(self):
        """The step ended holding what it began with: its peak is a steady step's."""
        return self.ok and self.after - self.before <= _STATE_GREW

    def as_dict(self):
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self):
        if not self.ok:
            return "<Probe %s b=%d: out of memory>" % (self.kind, self.batch_size)
        return "<Probe %s b=%d: peak %s>" % (self.kind, self.batch_size,
                                             format_bytes(self.peak_allocated))


# --- running a step ----------------------------------------------------------------------


def is_out_of_memory(error):
    """True for gmem's OutOfMemoryError, torch.OutOfMemoryError (any class of that name), and
    the RuntimeError PyTorch raises for an allocator without the OOM shim."""
    if isinstance(error, (OutOfMemoryError, MemoryError)):
        return True
    if any(cls.__name__ == "OutOfMemoryError" for cls in type(error).__mro__):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def _torch():
    """torch, when gmem is PyTorch's allocator (then steps are torch steps); else None."""
    try:
        from . import torch as gmem_torch
    except ImportError:
        return None
    if not gmem_torch.is_enabled():
        return None
    import torch
    return torch


class _SavedBytes:
    """Counts the bytes autograd saves for backward during a step (distinct CUDA storages),
    through torch's saved-tensor hooks: what one more sample adds there is activations."""

    def __init__(self, torch):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.storages = {}

    def _pack(self, tensor):
        try:
            if tensor.is_cuda:
                storage = tensor.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            pass  # sparse or subclass tensors without one storage
        # Not the tensor itself: an output saved by its own node would then hold that node
        # through its grad_fn, a cycle through C++ that no collector frees, and a step that ran
        # out of memory before its backward would keep its whole graph.
        return tensor.detach()

    @staticmethod
    def _unpack(tensor):
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False

    @property
    def total(self):
        return sum(self.storages.values())


class _Runner:
    """Runs the user's step at a batch size and measures it; an out-of-memory is caught, the
    memory the failed step held is given back, and the probe says it ran out."""

    def __init__(self, step, device, count_saved, fit, wrap=None):
        self.step = step
        self.device = device
        self.torch = _torch()
        self.count_saved = count_saved and self.torch is not None
        self.fit = fit
        self.wrap = wrap  # a context manager factory put around each step (what-ifs)

    def run(self, batch_size, kind):
        probe = Probe(batch_size, kind)
        self._sync()
        probe.before = memory.memory_allocated(self.device)
        probe.reserved_before = memory.memory_reserved(self.device)
        memory.reset_peak_memory_stats(self.device)
        counter = _SavedBytes(self.torch) if self.count_saved else None
        started = time.perf_counter()
        failure = None
        try:
            if counter is not None:
                with counter:
                    self._call(batch_size)
            else:
                self._call(batch_size)
            self._sync()
            probe.ok = True
        except Exception as e:  # noqa: BLE001 (only out-of-memory is caught; the rest re-raised)
            if not is_out_of_memory(e):
                raise
            failure = "%s: %s" % (type(e).__name__, str(e).split("\n", 1)[0])
            # The traceback's frames hold the failed step's tensors: drop them before measuring.
            e.__traceback__ = None
            del e
        probe.seconds = time.perf_counter() - started
        probe.peak_allocated = memory.max_memory_allocated(self.device)
        probe.peak_reserved = memory.max_memory_reserved(self.device)
        if failure is not None:
            probe.error = failure
            probe.needed = max(probe.peak_allocated, _needed_at_failure(self.device))
            self._recover(probe)
        probe.after = memory.memory_allocated(self.device)
        if counter is not None and probe.ok:
            probe.saved_bytes = counter.total
        self.fit.steps.append(probe)
        return probe

    def _call(self, batch_size):
        if self.wrap is None:
            self.step(batch_size)
        else:
            with self.wrap():
                self.step(batch_size)

    def _sync(self):
        if self.torch is not None:
            self.torch.cuda.synchronize()

    def _recover(self, probe):
        """After an out-of-memory: the failed step's tensors are unreachable once the exception
        is gone (gc breaks the cycles a traceback makes). What the step left held beyond what it
        began with (gradients of a backward cut short, say) is reported, not freed: it belongs
        to the program."""
        gc.collect()
        try:
            self._sync()
        except Exception:  # noqa: BLE001 (a device error after an OOM is the program's to meet)
            pass
        left = memory.memory_allocated(self.device) - probe.before
        if left > _STATE_GREW:
            self.fit.notes.append(
                "the step at batch size %d ran out of memory and left %s allocated when it was "
                "caught (gradients of a backward cut short, or state the step creates); it is "
                "counted in the memory held" % (probe.batch_size, format_bytes(left)))


def _needed_at_failure(device):
    """Allocated bytes plus the request that failed, from gmem's report of the last failure."""
    try:
        # libgmem's own report: the two numbers, not the Python layer's holder search
        report = observe._raw_oom_json(-1 if device is None else memory.device_index(device))
    except Exception:  # noqa: BLE001 (the report is a refinement; the peak is the fallback)
        return 0
    if not report:
        return 0
    return int(report.get("allocated", 0)) + int(report.get("request", {}).get("size", 0))


# --- the budget --------------------------------------------------------------------------------


def _budget(device):
    """(budget, limit, device_total, held_outside): bytes gmem may hold, the most of either its
    limit or what it holds plus what the device has free."""
    stats = memory.memory_stats(device)
    limit = stats.get("gmem.memory_limit", 0)
    total = stats.get("gmem.device_total_bytes", 0)
    free = stats.get("gmem.device_free_bytes", 0)
    reserved = stats.get("reserved_bytes.all.current", 0)
    outside = stats.get("gmem.outside_bytes", 0)
    budget = limit if limit else total
    if free or reserved:
        budget = min(budget, reserved + free)
    return budget, limit, total, outside


class _LimitInForce:
    """Sets gmem's limit for the fit (`limit`: bytes, or a fraction of the device) and puts the
    one before back afterwards."""

    def __init__(self, limit, device):
        self.limit = limit
        self.device = device
        self.saved = None

    def __enter__(self):
        if self.limit is not None:
            self.saved = memory.memory_limit(self.device)
            total = memory.memory_stat("gmem.device_total_bytes", self.device)
            memory.set_memory_limit(self.limit, self.device)
            if self.saved >= total:
                self.saved = 0  # there was no cap: remove it again
        return self

    def __exit__(self, *exc):
        if self.limit is not None:
            memory.set_memory_limit(self.saved, self.device)
        return False


# --- restoring what the probes changed --------------------------------------------------------


def _save_state(objects):
    if objects is None:
        return None
    if hasattr(objects, "state_dict"):
        objects = [objects]
    saved = []
    for obj in objects:
        if not hasattr(obj, "state_dict") or not hasattr(obj, "load_state_dict"):
            raise InvalidArgumentError("restore: %r has no state_dict()/load_state_dict()" % (obj,))
        saved.append((obj, _to_host(obj.state_dict())))
    return saved


def _to_host(value):
    """A deep copy with tensors on the host (the fit must not hold device memory of its own)."""
    if hasattr(value, "detach") and hasattr(value, "to"):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((k, _to_host(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


def _load_state(objects, saved):
    if saved is None:
        return
    for obj, state in saved:
        obj.load_state_dict(state)
