"""A long run's snapshot, read back by the CLI (issue 57): on the simulated device, 40,000
mallocs and frees with a step every 1,000 and one block kept a step (a leak), dumped with
gmem.dump_snapshot. With a history that wraps (16384 events, the old default) `gmem leaks`,
`summary` and `replay` read the file, say that its history began mid-run, and still find the
leak; with the default history the run fits and nothing is said."""

import json
import os
import subprocess
import tempfile
import unittest

from support import REPO, assert_child_ok

# Where the CLI is: GMEM_CLI, else next to the library the tests use (GMEM_LIBRARY), else build/.
LIBRARY = os.environ.get("GMEM_LIBRARY", os.path.join(REPO, "build", "libgmem.so"))
CLI = os.environ.get("GMEM_CLI", os.path.join(os.path.dirname(LIBRARY), "gmem"))

PROGRAM = r"""
import gmem
gmem.enable_tracking({history})
with gmem.scope("weights"):
    weights = [gmem.malloc(4 << 20) for _ in range(8)]
kept = []
for i in range(40000):
    gmem.free(gmem.malloc(4096 + (i % 7) * 512))
    if (i + 1) % 1000 == 0:
        with gmem.scope("losses"): kept.append(gmem.malloc(1 << 20))
        gmem.step()
gmem.dump_snapshot({path!r})
print("ok", gmem.snapshot()["tracking"]["dropped_events"])
"""
# The leak's site: the line that keeps a block a step, as the Python stack names it.
LEAK_SITE = "<string>:%d:<module>" % next(
    number for number, line in enumerate(PROGRAM.splitlines(), 1) if "kept.append" in line)


@unittest.skipUnless(os.access(CLI, os.X_OK), "the gmem CLI is not built at " + CLI)
class LongRunSnapshot(unittest.TestCase):
    def run_program(self, history_argument):
        path = os.path.join(self.tmp.name, "long.pickle")
        result = assert_child_ok(self, PROGRAM.format(history=history_argument, path=path))
        dropped = int(result.stdout.split()[-1])
        return path, dropped

    def cli(self, *args):
        return subprocess.run([CLI] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=300)

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.tmp.cleanup()

    def test_a_wrapped_history_is_read_said_and_its_leak_found(self):
        path, dropped = self.run_program("history=16384")
        self.assertGreater(dropped, 40000)  # 80,000 events and more through a ring of 16,384
        leaks = self.cli("leaks", "--json", path)
        self.assertEqual(leaks.returncode, 0, leaks.stderr)
        report = json.loads(leaks.stdout)
        history = report["history"]
        self.assertTrue(history["began_mid_run"])
        self.assertEqual(history["dropped_events"], dropped)
        self.assertTrue(history["has_segments"])
        # The weights and the losses kept before the window were live when it began.
        self.assertGreaterEqual(history["bytes_at_start"], 8 * (4 << 20))
        self.assertGreaterEqual(report["periods"], 5)
        self.assertLessEqual(report["periods"], 9)  # the steps inside the window, not the run's 40
        self.assertEqual([leak["site"] for leak in report["leaks"]], [LEAK_SITE])
        # Only the window's losses count: fewer than the 40 MiB kept over the run.
        self.assertLess(report["leaks"][0]["surviving_bytes"], 40 << 20)

        text = self.cli("leaks", path)
        self.assertEqual(text.returncode, 0, text.stderr)
        self.assertIn("history began mid-run: ", text.stdout)
        self.assertIn("%d older ones dropped" % dropped, text.stdout)

        summary = self.cli("summary", path)
        self.assertEqual(summary.returncode, 0, summary.stderr)
        self.assertIn("history began mid-run", summary.stdout)
        self.assertIn(LEAK_SITE, summary.stdout)

        replay = self.cli("replay", path)
        self.assertEqual(replay.returncode, 0, replay.stderr)
        self.assertIn("history began mid-run", replay.stderr)
        self.assertIn("long", replay.stdout)

    def test_with_the_default_history_the_run_fits(self):
        path, dropped = self.run_program("")
        self.assertEqual(dropped, 0)
        leaks = self.cli("leaks", "--json", path)
        self.assertEqual(leaks.returncode, 0, leaks.stderr)
        report = json.loads(leaks.stdout)
        self.assertFalse(report["history"]["began_mid_run"])
        self.assertEqual([leak["site"] for leak in report["leaks"]], [LEAK_SITE])
        self.assertGreaterEqual(report["periods"], 39)


if __name__ == "__main__":
    unittest.main()
