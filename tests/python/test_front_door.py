"""What a newcomer meets first: results that come back empty say what was looked at
(gmem.leaks(), gmem.top_sites()), `python -m gmem.run --help` documents the options and every
environment variable gmem reads, and a missing torch is one line that says what to install."""

import glob
import os
import re
import unittest

from support import REPO, assert_child_ok, run_python

EMPTY_CHILD = r"""
import warnings
import gmem

# Not tracked: [] and a warning that says so and what to call.
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert gmem.top_sites(3) == []
assert len(caught) == 1 and "not tracked" in str(caught[0].message), [str(w.message) for w in caught]
assert "gmem.enable_tracking()" in str(caught[0].message)

gmem.enable_tracking()
# Tracked, nothing live: [] and a warning naming that case (gmem may not be the allocator).
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert gmem.top_sites(3) == []
assert len(caught) == 1 and "is live now" in str(caught[0].message), [str(w.message) for w in caught]
# Something live: no warning.
p = gmem.malloc(4 << 20)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert len(gmem.top_sites(3)) == 1
assert caught == [], [str(w.message) for w in caught]

# No step yet: not "No leaks found", but why none can be found and what to call.
text = str(gmem.leaks())
assert "No leaks found" not in text, text
assert "No leaks can be found in the allocations since tracking began (1 live now)" in text, text
assert "gmem.step()" in text, text

# Steps and no leak: what was looked at.
for i in range(4):
    q = gmem.malloc(2 << 20)
    gmem.free(q)
    gmem.step()
text = str(gmem.leaks())
assert "No leaks found in the allocations since tracking began (1 live now) over 4 steps" in text, text
gmem.free(p)
print("ok")
"""


def environment_variables():
    """Every GMEM variable gmem's sources read: quoted names in src/ (getenv) and python/gmem/
    (os.environ); the GMEM_ERROR_* status constants are C names, not variables."""
    names = set()
    files = glob.glob(os.path.join(REPO, "src", "**", "*.cpp"), recursive=True)
    files += glob.glob(os.path.join(REPO, "python", "gmem", "*.py"))
    for path in files:
        with open(path, encoding="utf-8") as f:
            names.update(re.findall(r'"(GMEM(?:_[A-Z_]+)?)"', f.read()))
    return {n for n in names if not n.startswith("GMEM_ERROR_")}


class EmptyResultsTest(unittest.TestCase):
    def test_leaks_and_top_sites_say_what_they_looked_at(self):
        assert_child_ok(self, EMPTY_CHILD)


class RunHelpTest(unittest.TestCase):
    def test_help_documents_the_options_and_every_environment_variable(self):
        result = run_python(["-m", "gmem.run", "--help"])
        self.assertEqual(result.returncode, 0, result.stderr)
        text = result.stdout
        for option in ("SCRIPT", "-m MODULE", "--help", "GMEM=0", "python -m gmem.doctor"):
            self.assertIn(option, text)
        variables = environment_variables()
        self.assertGreaterEqual(len(variables), 10, variables)  # the scan found them
        for name in sorted(variables):
            self.assertRegex(text, r"\n  %s[= ]" % re.escape(name), "%s is not documented" % name)
        for line in text.splitlines():
            self.assertLessEqual(len(line), 100, line)

    def test_no_arguments_points_at_help(self):
        result = run_python(["-m", "gmem.run"])
        self.assertEqual(result.returncode, 2)
        self.assertIn("--help", result.stderr)


@unittest.skipIf(run_python(["-c", "import torch"]).returncode == 0, "torch is installed here")
class MissingTorchTest(unittest.TestCase):
    def test_one_line_that_says_what_to_install(self):
        script = os.path.join(REPO, "tests", "python", "support.py")  # any script: it never runs
        result = run_python(["-m", "gmem.run", script], GMEM_DEVICE=None)
        self.assertEqual(result.returncode, 2, result.stderr)
        lines = result.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, result.stderr)
        self.assertRegex(lines[0], r"^gmem\.run: PyTorch cannot be imported .*pip install torch")
        self.assertNotIn("Traceback", result.stderr)


if __name__ == "__main__":
    unittest.main()
