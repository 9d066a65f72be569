"""gmem.observe over the simulated device: tracking, scopes, call sites, snapshots (JSON and the
memory_viz pickle), OOM reports, and track_modules' scopes in forward and backward (with a
stand-in for torch's modules and tensors; test_observe_gpu below runs the real thing)."""

import json
import os
import pickle
import sys
import tempfile
import threading
import unittest

from support import MiB, assert_child_ok, run_python

import gmem
from gmem import observe

THIS_FILE = os.path.abspath(__file__)


def live_blocks(snap):
    return [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]


class ObserveTestCase(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        observe.enable_tracking()

    def setUp(self):
        self.live = []

    def tearDown(self):
        for p in self.live:
            gmem.free(p)

    def malloc(self, size):
        p = gmem.malloc(size)
        self.live.append(p)
        return p

    def block(self, ptr):
        for b in live_blocks(observe.snapshot()):
            if b["address"] == ptr:
                return b
        self.fail("block %#x not in the snapshot" % ptr)


class TrackingTest(ObserveTestCase):
    def test_enabled(self):
        self.assertTrue(observe.is_tracking())
        observe.enable_tracking()  # again: no change
        self.assertTrue(observe.is_tracking())

    def test_graph_marks_need_the_start_of_a_tracked_block(self):
        import ctypes
        saved = observe._c().gmem_graph_saved
        p = self.malloc(4 * MiB)
        self.assertEqual(saved(p, 1), 1)
        self.assertTrue(self.block(p)["saved_for_backward"])
        self.assertEqual(saved(p, 0), 1)
        self.assertFalse(self.block(p)["saved_for_backward"])
        self.assertEqual(saved(p + 512, 1), 0, "an interior address")
        host = ctypes.create_string_buffer(64)
        self.assertEqual(saved(ctypes.addressof(host), 1), 0, "host memory")
        self.assertEqual(saved(None, 1), 0)

    def test_counts_that_do_not_fit_size_t_are_refused(self):
        for bad in (-1, 2**64 + 16):
            with self.assertRaises(gmem.InvalidArgumentError):
                gmem.enable_tracking(history=bad)
            with self.assertRaises(gmem.InvalidArgumentError):
                gmem.top_sites(bad)
        with self.assertRaises(TypeError):
            gmem.top_sites(2.5)

    def test_scopes_nest_and_record_the_stack(self):
        with observe.scope("train"):
            with observe.scope("forward"):
                inner = self.malloc(3 * MiB)
            outer = self.malloc(1000)
        bare = self.malloc(512)
        snap = observe.snapshot()
        frames = snap["frames"]
        blocks = {b["address"]: b for b in live_blocks(snap)}
        self.assertEqual(blocks[inner]["scope"], "train/forward")
        self.assertEqual(blocks[outer]["scope"], "train")
        self.assertEqual(blocks[bare]["scope"], "")
        # The scope's stack was put back on exit: the bare block's site is its own Python stack,
        # read by libgmem (the helper that called gmem.malloc, then this test; gmem's files left
        # out).
        bare_stack = frames[str(blocks[bare]["frames"])]
        self.assertEqual([f["name"] for f in bare_stack[:2]],
                         ["malloc", "test_scopes_nest_and_record_the_stack"])
        self.assertEqual(bare_stack[0]["filename"], THIS_FILE)
        stack = frames[str(blocks[inner]["frames"])]
        self.assertEqual(stack[0]["filename"], THIS_FILE)  # innermost: where the scope began
        self.assertEqual(stack[0]["name"], "test_scopes_nest_and_record_the_stack")
        self.assertEqual(blocks[inner]["size"], 3 * MiB)
        self.assertEqual(blocks[outer]["requested_size"], 1000)

    def test_scope_is_a_decorator_too(self):
        @observe.scope("helper", stack=False)
        def helper():
            return self.malloc(4096)

        self.assertEqual(self.block(helper())["scope"], "helper")

    def test_set_frames(self):
        observe.set_frames([("data.py", 12, "load"), ("main.py", 3, "<module>")])
        p = self.malloc(2048)
        observe.set_frames(None)
        snap = observe.snapshot()
        b = [b for b in live_blocks(snap) if b["address"] == p][0]
        self.assertEqual(snap["frames"][str(b["frames"])],
                         [{"filename": "data.py", "line": 12, "name": "load"},
                          {"filename": "main.py", "line": 3, "name": "<module>"}])

    def test_steps_annotations_and_history(self):
        observe.annotate("phase two")
        before = observe.snapshot()["tracking"]["step"]
        p = self.malloc(8192)
        gmem.free(p)
        self.live.remove(p)
        observe.step()
        snap = observe.snapshot()
        self.assertEqual(snap["tracking"]["step"], before + 1)
        history = snap["history"]
        texts = [e["text"] for e in history if e["action"] == "annotation"]
        self.assertIn("phase two", texts)
        mine = [e["action"] for e in history if e["addr"] == p]
        self.assertEqual(mine[-2:], ["alloc", "free"])
        self.assertEqual(history[-1]["action"], "step")

    def test_backward_thread_scopes_are_its_own(self):
        seen = {}

        def other():
            seen["p"] = gmem.malloc(4096)

        with observe.scope("main_only"):
            t = threading.Thread(target=other)
            t.start()
            t.join()
        self.live.append(seen["p"])
        self.assertEqual(self.block(seen["p"])["scope"], "")


class PythonStacksTest(ObserveTestCase):
    """Call sites read by libgmem from C++ (stacks="python", the default): no set_frames needed."""

    def test_the_line_that_allocated_is_the_site(self):
        def load_batch():
            line = sys._getframe().f_lineno + 1
            return self.malloc(5 * MiB), line

        p, line = load_batch()
        snap = observe.snapshot()
        stack = snap["frames"][str(self.block(p)["frames"])]
        names = [f["name"] for f in stack]
        self.assertEqual(names[:3], ["malloc", "load_batch", "test_the_line_that_allocated_is_the_site"])
        self.assertEqual(stack[1], {"filename": THIS_FILE, "line": line, "name": "load_batch"})
        self.assertFalse(any("/gmem/" in f["filename"] for f in stack), stack)  # gmem's own files

    def test_one_site_interned_once_and_threads_have_their_own(self):
        def make():
            return gmem.malloc(4096)

        first, second = make(), make()
        self.live += [first, second]
        self.assertEqual(self.block(first)["frames"], self.block(second)["frames"])
        seen = {}

        def worker():
            seen["p"] = gmem.malloc(8192)

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        self.live.append(seen["p"])
        stack = observe.snapshot()["frames"][str(self.block(seen["p"])["frames"])]
        self.assertEqual(stack[0]["name"], "worker")

    def test_thread_mode_and_bad_modes(self):
        code = ("import gmem\n"
                "gmem.enable_tracking(stacks='thread')\n"
                "p = gmem.malloc(4096)\n"
                "b = [b for s in gmem.snapshot()['segments'] for b in s['blocks'] if b['address'] == p][0]\n"
                "print(b['frames'])\n")
        result = run_python(["-c", code])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout.strip(), "0")
        with self.assertRaises(ValueError):
            observe.enable_tracking(stacks="perl")


