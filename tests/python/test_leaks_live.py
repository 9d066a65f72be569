"""The live leak API over the simulated device: gmem.leaks() (the findings so far, printable and as
dicts) and gmem.torch.watch() marking the steps, from an optimizer's step() or a model's forward
(with stand-ins for torch's optimizer and modules). Each case runs in a child process: leak
detection looks at every step the process has taken."""

import unittest

from support import run_python

PRELUDE = r"""
import sys
sys.path.insert(0, "tests/python")
import gmem, gmem.torch
from test_observe import FakeModule, FakeTensor, Handle

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
assert found.steps == 10, found.steps
assert found.cause == "leak", found.cause
assert len(found) == 1 and found[0]["site"] == "train.py:40:train", found.as_dicts()
assert found.as_dicts()[0]["bytes_per_step"] == 1 << 20, found.as_dicts()
text = str(found)
assert text.startswith("Leaks in device 0: 10 step boundaries, from gmem.step() markers"), text
assert "cause: leak: train.py:40:train keeps +1.00 MiB a step" in text, text
assert "torch.no_grad()" in text.split("What to do:")[1].splitlines()[1], text
assert "train.py:40:train" in repr(found), repr(found)
watching.remove()
optimizer.step()
assert gmem.leaks().steps == 10      # no hook any more
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
assert found.steps == 10 and not found and found.as_dicts() == [], found.as_dicts()
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
assert found.steps == 9, found.steps              # the first forward begins step 0
sites = [(f["site"], f["bytes_per_step"]) for f in found]
assert sites == [("model.0", 4096), ("model", 2048)], sites
scopes = {b["scope"] for s in gmem.snapshot()["segments"] for b in s["blocks"]
          if b["state"] == "active_allocated"}
assert scopes == {"model", "model.0"}, scopes     # module tracking is on too
watching.remove()
model(FakeTensor(requires_grad=False))
assert gmem.leaks().steps == 9
assert model.pre == [] and model.post == []
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
        result = run_python(["-c", child])
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("ok", result.stdout)

    def test_watch_optimizer_marks_steps_and_leaks_finds_the_kept_losses(self):
        self.check(OPTIMIZER_CHILD)

    def test_a_clean_loop_has_no_findings(self):
        self.check(CLEAN_CHILD)

    def test_watch_model_tracks_modules_and_marks_a_step_per_forward(self):
        self.check(MODEL_CHILD)

    def test_without_tracking_and_with_the_wrong_object(self):
        self.check(UNTRACKED_CHILD)


if __name__ == "__main__":
    unittest.main()
