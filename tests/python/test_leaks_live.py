"""The live leak API over the simulated device: gmem.leaks() (the findings so far, printable and as
dicts) and gmem.torch.watch() marking the steps, from an optimizer's step() or a model's forward
(with stand-ins for torch's optimizer and modules). Each case runs in a child process: leak
detection looks at every step the process has taken."""

import unittest

from support import assert_child_ok

PRELUDE = r"""
import sys
sys.path.insert(0, "tests/python")
import types
import gmem, gmem.torch
from test_observe import FakeModule, FakeTensor, Handle

class SavedTensorsHooks:
    # torch.autograd.graph.saved_tensors_hooks: the innermost pair packs what autograd saves.
    stack = []
    def __init__(self, pack, unpack):
        self.pack, self.unpack = pack, unpack
    def __enter__(self):
        SavedTensorsHooks.stack.append(self)
        return self
    def __exit__(self, *exc):
        SavedTensorsHooks.stack.remove(self)

sys.modules["torch"] = types.SimpleNamespace(
    autograd=types.SimpleNamespace(graph=types.SimpleNamespace(saved_tensors_hooks=SavedTensorsHooks)))

class CudaTensor:
    # A tensor on device 0 whose storage is a block gmem allocated (a view `offset` elements in).
    def __init__(self, ptr, offset=0):
        self.ptr, self.offset = ptr, offset
    def get_device(self):
        return 0
    def data_ptr(self):
        return self.ptr + 4 * self.offset
    def storage_offset(self):
        return self.offset
    def element_size(self):
        return 4
    def view(self, offset):
        return CudaTensor(self.ptr, offset)
    def detach(self):
        return CudaTensor(self.ptr, self.offset)  # the same storage, without the graph

def autograd_saves(tensor):
    # What autograd does when an operation saves a tensor for backward, under the hooks.
    return SavedTensorsHooks.stack[-1].pack(tensor) if SavedTensorsHooks.stack else tensor

def autograd_unpacks(packed):
    # ... and when backward uses it.
    return SavedTensorsHooks.stack[-1].unpack(packed) if SavedTensorsHooks.stack else packed

class FakeOptimizer:
    # torch.optim.Optimizer's step post-hooks: fn(optimizer, args, kwargs) after each step().
    def __init__(self):
        self.hooks = []
    def register_step_post_hook(self, fn):
        self.hooks.append(fn)
        return Handle(self.hooks, fn)
    def step(self):
        for fn in list(self.hooks):
            fn(self, (), {})
"""

OPTIMIZER_CHILD = PRELUDE + r"""
gmem.enable_tracking()
optimizer = FakeOptimizer()
watching = gmem.torch.watch(optimizer)
gmem.set_frames([("train.py", 40, "train")])
losses = []
for i in range(10):
    activations = gmem.malloc(8 << 20)
    losses.append(gmem.malloc(1 << 20))    # losses.append(loss): kept every step
    gmem.free(activations)
    optimizer.step()
found = gmem.leaks()
assert found.steps == 11, found.steps           # watch() marks the start, then each step()
assert found.cause == "leak", found.cause
assert len(found) == 1 and found[0]["site"] == "train.py:40:train", found.as_dicts()
assert found.as_dicts()[0]["bytes_per_step"] == 1 << 20, found.as_dicts()
text = str(found)
assert text.startswith("Leaks in device 0: 11 step boundaries, from gmem.step() markers"), text
assert "cause: leak: train.py:40:train keeps +1.00 MiB a step" in text, text
assert "torch.no_grad()" in text.split("What to do:")[1].splitlines()[1], text
assert "train.py:40:train" in repr(found), repr(found)
watching.remove()
optimizer.step()
assert gmem.leaks().steps == 11      # no hook any more
print("ok")
"""

CLEAN_CHILD = PRELUDE + r"""
gmem.enable_tracking()
optimizer = FakeOptimizer()
gmem.torch.watch(optimizer)
weights = gmem.malloc(16 << 20)       # created once: not a leak
for i in range(10):
    activations = gmem.malloc(8 << 20)
    gmem.free(activations)
    optimizer.step()
found = gmem.leaks()
assert found.steps == 11 and not found and found.as_dicts() == [], found.as_dicts()
assert found.cause == "none", found.cause
assert "No leaks found" in str(found), str(found)
print("ok")
"""

MODEL_CHILD = PRELUDE + r"""
# Sites by module scope: every FakeModule allocates on one line of test_observe.py, which Python
# stacks would name for both.
gmem.enable_tracking(stacks="thread")
# FakeModule keeps what its forward allocates: model.0 keeps 4 KiB a call, the model 2 KiB.
model = FakeModule(2048, FakeModule(4096))
watching = gmem.torch.watch(model)
for i in range(10):
    model(FakeTensor(requires_grad=False))
found = gmem.leaks()
assert found.steps == 10, found.steps             # each forward begins a step
sites = [(f["site"], f["bytes_per_step"]) for f in found]
assert sites == [("model.0", 4096), ("model", 2048)], sites
scopes = {b["scope"] for s in gmem.snapshot()["segments"] for b in s["blocks"]
          if b["state"] == "active_allocated"}
assert scopes == {"model", "model.0"}, scopes     # module tracking is on too
watching.remove()
model(FakeTensor(requires_grad=False))
assert gmem.leaks().steps == 10
assert model.pre == [] and model.post == []
print("ok")
"""