class SnapshotPickleTest(ObserveTestCase):
    def test_memory_viz_layout(self):
        with observe.scope("kept"):
            p = self.malloc(5 * MiB)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "snap.pickle")
            observe.dump_snapshot(path)
            with open(path, "rb") as f:
                d = pickle.load(f)
        self.assertEqual(set(d), {"segments", "device_traces", "allocator_settings",
                                  "external_annotations", "gmem_graphs", "gmem_history"})
        self.assertEqual(d["gmem_graphs"], {"backward_runs": False, "saved_for_backward": []})
        history = d["gmem_history"]  # the ring, and whether it wrapped (docs/wrapped-histories.md)
        self.assertEqual(history["capacity"], 131072)
        self.assertEqual((history["dropped_events"], history["wrapped"]), (0, False))
        blocks = {b["address"]: b for s in d["segments"] for b in s["blocks"]}
        self.assertEqual(blocks[p]["state"], "active_allocated")
        self.assertEqual(blocks[p]["frames"][-1],
                         {"filename": "<gmem scope>", "line": 0, "name": "kept"})
        for s in d["segments"]:
            self.assertEqual(sum(b["size"] for b in s["blocks"]), s["total_size"])
        self.assertIn("alloc", [e["action"] for e in d["device_traces"][0]])

    def test_unwritable_path(self):
        with self.assertRaises(gmem.BadInputError) as cm:
            observe.dump_snapshot("/nonexistent-dir/snap.pickle")
        self.assertIn("/nonexistent-dir/snap.pickle", str(cm.exception))


OOM_CHILD = r"""
import gmem, json
from gmem import observe
assert observe.last_oom_report() is None
observe.enable_tracking()
gmem.set_memory_limit(64 << 20)
kept = []
try:
    with observe.scope("model.h.3.mlp"):
        while True:
            kept.append(gmem.malloc(8 << 20))
except gmem.OutOfMemoryError as e:
    message = str(e)
assert "cause: live memory" in message, message          # the report travels with the error
text = observe.last_oom_report()
assert text.startswith("gmem: out of memory: tried to allocate 8.00 MiB"), text
for part in ("limit 64.00 MiB", "Live memory by scope:", "model.h.3.mlp", "What to do:",
             "smaller batch", "checkpointing"):
    assert part in text, (part, text)
d = observe.last_oom_report(as_json=True)
assert d["cause"] == "live memory" and d["limit"] == 64 << 20, d
assert d["by_scope"][0]["key"] == "model.h.3.mlp" and d["by_scope"][0]["count"] == len(kept), d
assert observe.last_oom_report(device=0) == text
print("ok")
"""


