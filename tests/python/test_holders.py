"""Who holds it (gmem.holders, gmem.processes; docs/holders.md), on the simulated device: objects
exposing __cuda_array_interface__ over gmem.malloc memory, kept across steps by a closure, a
global list, a module attribute, a dict in a class instance, a view of a larger block, and a
live frame's local; each test asserts the holder named. Each case runs in its own process (leak
detection looks at every step the process has taken). NVML is faked, or looked for where it is
not (GMEM_NVML), so that the tests read the same with and without a driver."""

import os
import subprocess
import sys
import unittest

from support import assert_child_ok, run_python

# The same on machines with and without an NVIDIA driver: NVML is looked for where it is not
# (tests that need processes pass a fake NVML).
os.environ["GMEM_NVML"] = "/nonexistent/libnvidia-ml.so.1"

PRELUDE = r"""
import gc, sys, threading, types
import gmem

class Array:
    # A CuPy/Numba-like device array: __cuda_array_interface__ over `size` bytes at `ptr`;
    # `base` is the array a view keeps alive, as CuPy's .base does.
    def __init__(self, ptr, size, base=None):
        self.ptr, self.size, self.base = ptr, size, base
    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.size // 4,), "typestr": "<f4", "data": (self.ptr, False),
                "version": 3, "strides": None}

def at(site):
    file, line, fn = site.split(":")
    gmem.set_frames([(file, int(line), fn)])

def holder_of(found, site):
    groups = [g for f in found.as_dicts() if f["site"] == site for g in f["holders"]]
    assert groups, (site, str(found))
    return groups

gmem.enable_tracking()
"""

CLOSURE_AND_GLOBAL_CHILD = PRELUDE + r"""
losses = []                       # a global list: losses.append(loss)

def make_hook():
    feats = []                    # a closure's list: the forward hook that keeps activations
    def keep(output):
        feats.append(output)
    return keep

class Buffer(Array):
    def __init__(self):            # one allocation site for every buffer
        at("buffers.py:5:__init__")
        Array.__init__(self, gmem.malloc(1 << 20), 1 << 20)

REGISTRY = {}                      # a module-level dict

keep = make_hook()
for step in range(8):
    at("train.py:173:train")
    keep(Array(gmem.malloc(2 << 20), 2 << 20))
    at("train.py:180:train")
    losses.append(Array(gmem.malloc(1 << 20), 1 << 20))
    keep(Buffer())                 # the issue's case: one site, leaked through a closure's list
    REGISTRY[step] = Buffer()      # ... and through a module-level dict
    gmem.step()

found = gmem.leaks()
hook = holder_of(found, "train.py:173:train")
assert len(hook) == 1, hook
assert hook[0]["holder"].startswith("list `feats` ← closure of `keep` (<string>:"), hook
assert hook[0]["kind"] == "closure" and hook[0]["name"] == "feats", hook
assert hook[0]["blocks"] == 8 and hook[0]["bytes"] == 16 << 20, hook  # not the Buffers: their site
kept = holder_of(found, "train.py:180:train")
assert kept[0]["holder"] == "list `losses` (global in __main__)", kept
assert kept[0]["kind"] == "global" and kept[0]["objects"] == 8, kept
# One site, two holders: split, each with its own count.
split = holder_of(found, "buffers.py:5:__init__")
assert sorted((g["kind"], g["blocks"]) for g in split) == [("closure", 8), ("global", 8)], split
assert {g["holder"].split(" ←")[0].split(" (")[0] for g in split} == {
    "list `feats`", "dict `REGISTRY`"}, split
text = str(found)
section = text.split("Who holds it")[1].split("What to do:")[0]
assert "8 Arrays, 16.00 MiB in 8 blocks, kept by list `feats` ← closure of `keep`" in section, text
assert "objects visited in" in text, text
advice = text.split("What to do:")[1].splitlines()[1:]
# The holders come first in the advice, before the no_grad / detach advice of the leak itself.
first = [line for line in advice[:4]]
assert any(l.startswith("  - `feats`, kept by a closure, keeps 8 Arrays (16.00 MiB)") for l in first), advice
assert any(l.startswith("  - `losses` keeps 8 Arrays (8.00 MiB)") for l in first), advice
assert any(l.startswith("  - `REGISTRY` keeps 8 Buffers (8.00 MiB)") for l in first), advice
assert any(l.startswith("  - `feats`, kept by a closure, keeps 8 Buffers") for l in first), advice
assert "torch.no_grad()" in advice[4], advice
assert found.holders.visited > 1000 and found.holders.bound is None, found.holders.as_dict()
assert "holders" in found.as_dict()

# Without the search: the report as libgmem wrote it.
plain = gmem.leaks(holders=False)
assert "Who holds it" not in str(plain) and plain.holders is None
assert "holders" not in plain.as_dicts()[0]
print("ok")
"""

