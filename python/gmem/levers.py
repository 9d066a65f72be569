"""What fits under the usual levers against running out of memory: mixed precision, activation
checkpointing, inference under no_grad, gradient accumulation, a cap on sequence length
(gmem.what_fits; docs/fit.md)."""

from ._fit_run import _load_state, _save_state, _torch
from ._format import format_bytes
from .fit import fit_batch_size


class Row:
    """One setting of what_fits()'s table: its peak allocated bytes at the reference batch (the
    batch that fits as is), its largest batch, and whether both were measured (steps run at
    that setting) or estimated (from the parts of the fit)."""

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
        self.per_token = None          # with seq_len: a sample's bytes a token ...
        self.per_token_squared = None  # ... and a token squared (attention's scores)

    @property
    def recommendation(self):
        return self.rows[0]

    def as_dict(self):
        return {"reference_batch_size": self.reference, "target_batch_size": self.target,
                "rows": [r.as_dict() for r in self.rows], "fit": self.base.as_dict(),
                "per_token": self.per_token, "per_token_squared": self.per_token_squared}

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
        if self.per_token is not None:
            lines.append("  a sample at length L: %s x L + %s x L^2 (estimated from the lengths "
                         "measured)" % (format_bytes(self.per_token),
                                        format_bytes(self.per_token_squared)))
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
              "no_grad", "accumulation"), checkpointing=None, seq_len=None, shorter=None,
              limit=None, device=None, max_batch_size=None, restore=None, **fit_options):
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
    Sequence models: with `seq_len`, `step(batch_size, length)` takes the length too; the fit
    runs at `seq_len`, and each length in `shorter` (default: half of it) is measured as a cap
    on the sequence length (2 steps each). The per-sample bytes at two lengths or more split
    into a part per token and attention's part per token squared (WhatFits.per_token,
    .per_token_squared), which estimate any other length.
    `step`, `limit`, `device`, `max_batch_size`, `restore` and the other options are
    fit_batch_size()'s. Returns WhatFits (print it; .rows, .recommendation, .as_dict())."""
    saved_state = _save_state(restore)
    full_step = step
    if seq_len is not None:
        def step(batch_size):
            return full_step(batch_size, seq_len)
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
        per_token = None
        if seq_len is not None:
            lengths = sorted(set(shorter if shorter is not None else (seq_len // 2,)) - {seq_len})
            per_length = {seq_len: base.per_sample}
            for length in lengths:
                fit = fit_batch_size(lambda b, n=length: full_step(b, n), probes=sizes,
                                     limit=limit, device=device, max_batch_size=max_batch_size,
                                     _verify=False, _empty_cache=False, **fit_options)
                per_length[length] = fit.per_sample
                rows.append(_row_from_fit("sequence length %d" % length, fit, reference,
                                          "measured at %d, %d" % tuple(sizes)))
            per_token = _per_token(per_length)
        table = WhatFits(base, _rank(rows, target_batch_size, "accumulation" in levers),
                         reference, target_batch_size)
        if per_token is not None:
            table.per_token, table.per_token_squared = per_token
        return table
    finally:
        _load_state(restore, saved_state)


def _per_token(per_length):
    """(bytes a token, bytes a token squared) of a sample, fitted to the per-sample bytes at two
    lengths or more by least squares (per_sample = a * L + c * L^2); None with one length."""
    if len(per_length) < 2:
        return None
    sums = [0.0] * 5  # sum L^2, L^3, L^4, S*L, S*L^2
    for length, per in per_length.items():
        n = float(length)
        sums[0] += n * n
        sums[1] += n ** 3
        sums[2] += n ** 4
        sums[3] += per * n
        sums[4] += per * n * n
    det = sums[0] * sums[2] - sums[1] * sums[1]
    if det == 0:
        return None
    a = (sums[3] * sums[2] - sums[4] * sums[1]) / det
    c = (sums[0] * sums[4] - sums[1] * sums[3]) / det
    if c < 0:  # no quadratic term to speak of: a line through the origin
        c, a = 0.0, sums[3] / sums[0]
    return a, c


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
                       int(source.fit.predicted(micro)), micro,
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
