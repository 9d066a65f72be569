"""gmem as PyTorch's allocator on a real GPU (skipped without PyTorch or CUDA).

Each check runs in its own process, since an allocator can only be chosen before CUDA starts:
this file is also the worker (`python test_torch_gpu.py MODE ALLOCATOR`), which prints one
line `RESULT {json}` for the test to judge.
"""

import importlib.util
import json
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from support import round_up, run_python  # noqa: E402

MiB = 1 << 20


def run_worker(mode, allocator, timeout=300):
    result = run_python([os.path.join(HERE, "test_torch_gpu.py"), mode, allocator], timeout=timeout,
                        GMEM_DEVICE=None, CUBLAS_WORKSPACE_CONFIG=":4096:8",
                        PYTHONUNBUFFERED="1")
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError("worker %s/%s failed (exit %d):\n%s\n%s" % (
        mode, allocator, result.returncode, result.stdout[-3000:], result.stderr[-6000:]))


def setUpModule():
    if importlib.util.find_spec("torch") is None:
        raise unittest.SkipTest("PyTorch is not installed")
    probe = run_python(["-c", "import torch; print(torch.cuda.is_available())"], GMEM_DEVICE=None)
    if probe.stdout.strip() != "True":
        raise unittest.SkipTest("no CUDA device for PyTorch")


class TorchOnGpuTest(unittest.TestCase):
    def test_training_losses_are_identical_bit_for_bit(self):
        native = run_worker("train", "native")
        ours = run_worker("train", "gmem")
        self.assertEqual(native["allocator"], "native")
        self.assertEqual(ours["allocator"], "gmem")
        self.assertEqual(len(ours["losses"]), 30)
        self.assertEqual(ours["losses"], native["losses"])
        self.assertGreater(ours["max_memory_allocated"], 0)

    def test_memory_allocated_is_the_sum_of_live_storages(self):
        r = run_worker("storages", "gmem")
        for step in r["steps"]:
            self.assertEqual(step["allocated"], step["expected"], step["what"])
        self.assertTrue(r["arange_sum_ok"], "memory handed to PyTorch holds data")
        self.assertGreaterEqual(r["reserved"], r["allocated"])
        self.assertGreaterEqual(r["max_allocated"], r["allocated"])
        self.assertEqual(r["stats_allocated"], r["allocated"])
        self.assertIn("gmem memory summary", r["summary"])
        self.assertEqual(r["max_after_reset"], r["allocated_after_reset"])
        self.assertLess(r["reserved_after_empty_cache"], r["reserved_before_empty_cache"])

    def test_out_of_memory_is_torch_out_of_memory_and_recoverable(self):
        r = run_worker("oom", "gmem")
        self.assertEqual(r["oom_type"], "torch.OutOfMemoryError",
                         "%s; entry points %s; warnings %s" % (r["oom_message"], r["entry_points"],
                                                                r["warnings"]))
        self.assertIn("tried to allocate 256.00 MiB", r["oom_message"])
        self.assertIn("limit 384.00 MiB", r["oom_message"])
        self.assertTrue(r["after_free_ok"], "the same request fits once memory was freed")
        self.assertEqual(r["fraction_oom_type"], "torch.OutOfMemoryError",
                         "torch.cuda.set_per_process_memory_fraction reaches gmem")
        self.assertTrue(r["after_fraction_reset_ok"])


# --- the worker -------------------------------------------------------------------------------