class OomReportTest(unittest.TestCase):
    def test_report_in_the_error_and_afterwards(self):
        assert_child_ok(self, OOM_CHILD)

    def test_report_can_stay_out_of_the_message(self):
        child = OOM_CHILD.replace('assert "cause: live memory" in message, message',
                                  'assert "cause:" not in message, message')
        result = run_python(["-c", child], GMEM_OOM_REPORT="0")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)


# The case on the simulated device: each step keeps 22 MiB (an output appended to a list)
# and leaves a little free memory scattered between small blocks, under a cap. The report must
# blame the leak, not the scattered free memory, and its first advice must be the leak's fix.
LEAK_OOM_CHILD = r"""
import gmem
from gmem import observe
gmem.set_memory_limit(768 << 20)
observe.enable_tracking()
observe.set_frames([("infer.py", 12, "run")])
kept, small, steps = [], [], 0
try:
    while True:
        activations = gmem.malloc(30 << 20)
        kept.append(gmem.malloc(22 << 20))
        pieces = [gmem.malloc(96 << 10) for _ in range(8)]
        for p in pieces[::2]:
            gmem.free(p)
        small.extend(pieces[1::2])
        gmem.free(activations)
        gmem.step()
        steps += 1
except gmem.OutOfMemoryError as e:
    message = str(e)
d = observe.last_oom_report(as_json=True)
assert steps > 10, steps
# Each step keeps the output and four of the small pieces: 22 MiB + 384 KiB = 22.38 MiB.
assert "cause: leak: infer.py:12:run keeps +22.38 MiB a step" in message, message
assert "fits under gmem's memory limit" in message, message  # it would have looked like fragmentation
assert d["cause"] == "leak" and d["steps"] == steps, d
first = d["advice"][0]
assert "infer.py:12:run" in first and "torch.no_grad()" in first and ".detach()" in first, first
assert d["leak_suspects"][0]["site"] == "infer.py:12:run", d["leak_suspects"]
assert d["leak_suspects"][0]["bytes_per_step"] == (22 << 20) + 4 * (96 << 10), d["leak_suspects"]
print("ok")
"""


class LeakOomTest(unittest.TestCase):
    def test_a_leak_under_a_cap_is_blamed_first(self):
        assert_child_ok(self, LEAK_OOM_CHILD)


# --- track_modules with stand-ins for torch.nn.Module and torch.Tensor --------------------------


class FakeTensor:
    def __init__(self, requires_grad=True):
        self.requires_grad = requires_grad
        self.hooks = []

    def register_hook(self, fn):
        self.hooks.append(fn)

    def backward_reaches_me(self):
        for fn in self.hooks:
            fn(None)


class Handle:
    def __init__(self, hooks, fn):
        self.hooks, self.fn = hooks, fn

    def remove(self):
        self.hooks.remove(self.fn)


class FakeModule:
    """Calls its children in order; allocates `size` bytes in its own forward."""

    def __init__(self, size, *children, params=False):
        self.size = size
        self.params = params
        self.children = list(children)
        self.pre, self.post = [], []
        self.allocated = []

    def named_modules(self, prefix=""):
        yield prefix, self
        for i, child in enumerate(self.children):
            yield from child.named_modules("%s.%d" % (prefix, i))

    def register_forward_pre_hook(self, fn):
        self.pre.append(fn)
        return Handle(self.pre, fn)

    def register_forward_hook(self, fn):
        self.post.append(fn)
        return Handle(self.post, fn)

    def __call__(self, inp):
        for fn in self.pre:
            fn(self, (inp,))
        self.allocated.append(gmem.malloc(self.size))
        x = inp
        for child in self.children:
            x = child(x)
        out = FakeTensor(x.requires_grad or self.params)
        for fn in self.post:
            fn(self, (inp,), out)
        self.output, self.input = out, inp
        return out


