"""gmem.report(): the live tracker's memory, as `gmem report` draws a trace: one self-contained
HTML page (docs/report.md). The tracker's snapshot (gmem.dump_snapshot, with its history when
tracking is on) goes through the same writer as a file would, the CLI binary in the package."""

import json
import os
import subprocess
import tempfile

from . import _cli
from . import fit as fit_module
from .observe import dump_snapshot


def cli_binary():
    """The gmem CLI this package runs: $GMEM_CLI, else gmem/bin/gmem in the package, else the
    repository's build/gmem; None when there is none."""
    chosen = os.environ.get("GMEM_CLI")
    if chosen:
        return chosen
    for binary in _cli.CANDIDATES:
        if os.path.isfile(binary) and os.access(binary, os.X_OK):
            return binary
    return None


def report(path, device=None, png=None, fit=None):
    """Writes the HTML report of what gmem holds on `device` now, and of the history tracking
    recorded (gmem.enable_tracking() before the steps to look at), to `path`; with `png`, also
    the timeline as a PNG through headless Chromium. `fit`: a gmem.Fit whose table goes on the
    page (default: the last one gmem.fit_batch_size returned in this process; False: none).
    Returns `path`. Raises RuntimeError with the CLI's message when the report cannot be written
    (no history recorded, no CLI, ...)."""
    if fit is None:
        fit = fit_module.last_fit
    if fit is not None and fit is not False and not hasattr(fit, "as_dict"):
        raise TypeError("gmem.report: fit is a gmem.Fit (from gmem.fit_batch_size), not %r" % (fit,))
    binary = cli_binary()
    if binary is None:
        raise RuntimeError("gmem.report: the gmem command-line tool is not in this installation "
                           "(looked at %s); `pip install .` builds it into the package, CMake builds "
                           "it as build/gmem" % ", ".join(_cli.CANDIDATES))
    with tempfile.TemporaryDirectory(prefix="gmem-report-") as work:
        snapshot = os.path.join(work, "snapshot.pickle")
        dump_snapshot(snapshot, device)
        command = [binary, "report", snapshot, "-o", os.fspath(path)]
        if fit:
            fit_json = os.path.join(work, "fit.json")
            with open(fit_json, "w") as f:
                json.dump(fit.as_dict(), f)
            command += ["--fit", fit_json]
        if png is not None:
            command += ["--png", os.fspath(png)]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError("gmem.report: " + (done.stderr.strip() or "gmem report exited with %d" % done.returncode))
    return path
