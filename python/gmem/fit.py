"""What fits: the largest batch size, found by measuring a few small steps under gmem.

    def step(batch_size):                  # one whole training step at that batch size
        loss = model(next_batch(batch_size)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    fit = gmem.fit_batch_size(step)        # 3 small probes, then 1 step at the pick
    print(fit)                             # the pick, the parts of the peak, the steps it ran
    fit.batch_size

Why it works: gmem counts every byte a step allocates, and holds within about 1% of it, so the
peak of a step is known exactly at any batch size it ran. For nearly every model that peak is
affine in the batch size: peak(b) = fixed + per_sample * b, where fixed is what the step holds
whatever the batch (weights, optimizer state, gradients, workspaces) and per_sample what one
more sample adds (activations saved for backward, temporaries live at the peak). Two steady
probes give the line; a third checks it; the pick is the largest b whose predicted peak, plus
gmem's own overhead measured in the probes, fits the memory gmem may use; one real step at the
pick verifies it. Where memory is not affine (the prediction misses the verified step by more
than `tolerance`), fit_batch_size says so and searches instead, stepping back from any batch
that ran out of memory. An out-of-memory inside a probe is caught: the program never sees it.

The probes run the user's step for real, so they update the weights (a few optimizer steps at
small batches). Pass `restore=(model, optimizer)` to have both put back afterwards.

docs/fit.md has the method, its limits and the measured results.
"""

import gc
import math
import numbers
import time

from . import memory
from ._summary import format_bytes
from .errors import GmemError, InvalidArgumentError, OutOfMemoryError

# A probe whose memory kept after the step grew by more than this created state (the optimizer's,
# gradients kept with set_to_none=False): its peak is not yet the steady one.
_STATE_GREW = 1 << 20


class FitError(GmemError):
    """No batch size fits, or the fit could not go on; the message says what was measured.
    `.fit` holds what was learned so far (a Fit, whose .steps lists the steps run)."""

    def __init__(self, message, fit=None):
        super().__init__(message)
        self.fit = fit


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


class _Line:
    """peak(b) = fixed + per_sample * b through the larger probe `b`, with the slope of the chord
    from `a` (allocated bytes), or `slope` where that is steeper. `b_peak` stands for b's peak
    where b ran out of memory (the least its peak would have been)."""

    def __init__(self, a, b, slope=None, b_peak=None):
        if a.batch_size == b.batch_size:
            raise ValueError("a line needs two batch sizes")
        top = b.peak_allocated if b_peak is None else b_peak
        self.per_sample = (top - a.peak_allocated) / float(b.batch_size - a.batch_size)
        if slope is not None and slope > self.per_sample:
            self.per_sample = slope
        self.fixed = top - self.per_sample * b.batch_size
        self.through = (a.batch_size, b.batch_size)

    def peak(self, batch_size):
        return self.fixed + self.per_sample * batch_size

    def largest(self, budget):
        """The largest batch whose peak is at most `budget` (None: no limit from this line)."""
        if self.per_sample <= 0:
            return None
        return int(math.floor((budget - self.fixed) / self.per_sample))


def _saved_slope(a, b):
    """Bytes autograd saved for backward per sample between two probes (None without them).
    Where a step's peak comes after its backward (the optimizer's, at small batches), the peak
    hides the activations; what autograd saves still grows with the batch."""
    if a.saved_bytes is None or b.saved_bytes is None or a.batch_size == b.batch_size:
        return None
    return (b.saved_bytes - a.saved_bytes) / float(b.batch_size - a.batch_size)


