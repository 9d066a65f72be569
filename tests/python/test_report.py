"""gmem.report() and `python -m gmem.run --report`: the live tracker's snapshot through the same
writer as `gmem report` (docs/report.md), on the simulated device. The CLI is the package's
(GMEM_CLI, else build/gmem); the pages themselves are checked in Chromium by scripts/test's
report step (tests/report/check_reports.py)."""

import json
import os
import re
import subprocess
import tempfile
import textwrap
import unittest

from support import REPO, run_python

import importlib

gmem_report = importlib.import_module("gmem.report")  # the module: gmem.report is its function

LOOP = textwrap.dedent("""
    import gmem
    MiB = 1 << 20
    losses = []
    for step in range(12):
        activations = gmem.malloc(8 * MiB)
        losses.append(gmem.malloc(1 * MiB))   # kept every step: a leak
        gmem.free(activations)
        gmem.step()
""")


# A batch-size fit on the simulated device: a step of 100 MiB resident, 20 MiB per step and
# 10 MiB a sample in a 1 GiB limit, then a few steps at the pick.
FIT = textwrap.dedent("""
    import gmem
    MiB = 1 << 20
    weights = gmem.malloc(100 * MiB)
    def step(b):
        grads = gmem.malloc(20 * MiB)
        try:
            gmem.free(gmem.malloc(10 * MiB * b))
        finally:
            gmem.free(grads)
    fit = gmem.fit_batch_size(step, limit=1 << 30)
    for _ in range(3):
        step(fit.batch_size)
        gmem.step()
""")


def fit_on_page(page):
    """The fit's section: {element id: data attributes}, or None when the page has none."""
    with open(page, encoding="utf-8") as f:
        text = f.read()
    if 'id="fit-section"' not in text:
        return None
    found = {}
    for m in re.finditer(r'<(?:p|tr) id="(fit-[a-z-]+)"([^>]*)>(.*?)</(?:p|tr)>', text):
        attrs = dict(re.findall(r'data-([a-z-]+)="(\d+)"', m.group(2)))
        found[m.group(1)] = {k: int(v) for k, v in attrs.items()}
        cells = re.findall(r'data-bytes="(\d+)"', m.group(3))  # a part's row: bytes, then at the pick
        if cells:
            found[m.group(1)]["bytes"] = [int(v) for v in cells]
    return found


def cli_problem():
    """Why the tests cannot run the CLI's report command here, or None when they can."""
    binary = gmem_report.cli_binary()
    if binary is None:
        return "no gmem CLI (build it: cmake --build build)"
    with tempfile.TemporaryDirectory() as tmp:
        probe = subprocess.run([binary, "report", os.path.join(REPO, "tests", "data", "tiny_leak.trace.csv.gz"),
                                "-o", os.path.join(tmp, "probe.html")], capture_output=True, text=True)
    if probe.returncode != 0 and ("no command 'report'" in probe.stderr or "chart library" in probe.stderr):
        return "this gmem CLI cannot write reports: " + probe.stderr.strip()[:200]
    return None


def headline(page):
    with open(page, encoding="utf-8") as f:
        text = f.read()
    peak = re.search(r'id="peak-allocated" data-bytes="(\d+)"', text)
    cause = re.search(r'id="cause">([^<]*)<', text)
    return int(peak.group(1)) if peak else None, cause.group(1) if cause else None


