"""gmem.distributed: rows per rank, the table, publishing to the store and reading the peers.

Two layers: a stand-in torch.distributed (in this process, on the simulated device) checks the
logic; the real one (gloo, two processes, skipped without PyTorch) checks that it works with
torch's all_gather_object and TCPStore, and that a rank that runs out of memory under gmem.run
says what the other rank held.
"""

import importlib.util
import io
import json
import os
import sys
import tempfile
import textwrap
import time
import types
import unittest
from unittest import mock

from support import MiB, run_python

import gmem
from gmem import distributed


class FakeStore:
    """c10d's Store, as far as gmem uses it: set, get, check (get would block on absent keys)."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        if key not in self.data:
            raise AssertionError("get() of an absent key blocks in c10d: check() first")
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def fake_dist(rank, world, gathered_rows):
    """torch.distributed with a group up; all_gather_object hands back `gathered_rows` with this
    rank's own row put in its place."""
    dist = types.ModuleType("torch.distributed")
    dist.is_available = lambda: True
    dist.is_initialized = lambda: True
    dist.get_rank = lambda group=None: rank
    dist.get_world_size = lambda group=None: world

    def all_gather_object(out, obj, group=None):
        for i, row in enumerate(gathered_rows):
            out[i] = obj if i == rank else row
    dist.all_gather_object = all_gather_object
    return dist


def other_row(rank, allocated, reserved, outside=0, sites=()):
    return {"rank": rank, "world_size": 2, "host": "other", "device": 0, "allocated": allocated,
            "peak_allocated": allocated, "reserved": reserved, "peak_reserved": reserved,
            "outside": outside, "device_total": 80 << 30, "top_sites": [list(s) for s in sites],
            "time": time.time()}


class WithFakeGroup(unittest.TestCase):
    def setUp(self):
        self.blocks = []
        gmem.reset_peak_memory_stats()  # other tests' peaks are not this test's

    def tearDown(self):
        for p in self.blocks:
            gmem.free(p)

    def group(self, rank, world, rows):
        torch = types.ModuleType("torch")
        torch.distributed = fake_dist(rank, world, rows)
        return mock.patch.dict(sys.modules, {"torch": torch, "torch.distributed": torch.distributed})


class SummaryTest(WithFakeGroup):
    def test_without_a_group_the_table_has_this_process(self):
        self.blocks.append(gmem.malloc(8 * MiB))
        out = io.StringIO()
        with mock.patch.dict(sys.modules, {"torch": None}):
            rows = distributed.summary(file=out)
        self.assertEqual(len(rows), 1)
        self.assertGreaterEqual(rows[0]["allocated"], 8 * MiB)
        self.assertEqual(rows[0]["allocated"], gmem.memory_allocated())
        self.assertEqual(rows[0]["reserved"], gmem.memory_reserved())
        self.assertIn("rank", out.getvalue().splitlines()[0])

    def test_rows_are_gathered_ordered_and_the_imbalance_named(self):
        self.blocks.append(gmem.malloc(4 * MiB))
        big = other_row(1, 6 << 30, 7 << 30, outside=900 * MiB,
                        sites=[("train.py:42:forward", 5 << 30), ("model.py:7:embed", 1 << 30)])
        out = io.StringIO()
        with self.group(0, 2, [None, big]):
            rows = distributed.summary(file=out)
        self.assertEqual([r["rank"] for r in rows], [0, 1])
        self.assertEqual(rows[1]["reserved"], 7 << 30)
        text = out.getvalue()
        self.assertIn("imbalance: rank 1 peaks at 7.00 GiB", text)
        self.assertIn("rank 1 holds most at:", text)
        self.assertIn("train.py:42:forward", text)
        self.assertIn("900.00 MiB", text)  # what NCCL / the context hold on rank 1

    def test_only_the_print_rank_prints_and_json_is_json(self):
        out = io.StringIO()
        with self.group(1, 2, [other_row(0, MiB, 2 * MiB), None]):
            distributed.summary(file=out)  # rank 1: prints nothing
            self.assertEqual(out.getvalue(), "")
            distributed.summary(file=out, print_rank=1, as_json=True)
        rows = json.loads(out.getvalue())
        self.assertEqual([r["rank"] for r in rows], [0, 1])

    def test_top_sites_come_from_tracking(self):
        gmem.enable_tracking()
        try:
            gmem.set_frames("here.py:12:make\n")
            self.blocks.append(gmem.malloc(32 * MiB))
            gmem.set_frames("there.py:3:small\n")
            self.blocks.append(gmem.malloc(2 * MiB))
            # Named as summaries name sites: the innermost frame of the user's own code.
            gmem.set_frames("/venv/site-packages/torch/nn/modules/linear.py:125:forward\n"
                            "model.py:7:forward\n")
            self.blocks.append(gmem.malloc(1 * MiB))
            gmem.set_frames(None)
            sites = distributed.top_sites(top=3)
        finally:
            gmem.disable_tracking()
        self.assertEqual(sites[0], ("here.py:12:make", 32 * MiB))
        self.assertEqual(sites[1][0], "there.py:3:small")
        self.assertEqual(sites[2], ("model.py:7:forward", 1 * MiB))