class Fit:
    """What fit_batch_size() found. print() it for the table; .as_dict() for the numbers.

    batch_size      the pick: the largest batch that ran, and that the fit says is the largest
    budget          bytes gmem may hold (the limit in force, or what the device has free)
    limit           gmem's memory limit during the fit; device_total, held_outside: the device's
                    memory and what other users hold of it (CUDA context, NCCL, other processes)
    resident        allocated when a step begins: weights, optimizer state, buffers
    step_fixed      what every step adds whatever its batch: gradients, workspaces
    per_sample      bytes one more sample adds to the peak
    saved_per_sample  of which autograd saved for backward (torch steps; None otherwise)
    overhead        gmem's reserved bytes beyond allocated at the largest probe's peak
    predicted_peak  allocated bytes at the pick, from the line; measured_peak, from the step
    affine          the probes and the verified step lie on one line (within `tolerance`)
    method          "predicted" (the line's pick, verified) or "searched"
    steps           every step run, in order (Probe objects)
    notes           what was assumed or found along the way
    """

    def __init__(self):
        self.batch_size = None
        self.budget = 0
        self.limit = 0
        self.device_total = 0
        self.held_outside = 0
        self.resident = 0
        self.step_fixed = 0
        self.per_sample = 0
        self.saved_per_sample = None
        self.overhead = 0
        self.predicted_peak = None
        self.measured_peak = None
        self.measured_reserved = None
        self.affine = None
        self.method = None
        self.upper_bound = None  # the smallest batch seen to run out of memory, if any
        self.steps = []
        self.notes = []
        self.seconds = 0.0
        self.rank_batch_size = None  # this rank's own pick, before ranks agreed (distributed)

    @property
    def fixed(self):
        return self.resident + self.step_fixed

    @property
    def out_of_memory_caught(self):
        return sum(1 for s in self.steps if not s.ok)

    def predicted(self, batch_size):
        """Predicted peak allocated bytes at `batch_size` (from the line)."""
        return self.fixed + self.per_sample * batch_size

    def as_dict(self):
        out = {name: getattr(self, name) for name in (
            "batch_size", "budget", "limit", "device_total", "held_outside", "resident",
            "step_fixed", "per_sample", "saved_per_sample", "overhead", "predicted_peak",
            "measured_peak", "measured_reserved", "affine", "method", "upper_bound", "notes",
            "seconds", "rank_batch_size")}
        out["fixed"] = self.fixed
        out["steps"] = [s.as_dict() for s in self.steps]
        return out

    def __repr__(self):
        return "<gmem.Fit batch_size=%s (%s, %d steps)>" % (self.batch_size, self.method,
                                                            len(self.steps))

    def __str__(self):
        b = self.batch_size
        lines = ["gmem.fit_batch_size: batch size %s fits in %s (%s)" % (
            b, format_bytes(self.budget), self._budget_source())]
        rows = [("resident: weights, optimizer state", self.resident, None),
                ("per step: gradients, workspaces", self.step_fixed, None),
                ("per sample", self.per_sample, self.per_sample * b if b else None)]
        if self.saved_per_sample is not None:
            rows.append(("  saved for backward", self.saved_per_sample,
                         self.saved_per_sample * b if b else None))
            rows.append(("  temporaries at the peak", self.per_sample - self.saved_per_sample,
                         (self.per_sample - self.saved_per_sample) * b if b else None))
        rows.append(("gmem's overhead (reserved - allocated)", self.overhead, None))
        width = max(len(r[0]) for r in rows)
        lines.append("  %-*s  %12s  %14s" % (width, "part of the peak", "bytes", "at %s" % b))
        for name, value, at in rows:
            lines.append(("  %-*s  %12s  %14s" % (width, name, format_bytes(value),
                                                  format_bytes(at) if at is not None else "")
                          ).rstrip())
        if self.predicted_peak is not None:
            line = "  peak allocated at %s: predicted %s" % (b, format_bytes(self.predicted_peak))
            if self.measured_peak is not None:
                error = (self.measured_peak - self.predicted_peak) / float(self.predicted_peak)
                line += ", measured %s (%+.1f%%)" % (format_bytes(self.measured_peak), 100 * error)
            lines.append(line)
        steps = ", ".join("%d %s%s" % (s.batch_size, s.kind, "" if s.ok else " (out of memory)")
                          for s in self.steps)
        lines.append("  steps run: %s; %.1f s; %s" % (
            steps, self.seconds, "the model is %s in the batch" % (
                "affine" if self.affine else "not affine" if self.affine is False else
                "taken as affine")))
        if self.out_of_memory_caught:
            lines.append("  %d out-of-memory error%s caught inside the fit; none reached the "
                         "program" % (self.out_of_memory_caught,
                                      "" if self.out_of_memory_caught == 1 else "s"))
        for note in self.notes:
            lines.append("  note: " + note)
        return "\n".join(lines)

    def _budget_source(self):
        parts = []
        if self.limit and self.device_total and self.limit < self.device_total:
            parts.append("gmem's limit %s" % format_bytes(self.limit))
        else:
            parts.append("the device's %s" % format_bytes(self.device_total))
        if self.held_outside:
            parts.append("%s held outside gmem" % format_bytes(self.held_outside))
        return ", ".join(parts)


# --- measuring one step ----------------------------------------------------------------------


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
    from . import observe
    try:
        report = observe.last_oom_report(device, as_json=True)
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


# --- the fit --------------------------------------------------------------------------------