class TrackModulesTest(ObserveTestCase):
    def scopes_of(self, ptrs):
        blocks = {b["address"]: b["scope"] for b in live_blocks(observe.snapshot())}
        return [blocks[p] for p in ptrs]

    def test_forward_and_backward_scopes(self):
        leaf_a, leaf_b = FakeModule(4096), FakeModule(8192)
        block = FakeModule(1024, leaf_a, leaf_b)
        model = FakeModule(2048, block)
        tracking = observe.track_modules(model)
        with observe.scope("train"):
            model(FakeTensor(requires_grad=True))
        fwd = [model.allocated[0], block.allocated[0], leaf_a.allocated[0], leaf_b.allocated[0]]
        self.live.extend(fwd)
        self.assertEqual(self.scopes_of(fwd),
                         ["train/model", "train/model.0", "train/model.0.0", "train/model.0.1"])

        # Backward, on another thread as PyTorch's autograd engine does: gradients reach the
        # outputs from the last module to the first, then the inputs.
        got = {}

        def backward():
            def alloc(tag):
                got[tag] = gmem.malloc(512)

            model.output.backward_reaches_me()   # model's backward begins
            alloc("model")
            block.output.backward_reaches_me()
            leaf_b.output.backward_reaches_me()
            alloc("leaf_b")
            # leaf_b's input is leaf_a's output: leaf_a begins (its hook came first), leaf_b ends
            leaf_b.input.backward_reaches_me()
            alloc("leaf_a")
            # the model's input is everyone's: all end
            leaf_a.input.backward_reaches_me()
            alloc("after")

        t = threading.Thread(target=backward)
        t.start()
        t.join()
        self.live.extend(got.values())
        self.assertEqual(self.scopes_of([got["model"], got["leaf_b"], got["leaf_a"], got["after"]]),
                         ["model", "model.0.1", "model.0.0", ""])

        tracking.remove()
        p = self.malloc(512)
        model(FakeTensor(requires_grad=False))
        self.live.extend([model.allocated[-1], block.allocated[-1], leaf_a.allocated[-1],
                          leaf_b.allocated[-1]])
        self.assertEqual(self.scopes_of([model.allocated[-1], p]), ["", ""])


    def test_unfinished_backward_is_cleared_by_the_next(self):
        # The model's input needs no gradient: no module's backward "ends". The next backward
        # pass (or gmem.step()) must not pile up scopes on the autograd thread.
        leaf = FakeModule(512, params=True)
        model = FakeModule(512, leaf, params=True)
        tracking = observe.track_modules(model)
        self.addCleanup(tracking.remove)
        depths = []

        def backward_twice():
            c = observe._c()
            for _ in range(2):
                model(FakeTensor(requires_grad=False))
                self.live.extend([model.allocated[-1], leaf.allocated[-1]])
                model.output.backward_reaches_me()
                leaf.output.backward_reaches_me()
                depths.append(c.gmem_scope_depth())
            observe.step()
            depths.append(c.gmem_scope_depth())

        t = threading.Thread(target=backward_twice)
        t.start()
        t.join()
        self.assertEqual(depths, [2, 2, 0])


@unittest.skipUnless(os.environ.get("GMEM_GPU_TESTS"), "set GMEM_GPU_TESTS=1 on a GPU machine")
class TrackModulesGpuTest(unittest.TestCase):
    """With real PyTorch on a GPU (gmem.torch): module paths in forward and backward, and the
    OOM report carried by torch.OutOfMemoryError."""

    def test_real_model(self):
        child = r"""
import gmem, gmem.torch, torch
from gmem import observe
gmem.torch.enable()
observe.enable_tracking()
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(inplace=True),
                            torch.nn.Linear(4096, 1024)).cuda()
observe.track_modules(model)
x = torch.randn(256, 1024, device="cuda")
model(x).square().mean().backward()     # ReLU(inplace=True): no full backward hooks to break
observe.step()
hist = observe.snapshot()["history"]
scopes = [e["scope"] for e in hist if e["action"] == "alloc"]
assert {"model.0", "model.2"} <= set(scopes), scopes
# After model.2's forward output, every model.0 allocation is backward's, and comes after
# model.2's gradients.
model2_output = min(i for i, e in enumerate(hist) if e["action"] == "alloc" and e["scope"] == "model.2")
later = [e["scope"] for e in hist[model2_output + 1:] if e["action"] == "alloc" and e["scope"]]
assert "model.0" in later and later.index("model.2") < later.index("model.0"), later
observe.dump_snapshot("/tmp/gmem_gpu_snapshot.pickle")   # open it at pytorch.org/memory_viz
try:
    torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
    raise SystemExit("no OOM")
except (torch.OutOfMemoryError, RuntimeError) as e:  # RuntimeError without the torch shim
    assert "What to do:" in str(e), str(e)
report = observe.last_oom_report()
assert report is not None and "Live memory by scope:" in report, report
print(report)
print("ok")
"""
        result = run_python(["-c", child], GMEM_DEVICE=None)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)


if __name__ == "__main__":
    unittest.main()
