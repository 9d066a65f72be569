"""Where a step's time goes on the host: the models package's <MODEL>_step with its final host
sync (`loss.item()`) taken apart. Each step is timed as launch (the host running the step's Python
until its last kernel is queued: finish_training_step's `loss.item()` is replaced by a
torch.cuda.Event record) and wall (to that event's completion); their medians over STEPS steps
after WARM, under ALLOC=gmem (the default; GMEM_LIBRARY names the library) or native.

    MODEL=distill WARM=8 STEPS=30 ALLOC=gmem python3 bench/torch/host_time.py

Used for docs/notes/left-to-do.md ("A fixed-shape loop can run ~1% slower than native").
"""
import json
import os
import statistics
import sys
import time

from profile_steps import enable_allocator

allocator = enable_allocator()
import torch  # noqa: E402 (gmem.torch must be enabled first)

import models  # noqa: E402

ended = []


def finish_without_sync(optimizer, loss):
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    event = torch.cuda.Event(enable_timing=False)
    event.record()
    ended.append(event)
    return 0.0


# Every factory calls finish_training_step as models.shared.finish_training_step, looked up at each
# call: replaced there, it is replaced in every program (models.finish_training_step is a copy of
# the name; setting it would change none).
models.shared.finish_training_step = finish_without_sync
name = os.environ.get("MODEL", "distill")
warm, steps = int(os.environ.get("WARM", "8")), int(os.environ.get("STEPS", "30"))
step = getattr(models, name + "_step")(torch, warm + steps)
launch, wall = [], []
for i in range(warm + steps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(i)
    t1 = time.perf_counter()
    ended[-1].synchronize()
    t2 = time.perf_counter()
    if i >= warm:
        launch.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
print(json.dumps(dict(model=name, alloc=allocator, launch_ms=round(statistics.median(launch), 3),
                      wall_ms=round(statistics.median(wall), 3),
                      launch_min=round(min(launch), 3), wall_min=round(min(wall), 3))))