class ReportTest(unittest.TestCase):
    def setUp(self):
        problem = cli_problem()
        if problem:
            self.skipTest(problem)
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def fake_torch(self):
        """A stand-in torch whose history and snapshot are gmem's (on the simulated device), so
        that gmem.run's GMEM=0 --report path runs without PyTorch."""
        fake = os.path.join(self.tmp.name, "fake")
        if os.path.isdir(fake):
            return fake
        os.makedirs(os.path.join(fake, "torch", "cuda"))
        with open(os.path.join(fake, "torch", "__init__.py"), "w") as f:
            f.write("from . import cuda\n")
        with open(os.path.join(fake, "torch", "cuda", "__init__.py"), "w") as f:
            f.write("from . import memory\n")
        with open(os.path.join(fake, "torch", "cuda", "memory.py"), "w") as f:
            f.write("import gmem\n"
                    "def _record_memory_history(max_entries=None):\n    gmem.enable_tracking()\n"
                    "def _dump_snapshot(path):\n    gmem.dump_snapshot(path)\n")
        return fake

    def test_live_report_shows_the_leak(self):
        page = os.path.join(self.tmp.name, "live.html")
        code = "import gmem\ngmem.enable_tracking()\n" + LOOP + "print(gmem.report(%r))\n" % page
        result = run_python(["-c", code])
        self.assertEqual(result.returncode, 0, result.stderr)
        peak, cause = headline(page)
        self.assertGreaterEqual(peak, 12 * (1 << 20) + 8 * (1 << 20))
        self.assertRegex(cause, r"^cause: leak: ")

    def test_without_tracking_it_says_how_to_record_a_history(self):
        code = ("import gmem\n" + LOOP +
                "try:\n    gmem.report(%r)\nexcept RuntimeError as e:\n    print('ERROR', e)\n"
                % os.path.join(self.tmp.name, "none.html"))
        result = run_python(["-c", code])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("ERROR gmem.report:", result.stdout)
        self.assertIn("enable_tracking", result.stdout)

    def test_run_writes_the_report_at_an_oom_before_it_propagates(self):
        # GMEM=0 takes PyTorch's route: a stand-in torch whose history and snapshot are gmem's
        # (on the simulated device), so that gmem.run's --report path runs without PyTorch.
        fake = self.fake_torch()
        script = os.path.join(self.tmp.name, "train.py")
        with open(script, "w") as f:
            f.write(LOOP + "gmem.set_memory_limit(gmem.memory_reserved() + 2 * MiB)\n"
                           "gmem.malloc(512 * MiB)\n")
        page = os.path.join(self.tmp.name, "run.html")
        env_path = os.pathsep.join([fake, os.path.join(REPO, "python")])
        result = run_python(["-m", "gmem.run", "--report", page, script], GMEM="0", PYTHONPATH=env_path)
        self.assertNotEqual(result.returncode, 0)
        written = result.stderr.find("gmem.run: wrote the report " + page)
        self.assertGreaterEqual(written, 0, result.stderr)
        self.assertGreater(result.stderr.find("OutOfMemoryError"), written, result.stderr)  # then the error
        peak, cause = headline(page)
        self.assertGreaterEqual(peak, 12 * (1 << 20) + 8 * (1 << 20))
        self.assertRegex(cause, r"^cause: leak: ")

    def test_live_report_shows_the_last_fit(self):
        page, bare = os.path.join(self.tmp.name, "fit.html"), os.path.join(self.tmp.name, "nofit.html")
        code = ("import gmem, json\ngmem.enable_tracking()\n" + FIT +
                "gmem.report(%r)\ngmem.report(%r, fit=False)\n" % (page, bare) +
                "print(json.dumps(fit.as_dict()))\n")
        result = run_python(["-c", code], GMEM_DEVICE="sim")
        self.assertEqual(result.returncode, 0, result.stderr)
        fit = json.loads(result.stdout.splitlines()[-1])
        # (1 GiB - 120 MiB) / 10 MiB = 90.4: batch 90 is the largest that fits.
        self.assertEqual(fit["batch_size"], 90)
        shown = fit_on_page(page)
        self.assertEqual(shown["fit-pick"], {"batch-size": 90, "budget": 1 << 30})
        self.assertEqual(shown["fit-per-sample"], {"bytes": [10 << 20, 90 * (10 << 20)]})
        self.assertEqual(shown["fit-resident"]["bytes"], [fit["resident"]])
        self.assertEqual(shown["fit-step-fixed"]["bytes"], [fit["step_fixed"]])
        self.assertEqual(shown["fit-peak"], {"predicted": fit["predicted_peak"], "measured": fit["measured_peak"]})
        self.assertIsNone(fit_on_page(bare), "fit=False still drew the fit")

    def test_cli_names_the_fit_file_and_its_problem(self):
        trace = os.path.join(REPO, "tests", "data", "tiny_leak.trace.csv.gz")
        cases = [('{"batch_size": 3, "resident": 0}', "'budget' is missing"),
                 ('{"batch_size": 3, "budget": -1}', "'budget' should be a whole number >= 0"),
                 ('{"batch_size": 3, "budget": 1, "resident": 1, "step_fixed": 1, "per_sample": 1, '
                  '"steps": [{"batch_size": 1}]}', "steps[0]: 'ok' is missing"),
                 ('[1, 2', "expected ']'"),
                 ('', "unexpected end")]
        for text, problem in cases:
            bad = os.path.join(self.tmp.name, "bad.json")
            with open(bad, "w") as f:
                f.write(text)
            done = subprocess.run([gmem_report.cli_binary(), "report", trace, "-o",
                                   os.path.join(self.tmp.name, "x.html"), "--fit", bad],
                                  capture_output=True, text=True)
            self.assertNotEqual(done.returncode, 0, text)
            self.assertIn(bad, done.stderr)
            self.assertIn(problem, done.stderr)

    def test_run_report_includes_the_last_fit(self):
        fake = self.fake_torch()
        script = os.path.join(self.tmp.name, "train.py")
        with open(script, "w") as f:
            f.write(FIT)
        page = os.path.join(self.tmp.name, "run.html")
        env_path = os.pathsep.join([fake, os.path.join(REPO, "python")])
        result = run_python(["-m", "gmem.run", "--report", page, script], GMEM="0", PYTHONPATH=env_path)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(fit_on_page(page)["fit-pick"]["batch-size"], 90)

    def test_run_report_needs_a_file(self):
        result = run_python(["-m", "gmem.run", "--report"])
        self.assertEqual(result.returncode, 2)
        self.assertIn("--report needs a file", result.stderr)


if __name__ == "__main__":
    unittest.main()