MODULE_AND_INSTANCE_CHILD = PRELUDE + r"""
registry = types.ModuleType("registry")      # a module of the program, with a module attribute
registry.__file__ = "/src/registry.py"
sys.modules["registry"] = registry

class Trainer:
    def __init__(self):
        self.cache = {}                        # a dict in a class instance

class Cache:
    store = []                                 # a class attribute

trainer = Trainer()
registry.history = []
for step in range(6):
    at("cache.py:9:remember")
    Cache.store.append(Array(gmem.malloc(2 << 20), 2 << 20))
    at("model.py:20:forward")
    trainer.cache["step%d" % step] = Array(gmem.malloc(1 << 20), 1 << 20)
    at("model.py:30:forward")
    registry.history.append(Array(gmem.malloc(3 << 20), 3 << 20))
    gmem.step()

found = gmem.leaks()
cache = holder_of(found, "model.py:20:forward")
assert cache[0]["holder"] == "dict `trainer.cache` ← global `trainer` in __main__", cache
assert "`trainer.cache` keeps 6 Arrays (6.00 MiB)" in cache[0]["advice"], cache
assert cache[0]["name"] == "trainer.cache" and cache[0]["blocks"] == 6, cache
module = holder_of(found, "model.py:30:forward")
assert len(module) == 1 and module[0]["holder"] == "list `history` (global in registry)", module
cls = holder_of(found, "cache.py:9:remember")
assert cls[0]["holder"] == "list `Cache.store` ← class `Cache`" and cls[0]["blocks"] == 6, cls
assert module[0]["blocks"] == 6 and module[0]["bytes"] == 18 << 20, module
print("ok")
"""

VIEW_CHILD = PRELUDE + r"""
views = []
for step in range(6):
    at("attn.py:50:forward")
    base = Array(gmem.malloc(8 << 20), 8 << 20)
    views.append(Array(base.ptr + (1 << 20), 1 << 20, base=base))   # a 1 MiB slice kept
    del base
    gmem.step()

found = gmem.leaks()
view = holder_of(found, "attn.py:50:forward")
assert len(view) == 1, view
assert view[0]["holder"] == ("list `views` (global in __main__); a view of 1.00 MiB keeps the "
                             "whole block (8.00 MiB) alive"), view
assert view[0]["noun"] == "Array" and view[0]["view"] and view[0]["bytes"] == 48 << 20, view
assert "6 Arrays (views), 48.00 MiB in 6 blocks, kept by list `views`" in str(found), str(found)
print("ok")
"""

# nn.Module's layout (torch is not installed here): _modules and _forward_hooks as OrderedDicts in
# the instance's __dict__; the GPU tests run the same with torch (test_torch_gpu.py).
MODULE_HOOK_CHILD = PRELUDE + r"""
import collections

class Module:
    def __init__(self, *children):
        self._parameters, self._buffers = collections.OrderedDict(), collections.OrderedDict()
        self._forward_hooks = collections.OrderedDict()
        self._modules = collections.OrderedDict((str(i), c) for i, c in enumerate(children))
    def register_forward_hook(self, fn):
        self._forward_hooks[len(self._forward_hooks)] = fn
    def __call__(self, x):
        for child in self._modules.values():
            x = child(x)
        out = Array(gmem.malloc(1 << 20), 1 << 20)
        for hook in self._forward_hooks.values():
            hook(self, x, out)
        return out

class Optimizer:
    def __init__(self):
        self.param_groups, self.state = [], collections.defaultdict(dict)

def train():
    model = Module(Module(), Module(), Module())
    feats = []
    model._modules["1"].register_forward_hook(lambda m, i, o: feats.append(o))
    model._modules["2"].cache = []
    optimizer = Optimizer()
    for step in range(6):
        at("train.py:173:train")
        model(None)
        at("train.py:180:train")
        model._modules["2"].cache.append(Array(gmem.malloc(3 << 20), 3 << 20))
        at("train.py:190:train")
        optimizer.state[step]["exp_avg"] = Array(gmem.malloc(5 << 20), 5 << 20)
        gmem.step()
    return gmem.leaks()

found = train()
hook = [g for g in holder_of(found, "train.py:173:train") if g["kind"] == "hook"]
assert len(hook) == 1 and hook[0]["blocks"] == 6, str(found)
assert hook[0]["holder"].startswith("list `feats` ← closure of `<lambda>` (<string>:"), hook
assert hook[0]["holder"].endswith(") ← forward hook on model.1 ← local `model` of train() (<string>:61)"), hook
# The other modules' outputs were dropped in Python but never freed in gmem: nothing holds them.
lost = [g for g in holder_of(found, "train.py:173:train") if g["kind"] == "none"]
assert lost and lost[0]["blocks"] == 18 and "no Python object found" in lost[0]["holder"], lost
cache = holder_of(found, "train.py:180:train")
assert cache[0]["holder"] == "list `model.2.cache` ← local `model` of train() (<string>:61)", cache
assert cache[0]["kind"] == "attribute", cache
state = holder_of(found, "train.py:190:train")
assert state[0]["holder"].startswith("dict `optimizer.state[<param>]` ← state of optimizer "
                                     "`optimizer` (Optimizer)"), state
assert state[0]["kind"] == "optimizer", state
print("ok")
"""