def deterministic(torch):
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def worker_train(torch, result):
    """An MLP and a small CNN (no ops without deterministic kernels), batch sizes varying."""
    nn, F = torch.nn, torch.nn.functional
    deterministic(torch)
    mlp = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                        nn.Linear(512, 10)).cuda()
    cnn = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU()).cuda()
    head = nn.Linear(32, 10).cuda()
    params = list(mlp.parameters()) + list(cnn.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    data = torch.Generator().manual_seed(1)
    losses = []
    for step in range(30):
        batch = 48 + 16 * (step % 4)
        x = torch.randn(batch, 256, generator=data).cuda()
        y = torch.randint(0, 10, (batch,), generator=data).cuda()
        images = torch.randn(batch // 2, 3, 32, 32, generator=data).cuda()
        labels = torch.randint(0, 10, (batch // 2,), generator=data).cuda()
        features = cnn(images).mean(dim=(2, 3))
        loss = F.cross_entropy(mlp(x), y) + F.cross_entropy(head(features), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item().hex())
    result.update(losses=losses, max_memory_allocated=torch.cuda.max_memory_allocated())


def live_storage_bytes(tensors):
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = round_up(storage.nbytes())
    return sum(storages.values())


def worker_storages(torch, result):
    torch.cuda.init()
    base = torch.cuda.memory_allocated()
    steps = []

    def check(what, tensors):
        torch.cuda.synchronize()
        steps.append(dict(what=what, allocated=torch.cuda.memory_allocated() - base,
                          expected=live_storage_bytes(tensors)))

    tensors = [torch.empty(n, dtype=torch.uint8, device="cuda")
               for n in (0, 1, 511, 512, 513, 4096, MiB, MiB + 1, 5 * MiB + 3, 64 * MiB)]
    tensors.append(torch.zeros(3, 5, 7, dtype=torch.float16, device="cuda"))
    tensors.append(torch.randn(1000, 1000, device="cuda"))
    views = [tensors[-1][10:20], tensors[-1].t(), tensors[-2].view(5, 21)]
    check("after allocating", tensors + views)
    del views, tensors[::2]
    check("after freeing every other one", tensors)
    ramp = torch.arange(1 << 20, device="cuda", dtype=torch.float64)
    result["arange_sum_ok"] = ramp.sum().item() == float((1 << 20) * ((1 << 20) - 1) // 2)
    tensors.append(ramp)
    check("after computing", tensors)

    side = torch.cuda.Stream()
    shared = torch.ones(MiB, device="cuda")
    with torch.cuda.stream(side):
        shared.mul_(2)
    shared.record_stream(side)
    del shared
    torch.cuda.synchronize()

    result.update(steps=steps, allocated=torch.cuda.memory_allocated(),
                  reserved=torch.cuda.memory_reserved(),
                  max_allocated=torch.cuda.max_memory_allocated(),
                  stats_allocated=torch.cuda.memory_stats()["allocated_bytes.all.current"],
                  summary=torch.cuda.memory_summary())
    torch.cuda.reset_peak_memory_stats()
    result.update(max_after_reset=torch.cuda.max_memory_allocated(),
                  allocated_after_reset=torch.cuda.memory_allocated())
    del tensors, ramp
    result["reserved_before_empty_cache"] = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    result["reserved_after_empty_cache"] = torch.cuda.memory_reserved()


def try_allocate(torch, nbytes):
    """(kind of failure or "none", message, tensor)."""
    try:
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        return "none", "", t
    except torch.cuda.OutOfMemoryError as e:
        return "torch.OutOfMemoryError", str(e), None
    except RuntimeError as e:
        return "RuntimeError", str(e), None


def worker_oom(torch, result):
    import gmem

    torch.cuda.init()
    gmem.set_memory_limit(384 * MiB)
    first = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    kind, message, _ = try_allocate(torch, 256 * MiB)
    result.update(oom_type=kind, oom_message=message)
    del first
    kind, _, second = try_allocate(torch, 256 * MiB)
    # min/max reduce in place (a sum over uint8 would make a 2 GiB int64 copy, over the limit).
    result["after_free_ok"] = (kind == "none" and second.fill_(1).min().item() == 1
                               and second.max().item() == 1)
    del second
    gmem.set_memory_limit(0)

    torch.cuda.set_per_process_memory_fraction(0.001)
    kind, message, _ = try_allocate(torch, 256 * MiB)
    result.update(fraction_oom_type=kind, fraction_oom_message=message)
    torch.cuda.set_per_process_memory_fraction(1.0)
    kind, _, third = try_allocate(torch, 256 * MiB)
    result["after_fraction_reset_ok"] = kind == "none"


def worker(mode, allocator):
    import warnings

    result = {"mode": mode, "allocator": allocator}
    if allocator == "gmem":
        import gmem.torch

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gmem.torch.enable()
        result.update(entry_points=gmem.torch.entry_points(),
                      warnings=[str(w.message) for w in caught])
    import torch

    {"train": worker_train, "storages": worker_storages, "oom": worker_oom}[mode](torch, result)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        # support (imported above for the tests) points gmem at the simulated device; a worker
        # runs real kernels, so it needs the GPU.
        os.environ.pop("GMEM_DEVICE", None)
        worker(sys.argv[1], sys.argv[2])
    else:
        unittest.main()