def _check_sizes(probes, max_batch_size):
    if probes is not None:
        probes = list(probes)
        if len(probes) < 2:
            raise InvalidArgumentError("probes: at least two batch sizes, got %r" % (probes,))
        for b in probes:
            if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
                raise InvalidArgumentError("probes: batch sizes are ints >= 1, got %r" % (b,))
        if sorted(set(probes)) != probes:
            raise InvalidArgumentError("probes: distinct batch sizes in increasing order, got %r"
                                       % (probes,))
    if max_batch_size is not None and (isinstance(max_batch_size, bool) or
                                       not isinstance(max_batch_size, numbers.Integral) or
                                       max_batch_size < 1):
        raise InvalidArgumentError("max_batch_size: an int >= 1, got %r" % (max_batch_size,))
    return probes


def fit_batch_size(step, probes=None, limit=None, max_batch_size=None, device=None,
                   tolerance=0.02, max_steps=10, restore=None, count_saved=True,
                   distributed=True, timeout=300.0, _wrap=None, _verify=True, _empty_cache=True):
    """The largest batch size at which `step(batch_size)` runs in the memory gmem may use,
    found by measurement: 3 small probes and 1 verified step when the step's peak is affine in
    the batch (nearly every model), a short search otherwise. Returns a Fit (print it).

    step            a callable running one whole step (forward, backward, optimizer step) at
                    the batch size it is given, whose memory goes through gmem (PyTorch under
                    gmem.torch, or gmem.malloc). It must not keep what it allocates beyond what
                    a training loop keeps (weights, optimizer state).
    probes          the first batch sizes to run, increasing (default: 1, 2, then one chosen
                    halfway to the predicted largest); a sequence model should be probed at
                    its longest sequence.
    limit           the memory to fit in, set as gmem's limit for the fit and put back after:
                    bytes, or a fraction of the device (default: the limit in force:
                    gmem.set_memory_limit or torch.cuda.set_per_process_memory_fraction, or
                    the device's memory, less what is held outside gmem).
    max_batch_size  never probe or pick above this (the dataset's size, say).
    tolerance       how far (a fraction of the peak) the verified step may miss the line
                    before the memory is called not affine and searched instead.
    max_steps       the most steps the fit runs in all (probes, verification, search).
    restore         (model, optimizer), or a list of objects with state_dict/load_state_dict:
                    their state is copied to the host before the fit and loaded back after, so
                    the probes' updates are undone.
    distributed     under torch.distributed, every rank fits and all ranks take the smallest
                    pick (and agree on every batch size before running it, so that ranks run
                    the same steps); a rank that does not answer within `timeout` seconds fails
                    the fit with FitError on the others, rather than hanging them.

    Raises FitError when not even the smallest probe fits (its message gives the parts).
    """
    probes = _check_sizes(probes, max_batch_size)
    if not 0 < tolerance < 1:
        raise InvalidArgumentError("tolerance: a fraction in (0, 1), got %r" % (tolerance,))
    if max_steps < 3:
        raise InvalidArgumentError("max_steps: at least 3, got %r" % (max_steps,))
    agreement = _Agreement.for_job(timeout) if distributed else None
    saved_state = _save_state(restore)
    fit = Fit()
    started = time.perf_counter()
    try:
        with _LimitInForce(limit, device):
            # Free cached memory goes back first, so that what the probes reserve is their own
            # (gmem's overhead is measured from it).
            if _empty_cache:
                memory.empty_cache(device)
            _fit(step, fit, probes, max_batch_size, device, tolerance, max_steps, count_saved,
                 agreement, _wrap, _verify)
    finally:
        fit.seconds = time.perf_counter() - started
        _load_state(restore, saved_state)
        # The probes' peaks are the fit's: the program's own start from here.
        memory.reset_peak_memory_stats(device)
    return fit