# Losses kept with their autograd graph, with a stand-in for torch (not installed here): tensors
# expose their storage; a node's saved tensors come back as new tensor objects over the same
# storage, as torch's `_saved_*` attributes do, and no Python object refers to the activations.
GRAPH_CHILD = PRELUDE + r"""
class Storage:
    def __init__(self, ptr, nbytes):
        self.ptr, self.n = ptr, nbytes
    def data_ptr(self):
        return self.ptr
    def nbytes(self):
        return self.n

class Device:
    type = "cuda"

class Tensor:
    device = Device()
    def __init__(self, ptr, nbytes, grad_fn=None):
        self._storage, self.grad_fn = Storage(ptr, nbytes), grad_fn
    def untyped_storage(self):
        return self._storage
    def numel(self):
        return self._storage.n // 4
    def element_size(self):
        return 4

class Node:
    def __init__(self, saved_ptr, saved_bytes, *next_nodes):
        self._saved = (saved_ptr, saved_bytes)   # what C++ holds, invisible as a tensor
        self.next_functions = tuple((n, 0) for n in next_nodes)

class PowBackward0(Node):
    @property
    def _saved_self(self):
        return Tensor(*self._saved)

class AddmmBackward0(Node):
    @property
    def _saved_mat1(self):
        return Tensor(*self._saved)

sys.modules["torch"] = types.SimpleNamespace(Tensor=Tensor)
losses = []
for step in range(6):
    at("val.py:30:validate")
    hidden = gmem.malloc(2 << 20)
    output = gmem.malloc(1 << 20)
    loss = Tensor(gmem.malloc(512), 512,
                  PowBackward0(output, 1 << 20, AddmmBackward0(hidden, 2 << 20), None))
    losses.append(loss)
    gmem.step()
del loss

found = gmem.leaks()
groups = holder_of(found, "val.py:30:validate")
assert [(g["kind"], g["blocks"]) for g in groups] == [("graph", 12), ("global", 6)], str(found)
assert groups[0]["holder"] == ("the autograd graph (`.grad_fn`, saved by AddmmBackward0, "
                               "PowBackward0) of tensors held by list `losses` (global in __main__)"), groups
assert groups[0]["name"] == "losses" and groups[0]["bytes"] == 18 << 20, groups
assert groups[1]["holder"] == "list `losses` (global in __main__)", groups
advice = str(found).split("What to do:")[1].splitlines()
assert advice[1].startswith("  - `losses` keeps each tensor's autograd graph (12 tensors (18.00 MiB))"), advice
print("ok")
"""

