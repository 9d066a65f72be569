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


import math
import numbers
import time

from . import memory
from ._fit_ranks import _Agreement
from ._fit_run import (Probe, _budget, _LimitInForce, _load_state, _Runner, _save_state,
                       is_out_of_memory)
from ._format import format_bytes
from .errors import FitError, InvalidArgumentError

__all__ = ["Fit", "FitError", "Probe", "fit_batch_size", "is_out_of_memory"]


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
        self.ranks = 1  # ranks that fitted together (torch.distributed); the budget is the smallest

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
            "seconds", "ranks")}
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
        if self.ranks > 1:
            return "the tightest of %d ranks; this rank: %s" % (self.ranks, ", ".join(parts))
        return ", ".join(parts)


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


# The last Fit fit_batch_size() returned in this process (None before any): its table goes on
# gmem.report()'s page.
last_fit = None


def fit_batch_size(step, probes=None, limit=None, max_batch_size=None, device=None,
                   tolerance=0.02, max_steps=10, restore=None, count_saved=True,
                   distributed=True, timeout=300.0, _wrap=None, _verify=True, _empty_cache=True,
                   _agreement=None):
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
    agreement = _agreement
    if agreement is None and distributed:
        agreement = _Agreement.for_job(timeout)
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
    global last_fit
    last_fit = fit  # what gmem.report() and `gmem.run --report` show by default
    return fit


def _fit(step, fit, probes, max_batch_size, device, tolerance, max_steps, count_saved,
         agreement, wrap, verify):
    runner = _Runner(step, device, count_saved, fit, wrap)
    fit.budget, fit.limit, fit.device_total, fit.held_outside = _budget(device)
    own_budget = fit.budget
    if agreement is not None:
        fit.budget = agreement.min(fit.budget)
        fit.ranks = agreement.world_size
    cap = (lambda b: b) if max_batch_size is None else (lambda b: min(b, max_batch_size))
    sizes = probes if probes is not None else [1, 2]
    sizes = [b for b in sizes if b <= cap(b)] or [1]

    def run(b, kind):
        probe = runner.run(b, kind)
        if agreement is not None:  # the job's numbers, so that every rank decides alike
            agreement.combine(probe, own_budget, fit.budget)
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