# Inference without no_grad keeping its outputs: the activations saved for a backward that never
# runs are a graph kept alive; a plain cache growing beside it is not flagged as one.
INFERENCE_GRAPH_CHILD = PRELUDE + r"""
gmem.enable_tracking(stacks="thread")
optimizer = FakeOptimizer()
watching = gmem.torch.watch(optimizer)        # graphs=True by default
assert len(SavedTensorsHooks.stack) == 1
outputs, cache = [], []
for i in range(12):
    gmem.set_frames([("infer.py", 21, "forward")])
    activation = CudaTensor(gmem.malloc(6 << 20))
    saved = autograd_saves(activation.view(1024))  # the next layer saves a view of it
    outputs.append((gmem.malloc(1 << 20), saved))
    gmem.set_frames([("cache.py", 5, "remember")])
    cache.append(gmem.malloc(1 << 20))        # a cache of plain tensors, kept on purpose
    optimizer.step()
found = gmem.leaks()
assert found.cause == "graph kept alive", str(found)
by_site = {f["site"]: f for f in found}
assert by_site["infer.py:21:forward"]["graph_bytes"] > 0, found.as_dicts()
assert by_site["cache.py:5:remember"]["graph_bytes"] == 0, found.as_dicts()
assert not by_site["infer.py:21:forward"]["backward_runs"]
text = str(found)
assert "cause: graph kept alive: tensors saved for a backward pass that never used them" in text, text
first_advice = text.split("What to do:")[1].splitlines()[1]
assert "Run inference under torch.no_grad()" in first_advice, first_advice
assert "no backward pass has run" in text, text
watching.remove()
assert SavedTensorsHooks.stack == []
print("ok")
"""

# A training loop whose backward uses what forward saved, and a validation loss kept with its
# graph (losses.append(loss) without no_grad): the advice is .item()/.detach().
KEPT_LOSS_CHILD = PRELUDE + r"""
gmem.enable_tracking(stacks="thread")
optimizer = FakeOptimizer()
gmem.torch.watch(optimizer)
val_losses = []
for i in range(12):
    gmem.set_frames([("train.py", 30, "forward")])
    activation = CudaTensor(gmem.malloc(8 << 20))
    packed = autograd_unpacks(autograd_saves(activation))   # forward saves it, backward uses it
    gmem.free(activation.ptr)
    gmem.set_frames([("train.py", 52, "validate")])
    val_activation = CudaTensor(gmem.malloc(4 << 20))
    val_losses.append((autograd_saves(val_activation), gmem.malloc(512)))  # loss kept, graph too
    optimizer.step()
found = gmem.leaks()
assert found.cause == "graph kept alive", str(found)
assert found[0]["site"] == "train.py:52:validate" and found[0]["backward_runs"], found.as_dicts()
first_advice = str(found).split("What to do:")[1].splitlines()[1]
assert "Keep loss.item() or tensor.detach()" in first_advice, first_advice
print("ok")
"""

UNTRACKED_CHILD = r"""
import gmem, gmem.torch
try:
    gmem.leaks()
except gmem.InvalidArgumentError as e:
    assert "not tracked" in str(e) and "enable_tracking" in str(e), str(e)
else:
    raise AssertionError("gmem.leaks() without tracking did not raise")
try:
    gmem.torch.watch(object())
except TypeError as e:
    assert "Optimizer" in str(e) and "Module" in str(e), str(e)
print("ok")
"""


class LiveLeaksTest(unittest.TestCase):
    def check(self, child):
        assert_child_ok(self, child)

    def test_watch_optimizer_marks_steps_and_leaks_finds_the_kept_losses(self):
        self.check(OPTIMIZER_CHILD)

    def test_a_clean_loop_has_no_findings(self):
        self.check(CLEAN_CHILD)

    def test_watch_model_tracks_modules_and_marks_a_step_per_forward(self):
        self.check(MODEL_CHILD)

    def test_inference_keeping_outputs_is_a_graph_kept_alive_and_a_cache_is_not(self):
        self.check(INFERENCE_GRAPH_CHILD)

    def test_a_kept_validation_loss_is_a_graph_kept_alive_with_item_advice(self):
        self.check(KEPT_LOSS_CHILD)

    def test_without_tracking_and_with_the_wrong_object(self):
        self.check(UNTRACKED_CHILD)


if __name__ == "__main__":
    unittest.main()