# On request: an address, a site, a local of a live frame, from another thread, and the bounds.
REQUEST_CHILD = PRELUDE + r"""
def train():
    at("loop.py:88:train")
    batch = Array(gmem.malloc(5 << 20), 5 << 20)
    interior = batch.ptr + 4096
    return gmem.holders(interior), gmem.holders("loop.py:88:train"), batch

by_address, by_site, batch = train()
g = by_address.groups("block at 0x%x" % (batch.ptr + 4096))
assert len(g) == 1 and g[0]["holder"].startswith("local `batch` of train() (<string>:"), str(by_address)
assert g[0]["kind"] == "local" and g[0]["bytes"] == 5 << 20, g
assert by_site.groups("loop.py:88:train")[0]["holder"] == g[0]["holder"], str(by_site)
assert "`del batch`" in by_address.advice[0], by_address.advice

# Nothing there: says what it looked at.
nothing = gmem.holders(0x10)
assert nothing.targets[0]["blocks"] == 0 and "no live block there now" in str(nothing), str(nothing)
unknown = gmem.holders("nowhere.py:1:f")
assert "nowhere.py:1:f: 0 blocks" in str(unknown), str(unknown)

# No leak findings: holders() says why it searched nothing.
none = gmem.holders()
assert none.targets == [] and "no leak findings" in str(none), str(none)

# The bound: a search that may visit 10 objects stops at once and says so.
small = gmem.holders(batch.ptr, max_objects=10)
assert "stopped at its bound of 10 objects visited" in str(small), str(small)
late = gmem.holders(batch.ptr, timeout=0.0)
assert "time bound (0.0 s)" in str(late), str(late)

# From another thread (the search takes the GIL like any Python code).
result = []
t = threading.Thread(target=lambda: result.append(gmem.holders(batch.ptr)))
t.start(); t.join()
assert "global `batch` in __main__" in result[0].groups("block at 0x%x" % batch.ptr)[0]["holder"], \
    str(result[0])
try:
    gmem.holders(3.5)
except TypeError as e:
    assert "an address (int), a site (str)" in str(e)
else:
    raise AssertionError("a float target was accepted")
print("ok")
"""

UNTRACKED_CHILD = r"""
import gmem
gmem.disable_tracking() if gmem.is_tracking() else None
found = gmem.holders()
assert found.targets == [] and "is not tracked" in str(found), str(found)
ptr = gmem.malloc(1 << 20)
class A:
    __cuda_array_interface__ = None
kept = [type("Arr", (), {"__cuda_array_interface__": property(
    lambda self: {"shape": (1 << 18,), "typestr": "<f4", "data": (ptr, False), "version": 3})})()]
g = gmem.holders(ptr).groups("block at 0x%x" % ptr)
assert g and g[0]["holder"] == "list `kept` (global in __main__)", g
print("ok")
"""

# An OOM: the report (text and JSON) gets the holders and the processes, the holder first in the
# advice; asking twice gives the same report (searched once per OOM).
OOM_CHILD = PRELUDE + r"""
gmem.set_memory_limit(256 << 20)
outputs = []
try:
    while True:
        at("infer.py:12:run")
        outputs.append(Array(gmem.malloc(20 << 20), 20 << 20))
        gmem.step()
except gmem.OutOfMemoryError:
    pass
text = gmem.last_oom_report()
assert "cause: leak: infer.py:12:run" in text, text
assert "Who holds it" in text and "kept by list `outputs` (global in __main__)" in text, text
assert "Processes on device 0: unknown: NVML is not available here" in text, text
first = text.split("What to do:")[1].splitlines()[1]
assert first.startswith("  - `outputs` keeps"), first
assert gmem.last_oom_report() == text
d = gmem.last_oom_report(as_json=True)
assert d["holders"]["targets"][0]["groups"][0]["name"] == "outputs", d["holders"]
assert d["advice"][0].startswith("`outputs` keeps"), d["advice"]
assert d["processes"]["available"] is False, d["processes"]
summary = gmem.memory_summary()
assert "kept by list `outputs`" in summary and "Processes on device 0" in summary, summary
# A burst of OOMs (cuDNN retrying with less workspace) shares the first one's search, and says so.
try:
    gmem.malloc(300 << 20)
except gmem.OutOfMemoryError:
    pass
second = gmem.last_oom_report()
assert second != text and "tried to allocate 300.00 MiB" in second, second
assert "at the out-of-memory error just before this one" in second, second
assert "kept by list `outputs`" in second, second
print("ok")
"""


class LeakHoldersTest(unittest.TestCase):
    def test_a_closure_and_a_global_list(self):
        assert_child_ok(self, CLOSURE_AND_GLOBAL_CHILD)

    def test_a_module_attribute_and_a_dict_in_an_instance(self):
        assert_child_ok(self, MODULE_AND_INSTANCE_CHILD)

    def test_a_view_keeps_its_larger_block(self):
        assert_child_ok(self, VIEW_CHILD)

    def test_a_hook_a_module_attribute_and_optimizer_state(self):
        assert_child_ok(self, MODULE_HOOK_CHILD)

    def test_losses_kept_through_their_graph(self):
        assert_child_ok(self, GRAPH_CHILD)

    def test_on_request_bounded_and_from_a_thread(self):
        assert_child_ok(self, REQUEST_CHILD)

    def test_untracked(self):
        assert_child_ok(self, UNTRACKED_CHILD)

    def test_oom_report_and_summary(self):
        assert_child_ok(self, OOM_CHILD)