class StoreTest(WithFakeGroup):
    def test_step_publishes_and_peers_read_without_blocking(self):
        store = FakeStore()
        self.blocks.append(gmem.malloc(3 * MiB))
        with self.group(1, 3, []), mock.patch.object(distributed, "_store", lambda: store):
            gmem.step()
            self.assertIn(distributed.STORE_PREFIX + "1", store.data)
            store.set(distributed.STORE_PREFIX + "0", json.dumps(other_row(0, 5 << 30, 6 << 30)))
            seen = distributed.peers()
            self.assertEqual(sorted(seen), [0])  # rank 2 never published; itself is not a peer
            text = distributed.oom_context()
        self.assertIn("rank 1 of 3 ran out of memory", text)
        self.assertIn("6.00 GiB", text)  # what rank 0 held
        self.assertIn("no word from rank 2", text)

    def test_publish_now_and_then_publishes_at_most_once_a_second(self):
        store = FakeStore()
        clock = [100.0]
        with self.group(0, 2, []), mock.patch.object(distributed, "_store", lambda: store), \
                mock.patch.object(distributed.time, "monotonic", lambda: clock[0]), \
                mock.patch.object(distributed, "_last_published", [float("-inf")]):
            self.assertTrue(distributed.publish_now_and_then(), "the first call publishes")
            first = store.data.pop(distributed.STORE_PREFIX + "0")
            self.assertEqual(json.loads(first)["rank"], 0)
            clock[0] += 0.5
            self.assertFalse(distributed.publish_now_and_then())
            self.assertEqual(store.data, {}, "not again within the second")
            clock[0] += 0.6
            self.assertTrue(distributed.publish_now_and_then())
            self.assertIn(distributed.STORE_PREFIX + "0", store.data)

    def test_publish_now_and_then_without_a_group_does_nothing(self):
        with mock.patch.dict(sys.modules, {"torch": None}), \
                mock.patch.object(distributed, "_last_published", [float("-inf")]):
            self.assertFalse(distributed.publish_now_and_then())

    def test_a_broken_store_does_not_break_the_step(self):
        class Broken(FakeStore):
            def set(self, key, value):
                raise RuntimeError("connection reset")

            def check(self, keys):
                raise RuntimeError("connection reset")
        with self.group(0, 2, []), mock.patch.object(distributed, "_store", lambda: Broken()):
            gmem.step()
            self.assertEqual(distributed.peers(), {})

    def test_step_does_not_import_torch(self):
        result = run_python(["-c", "import sys, gmem; gmem.step(); print('torch' in sys.modules)"])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout.strip(), "False")


WORKER = textwrap.dedent("""
    import os, sys, time
    import torch.distributed as dist
    import gmem, gmem.distributed
    MiB = 1 << 20
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    held = [gmem.malloc((64 if rank == 0 else 16) * MiB)]
    rows = gmem.distributed.summary()
    if rank == 0:
        print("ROWS", [r["allocated"] for r in rows], flush=True)
    gmem.step()                      # publishes this rank's row
    dist.barrier()
    if rank == 0:
        time.sleep(4)                # rank 0 hosts the store: stay up while rank 1 reads it
        sys.exit(0)
    gmem.set_memory_limit(gmem.memory_reserved() + 2 * MiB)
    gmem.malloc(512 * MiB)           # out of memory: gmem.run reports the ranks
""")


class GlooTest(unittest.TestCase):
    """Two real ranks over gloo on the simulated device (needs PyTorch; skipped without it)."""

    def setUp(self):
        if importlib.util.find_spec("torch") is None:
            self.skipTest("PyTorch is not installed")

    def test_two_ranks_gather_and_an_oom_names_the_other_rank(self):
        import subprocess
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "worker.py")
            with open(script, "w") as f:
                f.write(WORKER)
            procs = []
            for rank in range(2):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(29500 + os.getpid() % 1000), GMEM="0",
                           GMEM_DEVICE="sim",
                           PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
                procs.append(subprocess.Popen([sys.executable, "-m", "gmem.run", script],
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              universal_newlines=True, env=env))
            outs = [p.communicate(timeout=120) for p in procs]
        self.assertEqual(procs[0].returncode, 0, outs[0][1])
        self.assertIn("ROWS [%d, %d]" % (64 * MiB, 16 * MiB), outs[0][0])
        self.assertNotEqual(procs[1].returncode, 0)
        err = outs[1][1]
        self.assertIn("rank 1 of 2 ran out of memory", err)
        self.assertIn("64.00 MiB", err)  # what rank 0 held, from the store
        self.assertIn("OutOfMemoryError", err)


if __name__ == "__main__":
    unittest.main()