def _fit(step, fit, probes, max_batch_size, device, tolerance, max_steps, count_saved,
         agreement, wrap, verify):
    runner = _Runner(step, device, count_saved, fit, wrap)
    fit.budget, fit.limit, fit.device_total, fit.held_outside = _budget(device)
    if agreement is not None:
        fit.budget = agreement.min(fit.budget)
    cap = (lambda b: b) if max_batch_size is None else (lambda b: min(b, max_batch_size))
    sizes = probes if probes is not None else [1, 2]
    sizes = [b for b in sizes if b <= cap(b)] or [1]

    def run(b, kind):
        if agreement is not None:
            b = agreement.min(b)
        probe = runner.run(b, kind)
        if agreement is not None and not agreement.all(probe.ok) and probe.ok:
            probe.ok = False  # this rank ran it, another did not: no rank may go on with it
            probe.error = "another rank ran out of memory at this batch size"
        return probe

    ran = []
    for b in sizes[:2]:
        p = run(b, "probe")
        ran.append(p)
        if not p.ok:
            break
    if not ran[0].ok:
        fit.upper_bound = ran[0].batch_size
        raise FitError(_nothing_fits(fit, ran[0]), fit)
    if not ran[-1].ok:  # the second probe already ran out: search below it
        return _settle(fit, ran[0], ran[-1], runner, max_steps, cap, run)

    # The third probe: given, or halfway from the second to the largest the first two predict.
    first, second = ran
    if probes is not None:
        third = sizes[2] if len(sizes) > 2 else 0  # the sizes asked for, and no more
    else:
        line = _Line(first, second, slope=_saved_slope(first, second))
        estimate = line.largest(fit.budget - _overhead(None, ran))
        if estimate is None:
            third = 8 * second.batch_size  # the peak does not grow yet: look further out
        else:
            third = second.batch_size + max(1, (estimate - second.batch_size) // 2)
        third = cap(min(third, _FURTHEST * second.batch_size))
    if third > second.batch_size:
        p = run(third, "probe")
        ran.append(p)
        if not p.ok:
            fit.upper_bound = p.batch_size
            fit.affine = False
            fit.notes.append("the probe at %d, halfway to what the first two predict, ran out of "
                             "memory (caught): memory grows faster than a line here; searching "
                             "below it" % p.batch_size)
            return _settle(fit, second, p, runner, max_steps, cap, run)

    notes_before = len(fit.notes)
    while True:
        del fit.notes[notes_before:]  # what the last line said: this one says it again
        line, pick, kinked = _line_and_pick(fit, ran, tolerance, cap)
        last = ran[-1]
        # A pick far beyond every probe rests on a slope too small to trust (the peak did not
        # grow yet: a phase that does not scale with the batch sets it). Look further out first,
        # a bounded step at a time, as long as the steps allow.
        if pick is not None and pick <= _REACH * last.batch_size:
            # Smaller probes above the line say a phase that does not scale (the optimizer
            # step) set their peak: the line's own smaller probe may sit on that bend and its
            # slope be too shallow. Where the pick is far, a probe halfway to it goes first.
            if not (kinked and pick > 2 * last.batch_size and len(fit.steps) + 3 <= max_steps):
                break
            p = run(last.batch_size + (pick - last.batch_size) // 2, "probe")
            ran.append(p)
            if not p.ok:
                fit.upper_bound = p.batch_size
                return _settle(fit, last, p, runner, max_steps, cap, run)
            continue
        if len(fit.steps) + 2 > max_steps or (max_batch_size is not None and
                                              last.batch_size >= max_batch_size):
            if pick is None:
                if max_batch_size is None:
                    raise FitError("the step's peak does not grow with its batch size (%s at %d, "
                                   "%s at %d): pass max_batch_size" % (
                                       format_bytes(ran[-2].peak_allocated), ran[-2].batch_size,
                                       format_bytes(last.peak_allocated), last.batch_size), fit)
                pick = max_batch_size
            break
        p = run(cap(_REACH * last.batch_size), "probe")
        ran.append(p)
        if not p.ok:
            fit.upper_bound = p.batch_size
            fit.notes.append("the peak barely grew up to %d; the probe at %d ran out of memory "
                             "(caught): searching between them" % (last.batch_size, p.batch_size))
            return _settle(fit, last, p, runner, max_steps, cap, run)
    fit.predicted_peak = int(line.peak(max(pick, 1)))
    if pick <= last.batch_size:
        # The largest probe is already at (or past) what the line allows: it is the pick.
        return _settle(fit, last, None, runner, max_steps, cap, run, line=line,
                       method="predicted")
    if not verify:
        fit.batch_size, fit.method = pick, "predicted"
        return fit
    p = run(pick, "verify")
    if p.ok:
        fit.measured_peak, fit.measured_reserved = p.peak_allocated, p.peak_reserved
        miss = (p.peak_allocated - fit.predicted_peak) / float(fit.predicted_peak)
        if abs(miss) <= tolerance or (pick == max_batch_size and miss <= tolerance):
            fit.batch_size = p.batch_size
            fit.method = "predicted"
            if max_batch_size is not None and pick == max_batch_size:
                fit.notes.append("max_batch_size (%d) bounds the pick" % max_batch_size)
                return fit
            # The overhead was taken from a smaller probe; what the verified step reserved says
            # whether whole samples more still fit (where a sample is small against a page).
            room = fit.budget - p.peak_reserved
            more = int(room // fit.per_sample) if fit.per_sample > 0 else 0
            if more >= 1 and len(fit.steps) < max_steps:
                return _settle(fit, p, None, runner, max_steps, cap, run, line=line,
                               method="predicted", first_guess=cap(pick + more))
            return fit
        fit.affine = False
        fit.notes.append("the verified step peaked at %s, %+.1f%% off the line: memory is not "
                         "affine in the batch here; searching from it" % (
                             format_bytes(p.peak_allocated), 100.0 * miss))
        return _settle(fit, p, None, runner, max_steps, cap, run, line=_Line(last, p))
    fit.upper_bound = p.batch_size
    fit.notes.append("the step at the predicted %d ran out of memory (caught): stepping back"
                     % pick)
    return _settle(fit, last, p, runner, max_steps, cap, run)


def _line_and_pick(fit, ran, tolerance, cap):
    """The line through the two largest steady probes (the saved bytes' slope where steeper),
    the parts of the peak it gives, and the largest batch it fits (None: the peak does not grow)."""
    steady = [p for p in ran if p.steady]
    if len(steady) < 2:
        steady = ran[-2:]
        fit.notes.append("the probes' steps kept more memory each time (%s): the line is drawn "
                         "through the last two" % ", ".join(
                             "+%s" % format_bytes(p.after - p.before) for p in ran))
    elif ran[0] not in steady:
        fit.notes.append("the first step created %s of state (optimizer state, gradients): its "
                         "peak is left out of the line" % format_bytes(ran[0].after - ran[0].before))
    a, b = steady[-2], steady[-1]
    saved = _saved_slope(a, b)
    chord = _Line(a, b)
    line = _Line(a, b, slope=saved)
    if saved is not None and saved > (1 + tolerance) * chord.per_sample:
        fit.notes.append(
            "the peak grew by %s a sample between %d and %d, less than autograd saves (%s): the "
            "smaller step peaked elsewhere (in the optimizer step, say), so the line takes the "
            "saved bytes' slope" % (format_bytes(chord.per_sample), a.batch_size,
                                    b.batch_size, format_bytes(saved)))
    fit.affine = True
    kinked = False
    for p in steady[:-2]:  # a steady probe off the line says the memory is not affine
        off = p.peak_allocated - line.peak(p.batch_size)
        if abs(off) > tolerance * p.peak_allocated:
            fit.affine = False
            kinked = kinked or off > 0
            fit.notes.append("the probe at %d peaked at %s, %s off the line through %d and %d" % (
                p.batch_size, format_bytes(p.peak_allocated), format_bytes(off), *line.through))
    _parts(fit, line, steady, ran)
    largest = line.largest(fit.budget - fit.overhead)
    return line, (None if largest is None else cap(largest)), kinked


# A probe past the largest that ran reaches at most this many times further, where the line
# rests on a slope the probes barely saw.
_REACH = 8

# How far the third probe may reach past the second (a multiple of it), when the first two
# probes say little: far enough to see the activations, not so far that one probe is a big step.
_FURTHEST = 32


def _settle(fit, lo, failed, runner, max_steps, cap, run, line=None, method="searched",
            first_guess=None):
    """Searches between `lo`, the largest batch seen to run, and `failed`, the smallest probe
    seen to run out (None: none yet), until they meet or the steps run out. Each next size comes
    from the line through the last two that ran; once a step ran out, from the line through the
    largest that ran and the least the failed step needed (its allocated bytes plus the request
    that failed), kept inside the bracket. The pick is the largest that ran."""
    fit.method = method
    good = [s for s in fit.steps if s.ok]
    budget = fit.budget - fit.overhead
    out_of_steps = False
    while True:
        if len(fit.steps) >= max_steps:
            out_of_steps = True
            break
        hi = failed.batch_size if failed is not None else None
        if hi is not None and hi - lo.batch_size <= 1:
            break
        if failed is not None and failed.needed > lo.peak_allocated:
            line = _Line(lo, failed, b_peak=failed.needed)
        guess = line.largest(budget) if line is not None else None
        if first_guess is not None:
            guess, first_guess = first_guess, None
        if guess is None:
            guess = lo.batch_size * 2 if hi is None else (lo.batch_size + hi) // 2
        guess = cap(guess)
        if hi is not None:
            guess = min(guess, hi - 1)
        if guess <= lo.batch_size:
            break  # the line says the largest that ran is the largest that fits
        p = run(guess, "search")
        if p.ok:
            good.append(p)
            line = _Line(lo, p)
            lo = p
        else:
            failed = p
            fit.upper_bound = (p.batch_size if fit.upper_bound is None
                               else min(fit.upper_bound, p.batch_size))
    fit.batch_size = lo.batch_size
    fit.measured_peak, fit.measured_reserved = lo.peak_allocated, lo.peak_reserved
    if out_of_steps and failed is not None and failed.batch_size - lo.batch_size > 1:
        fit.notes.append("the search stopped after max_steps (%d) steps: the largest batch lies "
                         "in [%d, %d)" % (max_steps, lo.batch_size, failed.batch_size))
    elif failed is None or failed.batch_size - lo.batch_size > 1:
        fit.notes.append("the line through the last steps that ran puts the largest batch at %d "
                         "(%d was not run)" % (lo.batch_size, lo.batch_size + 1))
    top = sorted(good, key=lambda s: s.batch_size)[-2:]
    if len(top) == 2 and top[0].batch_size != top[1].batch_size:
        _parts(fit, _Line(top[0], top[1]), top, good)
    return fit


def _overhead(fit, probes):
    """gmem's reserved bytes beyond allocated at the peak, from the largest probe whose step
    grew what gmem reserves (one that did not ran inside memory reserved before: it says
    nothing of the overhead); 1% of the peak where no probe grew it."""
    ok = [p for p in probes if p.ok]
    for p in reversed(ok):
        if p.peak_reserved > p.reserved_before:
            return max(0, p.peak_reserved - p.peak_allocated)
    if not ok:
        return 0
    if fit is None:
        return ok[-1].peak_allocated // 100
    note = ("no probe grew gmem's reserved memory (memory reserved before the fit covered them): "
            "its overhead is taken as 1% of the peak")
    if note not in fit.notes:
        fit.notes.append(note)
    return ok[-1].peak_allocated // 100


def _parts(fit, line, steady, ran):
    fit.resident = steady[-1].before
    fit.per_sample = max(0, int(round(line.per_sample)))
    fit.step_fixed = max(0, int(round(line.fixed)) - fit.resident)
    fit.overhead = _overhead(fit, ran)
    with_saved = [p for p in steady if p.saved_bytes is not None]
    if len(with_saved) >= 2:
        a, b = with_saved[-2], with_saved[-1]
        per = (b.saved_bytes - a.saved_bytes) / float(b.batch_size - a.batch_size)
        fit.saved_per_sample = int(round(min(max(per, 0), fit.per_sample)))


def _nothing_fits(fit, probe):
    return ("not even batch size %d fits in %s (%s): the step began with %s allocated (weights, "
            "optimizer state) and ran out of memory at a peak of %s. Make the model and its state "
            "smaller (bf16 weights, a sharded optimizer) or give gmem more memory." % (
                probe.batch_size, format_bytes(fit.budget), fit._budget_source(),
                format_bytes(probe.before), format_bytes(probe.peak_allocated)))


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


# --- several ranks ------------------------------------------------------------------------------


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


# --- what-ifs: the usual levers ---------------------------------------------------------------


class Row:
    """One setting of what_fits()'s table: its peak allocated bytes at the reference batch (the
    batch that fits as is), its largest batch,
    and whether both were measured (steps run at that setting) or estimated (from the parts)."""

    __slots__ = ("setting", "peak", "batch_size", "how", "why", "fit", "micro_batch",
                 "accumulation_steps")

    def __init__(self, setting, peak, batch_size, how, why="", fit=None):
        self.setting, self.peak, self.batch_size, self.how, self.why = (setting, peak, batch_size,
                                                                        how, why)
        self.fit = fit
        self.micro_batch = None
        self.accumulation_steps = None

    def as_dict(self):
        out = {name: getattr(self, name) for name in self.__slots__ if name != "fit"}
        return out


class WhatFits:
    """What what_fits() returns: rows (the recommendation first), the reference batch size the
    peaks are given at, and the base fit. print() it for the table."""

    def __init__(self, base, rows, reference, target):
        self.base, self.rows, self.reference, self.target = base, rows, reference, target

    @property
    def recommendation(self):
        return self.rows[0]

    def as_dict(self):
        return {"reference_batch_size": self.reference, "target_batch_size": self.target,
                "rows": [r.as_dict() for r in self.rows], "fit": self.base.as_dict()}

    def __str__(self):
        head = ("setting", "peak at %d" % self.reference, "largest batch", "how")
        body = []
        for i, r in enumerate(self.rows):
            name = r.setting + ("  <- recommended" if i == 0 else "")
            body.append((name, format_bytes(r.peak) if r.peak is not None else "-",
                         str(r.batch_size) if r.batch_size is not None else "none", r.how))
        widths = [max(len(row[i]) for row in [head] + body) for i in range(4)]
        fmt = "  %-{0}s  %{1}s  %{2}s  %s".format(*widths[:3])
        lines = ["gmem.what_fits: in %s%s" % (
            format_bytes(self.base.budget),
            ", for a global batch of %d" % self.target if self.target else "")]
        lines.append(fmt % head)
        lines.extend(fmt % row for row in body)
        for r in self.rows:
            if r.why:
                lines.append("  %s: %s" % (r.setting, r.why))
        return "\n".join(lines)


def _autocast(dtype_name):
    import torch
    dtype = getattr(torch, dtype_name)
    return lambda: torch.autocast("cuda", dtype=dtype)


def _checkpointing_toggles(model, checkpointing):
    if checkpointing is not None:
        enable, disable = checkpointing
        return enable, disable
    if model is not None and hasattr(model, "gradient_checkpointing_enable"):
        return model.gradient_checkpointing_enable, model.gradient_checkpointing_disable
    return None


def _row_from_fit(setting, fit, reference, how):
    peak = int(fit.predicted(reference)) if fit.per_sample else None
    return Row(setting, peak, fit.batch_size, how, fit=fit)


def what_fits(step, model=None, target_batch_size=None, levers=("bf16", "checkpointing",
              "no_grad", "accumulation"), checkpointing=None, limit=None, device=None,
              max_batch_size=None, restore=None, **fit_options):
    """The usual levers against running out of memory, each with the largest batch it fits:
    setting -> peak at the batch that fits as is -> largest batch. The first row is the
    recommendation: the cheapest setting that reaches `target_batch_size` (a global batch), or,
    without a target, the largest batch among the settings that cost no extra compute.

    Measured (2 more steps each, at the fit's probe sizes, extrapolated on their line):
      "bf16", "fp16"     the step under torch.autocast("cuda", dtype)
      "checkpointing"    activation checkpointing, toggled by `checkpointing=(enable, disable)`
                         or a Hugging Face model's gradient_checkpointing_enable/disable
    Estimated from the parts of the fit:
      "no_grad"          inference under torch.no_grad(): the weights (of `model`) and the
                         per-sample temporaries, without what autograd saves, the gradients
                         and the optimizer state
      "accumulation"     with `target_batch_size`: the micro-batch and the number of
                         accumulation steps that reach it (gradients accumulate in place, so
                         the peak is the micro-batch's)
    `step`, `limit`, `device`, `max_batch_size`, `restore` and the other options are
    fit_batch_size()'s. Returns WhatFits (print it; .rows, .recommendation, .as_dict())."""
    saved_state = _save_state(restore)
    try:
        base = fit_batch_size(step, limit=limit, device=device, max_batch_size=max_batch_size,
                              **fit_options)
        reference = base.batch_size
        rows = [_row_from_fit("as is", base, reference, "measured (fit, verified)")]
        sizes = sorted({s.batch_size for s in base.steps if s.ok and s.kind == "probe"})[-2:]
        if len(sizes) < 2:
            sizes = [max(1, reference // 4), max(2, reference // 2)]
        measured = {}
        for lever in levers:
            if lever in ("bf16", "fp16"):
                torch = _torch()
                if torch is None:
                    continue
                name = {"bf16": "bfloat16", "fp16": "float16"}[lever]
                fit = fit_batch_size(step, probes=sizes, limit=limit, device=device,
                                     max_batch_size=max_batch_size, _wrap=_autocast(name),
                                     _verify=False, _empty_cache=False, **fit_options)
                measured[lever] = fit
                rows.append(_row_from_fit("%s autocast" % lever, fit, reference,
                                          "measured at %d, %d" % tuple(sizes)))
            elif lever == "checkpointing":
                toggles = _checkpointing_toggles(model, checkpointing)
                if toggles is None:
                    continue
                enable, disable = toggles
                enable()
                try:
                    fit = fit_batch_size(step, probes=sizes, limit=limit, device=device,
                                         max_batch_size=max_batch_size, _verify=False,
                                         _empty_cache=False, **fit_options)
                finally:
                    disable()
                measured[lever] = fit
                rows.append(_row_from_fit("activation checkpointing", fit, reference,
                                          "measured at %d, %d" % tuple(sizes)))
        if "no_grad" in levers and model is not None and base.saved_per_sample is not None:
            weights = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
                b.numel() * b.element_size() for b in model.buffers())
            per = max(0, base.per_sample - base.saved_per_sample)
            budget = base.budget - base.overhead
            largest = int((budget - weights) // per) if per else None
            if max_batch_size is not None and largest is not None:
                largest = min(largest, max_batch_size)
            rows.append(Row("inference under no_grad", int(weights + per * reference), largest,
                            "estimated", "weights %s + %s a sample (the step's per-sample "
                            "temporaries)" % (format_bytes(weights), format_bytes(per))))
        return WhatFits(base, _rank(rows, target_batch_size, "accumulation" in levers),
                        reference, target_batch_size)
    finally:
        _load_state(restore, saved_state)


# Extra compute a setting costs, for ranking: none, none, none, a recomputed forward.
_COST = {"as is": 0, "bf16 autocast": 0, "fp16 autocast": 0, "activation checkpointing": 1}


def _rank(rows, target, accumulate):
    training = [r for r in rows if r.setting in _COST and r.batch_size]
    cheap = [r for r in training if _COST[r.setting] == 0]
    if target:
        reach = [r for r in training if r.batch_size >= target]
        if reach:
            best = min(reach, key=lambda r: (_COST[r.setting], -r.batch_size))
            best.why = best.why or "the cheapest setting that fits a batch of %d at once" % target
        elif accumulate and (cheap or training):
            source = max(cheap or training, key=lambda r: r.batch_size)
            steps = -(-target // source.batch_size)
            micro = -(-target // steps)
            best = Row("%s, accumulating %d x %d" % (source.setting, steps, micro),
                       int(source.fit.predicted(micro) + source.fit.overhead), micro,
                       "estimated (from the %s line)" % source.setting,
                       "%d micro-batches of %d reach %d; the peak is a micro-batch's"
                       % (steps, micro, steps * micro))
            best.micro_batch, best.accumulation_steps = micro, steps
            rows = rows + [best]
        else:
            best = max(training, key=lambda r: r.batch_size) if training else rows[0]
    else:
        pool = cheap or training or rows
        best = max(pool, key=lambda r: (r.batch_size or 0, -_COST.get(r.setting, 2)))
    return [best] + [r for r in rows if r is not best]


# --- the shape of accelerate's find_executable_batch_size ----------------------------------------


class _StepDone(BaseException):
    """Ends a probe's run of the user's function after its first steps. A BaseException, so that
    a training loop's `except Exception` does not swallow it."""


class _StopAfterSteps:
    """Raises _StepDone once `steps` steps have ended: after optimizer.step() (torch's global
    post-hook) or gmem.step()."""

    def __init__(self, steps):
        self.steps = steps
        self.seen = 0
        self._handle = None

    def _ended(self, *args):
        self.seen += 1
        if self.seen >= self.steps:
            raise _StepDone()

    def __enter__(self):
        from . import observe
        observe.step_listeners.append(self._ended)
        if _torch() is not None:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            self._handle = register_optimizer_step_post_hook(self._ended)
        return self

    def __exit__(self, *exc):
        from . import observe
        observe.step_listeners.remove(self._ended)
        if self._handle is not None:
            self._handle.remove()
        return False


def find_executable_batch_size(function=None, starting_batch_size=128, steps_per_probe=2,
                               **fit_options):
    """A decorator with the shape of accelerate's find_executable_batch_size, that measures
    instead of halving after each out-of-memory:

        @gmem.find_executable_batch_size(starting_batch_size=128)
        def train(batch_size, epochs):
            model, optimizer = make_model()      # made inside, as accelerate asks
            for batch in loader(batch_size): ...
        train(3)                                 # runs at the largest batch size that fits

    The function is first run as a probe at a few small batch sizes, each stopped after
    `steps_per_probe` steps (a step ends at optimizer.step() or gmem.step(); two, so that the
    optimizer state the first step creates is in the peak); then once, to the end, at the pick
    (fit_batch_size's, at most starting_batch_size). Should that run still run out of memory,
    it is run again at a smaller size, as accelerate does. The fit is kept as `train.fit`."""
    if function is None:
        return lambda f: find_executable_batch_size(f, starting_batch_size, steps_per_probe,
                                                    **fit_options)
    import functools

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        def probe(batch_size):
            try:
                with _StopAfterSteps(steps_per_probe):
                    function(batch_size, *args, **kwargs)
            except _StepDone:
                pass

        fit = fit_batch_size(probe, max_batch_size=starting_batch_size, **fit_options)
        wrapper.fit = fit
        batch_size = fit.batch_size
        while True:
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 (anything but out-of-memory is re-raised)
                if not is_out_of_memory(e) or batch_size == 1:
                    raise
                e.__traceback__ = None
                del e
                gc.collect()
                batch_size = max(1, batch_size - max(1, batch_size // 8))
                fit.notes.append("the run at the pick ran out of memory; ran again at %d"
                                 % batch_size)

    wrapper.fit = None
    return wrapper