class AdviceTest(unittest.TestCase):
    def test_a_small_holder_does_not_lead_the_advice(self):
        from gmem._holders import Holders
        found = Holders([{"target": "infer.py:12:run", "blocks": 3, "bytes": 1000, "groups": [
            {"bytes": 900, "advice": "graph advice"}, {"bytes": 60, "advice": "local advice"}]}])
        self.assertEqual(found.advice, ["graph advice"])
        # A leak finding's share is of what it leaked, not of every block at its site (the
        # weights allocated on the same line, say).
        found = Holders([{"target": "model.py:9:forward", "blocks": 10, "bytes": 37, "leaked_bytes": 4,
                          "groups": [{"bytes": 33, "advice": None},
                                     {"bytes": 4, "advice": "cache advice"}]}])
        self.assertEqual(found.advice, ["cache advice"])


class FakeNvml:
    def __init__(self, rows):
        self.rows = rows
        self.asked = []

    def device_processes(self, index):
        self.asked.append(index)
        return self.rows


class ProcessesTest(unittest.TestCase):
    def setUp(self):
        import gmem  # noqa: F401  (support put the package on the path)
        self.gmem = sys.modules["gmem"]

    def test_without_nvml_it_says_so(self):
        found = self.gmem.processes()
        self.assertFalse(found.available)
        self.assertIn("NVML is not available here", str(found))

    def test_this_process_a_child_and_others(self):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.addCleanup(child.wait)
        self.addCleanup(child.kill)
        me = os.getpid()
        table = {}

        def proc(pid):  # the real /proc for this process and its child, made-up others
            if pid in table:
                return table[pid]
            from gmem._holders import _proc
            return _proc(pid)
        table[900001] = {"ppid": 1, "command": "python old_train.py"}        # orphaned
        table[900002] = {"ppid": 900003, "command": proc(me)["command"]}     # same command
        table[900003] = {"ppid": 1, "command": "bash"}
        table[900004] = {"ppid": 900003, "command": "python serve.py"}
        nvml = FakeNvml([(me, 2 << 30), (child.pid, 500 << 20), (900001, 3 << 30),
                         (900002, 1 << 30), (900004, 100 << 20), (999999999, None)])
        found = self.gmem.processes(device=1, nvml=nvml, proc=proc)
        self.assertEqual(nvml.asked, [1])
        rows = {r["pid"]: r for r in found.rows}
        self.assertEqual(rows[me]["relation"], "this process")
        self.assertTrue(rows[child.pid]["relation"].startswith("child of this process"), rows)
        self.assertIn("looks like a leftover (orphaned)", rows[900001]["relation"])
        self.assertTrue(rows[900001]["leftover"])
        self.assertIn("this same command, outside this job", rows[900002]["relation"])
        self.assertEqual(rows[900004]["relation"], "another process")
        self.assertFalse(rows[900004]["leftover"])
        self.assertIn("not visible from here", rows[999999999]["relation"])
        self.assertIsNone(rows[999999999]["bytes"])
        text = str(found)
        self.assertTrue(text.startswith("Processes on device 1 (NVML):"), text)
        self.assertLess(text.index("old_train.py"), text.index("this process"))  # largest first
        self.assertIn("? B", text)

    def test_a_forked_child_reads_as_a_dataloader_worker(self):
        me = os.getpid()
        from gmem._holders import _proc
        mine = _proc(me)
        table = {777777: {"ppid": me, "command": mine["command"]}}
        found = self.gmem.processes(nvml=FakeNvml([(777777, 64 << 20)]),
                                    proc=lambda pid: table.get(pid) or _proc(pid))
        self.assertIn("forked: a DataLoader worker?", found.rows[0]["relation"])

    def test_nvml_errors_are_reported_not_raised(self):
        class Broken:
            def device_processes(self, index):
                raise OSError("nvmlDeviceGetHandleByIndex_v2 failed: Invalid Argument")
        found = self.gmem.processes(nvml=Broken())
        self.assertFalse(found.available)
        self.assertIn("Invalid Argument", str(found))


class RunHolderReportTest(unittest.TestCase):
    def test_the_oom_path_never_raises(self):
        # A failing search becomes a note in the report, not an exception in the OOM path.
        code = PRELUDE + r"""
from gmem import _holders
def boom(*a, **k):
    raise RuntimeError("heap walk failed")
_holders._search = boom
found = _holders._safe_holders(0x1234)
assert "the holder search failed: RuntimeError: heap walk failed" in str(found), str(found)
_holders._on_oom(0, 1, 2, 3)     # no OOM yet: nothing to do, and nothing raised
print("ok")
"""
        assert_child_ok(self, code)


if __name__ == "__main__":
    unittest.main()
