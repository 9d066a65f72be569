"""gmem as PyTorch's allocator on a real GPU (skipped without PyTorch or CUDA).

Each check runs in its own process, since an allocator can only be chosen before CUDA starts:
this file is also the worker (`python test_torch_gpu.py MODE ALLOCATOR`), which prints one
line `RESULT {json}` for the test to judge. Most workers are in torch_workers.py and
torch_graph_workers.py; those whose results name this file (the holders', by their lines) or
that pickle a function of it to a child (ipc) are below.
"""

import importlib.util
import json
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from support import run_python  # noqa: E402
from torch_graph_workers import (worker_compile, worker_fit, worker_graph,  # noqa: E402
                                 worker_graph_dropped, worker_graph_record_stream,
                                 worker_graph_reuse, worker_graphs_compile, worker_pool_peaks)
from torch_workers import (build_count_new, cpp_probe, imports_operator_new,  # noqa: E402
                           worker_cudnn, worker_history, worker_host_alloc, worker_oom,
                           worker_sites, worker_stats, worker_storages, worker_train)

MiB = 1 << 20


def run_worker(mode, allocator, timeout=300, **env):
    result = run_python([os.path.join(HERE, "test_torch_gpu.py"), mode, allocator], timeout=timeout,
                        GMEM_DEVICE=None, CUBLAS_WORKSPACE_CONFIG=":4096:8",
                        PYTHONUNBUFFERED="1", **env)
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
        # The full allocator answers PyTorch's own summary from C++; the fallback patches gmem's in.
        self.assertIn("CUDA memory summary" if r["mode"] == "full" else "gmem memory summary",
                      r["summary"])
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
        if r["mode"] == "full":
            self.assertEqual(r["observer_calls"], 2, "torch's OOM observers are called")
            self.assertEqual(r["memory_fraction"], 1.0)
            self.assertGreaterEqual(r["num_ooms"], 2)


class FullAllocatorOnGpuTest(unittest.TestCase):
    """gmem's complete CUDAAllocator: what the pluggable route could not do."""

    def test_enable_uses_the_full_allocator(self):
        r = run_worker("stats", "gmem")
        self.assertEqual(r["mode"], "full", r["warnings"])
        self.assertEqual(r["warnings"], [])
        # Read from C++ by a small extension (c10::cuda::CUDACachingAllocator::getDeviceStats).
        self.assertEqual(r["cpp_allocated"], r["py_allocated"])
        self.assertGreaterEqual(r["cpp_allocated"], 24 * MiB)
        self.assertEqual(r["cpp_name"], "gmem")
        self.assertEqual(r["cpp_allocated_after_free"], r["py_allocated_after_free"])
        self.assertLess(r["cpp_allocated_after_free"], r["cpp_allocated"])
        self.assertEqual(r["num_ooms"], 0)

    def test_python_call_sites_name_the_users_line(self):
        r = run_worker("sites", "gmem")
        self.assertIn(r["expected_site"], r["report"])
        self.assertIn(r["expected_site"], r["last_report"])
        # The cost per malloc, printed for the record (README quotes it).
        print("\nper torch.empty: %(ns_off).0f ns untracked, %(ns_fixed).0f ns tracked with "
              "fixed frames, %(ns_sites).0f ns tracked with Python sites, %(ns_deep).0f ns with "
              "sites 40 frames deep" % r)
        self.assertLess(r["ns_sites"] - r["ns_fixed"], 20000, "sites cost under 20 us a malloc")

    def test_cuda_graph_with_mem_pool(self):
        r = run_worker("graph", "gmem")
        self.assertTrue(r["replays_match_eager"])
        self.assertGreater(r["pool_reserved"], 0, "the graph's memory is counted")
        self.assertTrue(r["pool_block_in_snapshot"])
        self.assertEqual(r["use_count"], 1)
        self.assertLess(r["reserved_after_pool_deleted"], r["reserved_with_pool"])
        self.assertTrue(r["pool_not_reused_outside"])

    def test_peaks_count_pools_as_the_device_does(self):
        # A pool's blocks count in the device's figures, and the device's peak is the peak of
        # the whole: before StatsGroup gmem summed the engines' own peaks (64 + 48 MiB here).
        native = run_worker("pool_peaks", "native")
        ours = run_worker("pool_peaks", "gmem")
        self.assertEqual(native["peaks"], [64 * MiB, 80 * MiB, 0])
        self.assertEqual(ours["peaks"], native["peaks"])
        self.assertEqual(ours["currents"], native["currents"])

    def test_cuda_graph_whose_pool_reuses_memory_at_other_sizes(self):
        # Before pools had stable pages, gmem's pool stitched these blocks from chunks mapped
        # elsewhere and remapped pages under capture, waiting on the capturing stream: the
        # capture failed (as GPT-2 under torch.compile's reduce-overhead did, 2026-11-25).
        r = run_worker("graph_reuse", "gmem")
        self.assertTrue(r["captured"], r.get("error"))
        self.assertTrue(r["replays_correct"], r["wrong"])

    def test_cuda_graph_with_record_stream_inside_the_capture(self):
        r = run_worker("graph_record_stream", "gmem")
        self.assertTrue(r["captured"], r.get("error"))
        self.assertTrue(r["replays_correct"], r["wrong"])
        self.assertTrue(r["early_sum_right"])
        self.assertTrue(r["allocates_after"])

    def test_memory_history_and_snapshot_in_pytorch_tools(self):
        r = run_worker("history", "gmem")
        self.assertTrue(r["history_enabled"])
        self.assertTrue(r["block_frames_name_the_function"], r["some_frames"])
        self.assertGreater(r["alloc_events"], 0)
        self.assertGreater(r["free_events"], 0)
        self.assertTrue(r["trace_frames_name_the_function"])
        self.assertGreater(r["trace_plot_bytes"], 1000)
        self.assertGreater(r["segment_plot_bytes"], 1000)
        self.assertTrue(r["dumped"])

    def test_cudnn_benchmark(self):
        r = run_worker("cudnn", "gmem")
        self.assertTrue(r["close_to_reference"])
        self.assertGreater(r["convs"], 0)

    def test_allocator_malloc_and_free_make_no_host_allocation_in_steady_state(self):
        # The torch half of tests/unit/capi_host_alloc_test.cpp: the worker runs with
        # count_new.cpp preloaded, which counts global operator new (every form) on its thread.
        r = run_worker("host_alloc", "gmem", LD_PRELOAD=build_count_new(self))
        self.assertEqual(r["mode"], "full", r["warnings"])
        detail = ("operator new calls per step (this thread): raw alloc/free %s, the same loop "
                  "at size 0 (baseline) %s; all threads %s; mark_step %s; torch.empty/del "
                  "(torch's own, not judged) %s; gmem.num_maps over the steps: %d; controls: "
                  "torch.empty %d, gmem_stats_text %d"
                  % (r["steady"], r["baseline"], r["steady_all"], r["marks"], r["tensors"],
                     r["maps_in_steady_steps"], r["control_torch_empty"],
                     r["control_gmem_stats_text"]))
        print("\n" + detail)
        # Not vacuous: the counter sees operator new in libtorch (a CUDA tensor's TensorImpl and
        # StorageImpl) and in libgmem.so (gmem_stats_text builds its text in a std::string).
        self.assertGreater(r["control_torch_empty"], 0, "the preloaded operator new is not called")
        if r["control_gmem_stats_text"] == 0:
            # A libgmem.so that carries its own operator new (the H200 machine's build imports
            # none: its C++ runtime is linked in) calls it directly, and no preload sees it: its
            # malloc and free paths are then judged by tests/unit/capi_host_alloc_test.cpp alone,
            # and this test judges torch's path and gmem's adapter (whose operator new, LD_DEBUG
            # showed, binds to the counter). A libgmem.so that imports operator new and was not
            # seen would mean the counter is broken.
            self.assertFalse(imports_operator_new(r["libgmem"]),
                             "libgmem.so's operator new is not ours: " + detail)
            print("libgmem.so (%s) carries its own operator new: its paths are counted by "
                  "tests/unit/capi_host_alloc_test.cpp; judged here: torch's path and the "
                  "adapter" % r["libgmem"])
        # ... and the loop reached gmem's engine: every call allocated there, and returned memory.
        self.assertEqual(r["engine_allocations"], r["expected_allocations"])
        self.assertTrue(r["pointers_nonzero"])
        self.assertEqual([s - b for s, b in zip(r["steady"], r["baseline"])],
                         [0] * len(r["steady"]), detail)

    def test_cuda_tensor_to_another_process_says_what_to_do(self):
        r = run_worker("ipc", "gmem")
        if r["outcome"] != "worked":
            self.assertIn("sending CUDA tensors between processes", r["error"])
            self.assertIn("tensor.cpu()", r["error"])


class CompileOnGpuTest(unittest.TestCase):
    """torch.compile's three modes under gmem and native: the longest test, a class of its own so
    that scripts/gpu-check runs it beside the others."""

    def test_torch_compile_modes_match_native(self):
        native = run_worker("compile", "native", timeout=900)
        ours = run_worker("compile", "gmem", timeout=900)
        self.assertEqual(ours["mode"], "full", ours.get("warnings"))
        for mode in ("default", "reduce-overhead", "max-autotune"):
            self.assertTrue(ours["close_to_eager"][mode], mode)
        # The same generated code on both allocators; cuBLAS may still pick another algorithm
        # (it weighs pointer alignment), so equal to rounding, and the bits are reported.
        for mode in ("default", "reduce-overhead", "max-autotune"):
            diff = max(abs(a - b) for x, y in zip(ours["outputs"][mode], native["outputs"][mode])
                       for a, b in zip(x, y))
            print("\n%s: max |gmem - native| = %g%s" % (
                mode, diff, " (bit-identical)" if diff == 0 else ""))
            self.assertLess(diff, 1e-4 if mode == "max-autotune" else 1e-5, mode)
        for a, b in zip(ours["train_losses"], native["train_losses"]):
            self.assertAlmostEqual(a, b, places=5)
        self.assertEqual(len(ours["shape_turns"]), 14)
        for compiled, eager in ours["shape_turns"]:
            self.assertAlmostEqual(compiled, eager, delta=1e-3 * max(1.0, abs(eager)))

class FitOnGpuTest(unittest.TestCase):
    """gmem.fit_batch_size on a real model under a cap: the pick is the largest batch that runs
    (tried at pick + 1), no out-of-memory reaches the program, and memory is as it was."""

    def test_fit_finds_the_largest_batch_under_a_cap(self):
        r = run_worker("fit", "gmem")
        self.assertEqual(r["pick_runs"], True, r["fit_text"])
        # The pick is the largest batch that runs, or one below it (where gmem's overhead at the
        # pick was estimated on the safe side): two above never runs.
        self.assertEqual(r["two_above_runs"], False, r["fit_text"])
        if r["next_runs"]:
            print("\nthe pick was one below the largest that runs:\n" + r["fit_text"])
        self.assertLessEqual(r["steps"], 8)
        self.assertEqual(r["allocated_after"], r["allocated_before"], "the fit left memory held")
        self.assertEqual(r["what_fits_first"] in ("as is", "bf16 autocast", "fp16 autocast"), True)


class DiagnosticsOnGpuTest(unittest.TestCase):
    """examples/oom_causes.py: the four classic ways to run out of memory, each run to its OOM on
    the GPU (all four at once, each under its own few-GiB limit); the report must name the cause
    and put the fix for it first. Graph tracking under torch.compile."""

    def test_each_classic_oom_is_reported_with_its_cause(self):
        import subprocess
        from support import child_env

        expected = {"inference_leak": ("graph kept alive", "torch.no_grad()"),
                    "kept_loss": ("graph kept alive", "loss.item()"),
                    "batch_too_large": ("batch too large", "smaller batch"),
                    "fragmentation": ("fragmentation", "persistent buffers")}
        script = os.path.join(os.path.dirname(HERE), "..", "examples", "oom_causes.py")
        children = {case: subprocess.Popen(
            [sys.executable, script, case, "--json"], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, universal_newlines=True, env=child_env(GMEM_DEVICE=None))
            for case in expected}
        for case, child in children.items():
            out, err = child.communicate(timeout=300)
            self.assertEqual(child.returncode, 0, "%s:\n%s\n%s" % (case, out[-2000:], err[-4000:]))
            report = json.loads(out.strip().splitlines()[-1])
            cause, fix = expected[case]
            print("\n%s: cause: %s: %s\n  first advice: %s" % (
                case, report["cause"], report["explanation"], report["advice"][0]))
            self.assertEqual(report["cause"], cause, report["explanation"])
            self.assertIn(fix, report["advice"][0])

    def test_graph_tracking_frees_a_graph_never_run_backward(self):
        r = run_worker("graph_dropped", "gmem")
        self.assertEqual(r["left_plain"], 0)
        self.assertEqual(r["left_tracked"], 0, "graph tracking kept a dropped graph alive")
        self.assertEqual(r["grads_equal"], True)

    def test_graph_tracking_under_torch_compile(self):
        r = run_worker("graphs_compile", "gmem", timeout=600)
        self.assertEqual(r["losses_with"], r["losses_without"], "the hooks change nothing")
        self.assertEqual(r["findings"], [], "a clean compiled training loop has no leak")
        self.assertEqual(r["cause"], "graph kept alive", "kept compiled outputs are found")
        self.assertEqual(r["cache_cause"], "leak", "a growing cache of detached tensors is a leak")
        self.assertTrue(r["cache_graph_bytes"] and not any(r["cache_graph_bytes"]),
                        "... and holds no graph")


class HoldersOnGpuTest(unittest.TestCase):
    """Who holds it (gmem.holders, docs/holders.md) on the GPU: each classic way to keep memory
    alive, run to a leak finding, must be named by its holder, first in the advice; and a
    DataLoader worker that initialised CUDA (fork) is named as this job's child by NVML."""

    def show(self, r):
        print("\n" + r["section"] + "\n  first advice: %s\n  cost: %d objects visited, %.0f ms"
              % (r["first_advice"], r["visited"], r["ms"]))

    def holder_groups(self, r, kind):
        return [g for f in r["findings"] for g in f["holders"] if g["kind"] == kind]

    def test_a_forward_hook_that_keeps_activations(self):
        r = run_worker("holders_hook", "gmem")
        self.show(r)
        groups = self.holder_groups(r, "hook")
        self.assertTrue(groups, r["section"])
        holder = groups[0]["holder"]
        self.assertTrue(holder.startswith("list `feats` ← closure of `<lambda>` (test_torch_gpu.py:%d)"
                                          % r["hook_line"]), holder)
        self.assertIn("← forward hook on model.1", holder)
        self.assertGreaterEqual(groups[0]["blocks"], 6)   # one ReLU output a step
        self.assertTrue(r["first_advice"].startswith("`feats` keeps every output its hook sees"),
                        r["first_advice"])

    def test_losses_kept_with_their_graph(self):
        r = run_worker("holders_losses", "gmem")
        self.show(r)
        graph = self.holder_groups(r, "graph")
        self.assertTrue(graph, r["section"])
        self.assertTrue(graph[0]["holder"].startswith("the autograd graph (`.grad_fn`, saved by "),
                        graph[0]["holder"])
        self.assertIn("held by list `losses`", graph[0]["holder"])
        self.assertGreaterEqual(sum(g["blocks"] for g in graph), 6)
        self.assertTrue(r["first_advice"].startswith("`losses` keeps each tensor's autograd graph"),
                        r["first_advice"])
        self.assertGreater(r["saved_before"], 0)
        self.assertEqual(r["saved_before"], r["saved_after"],
                         "reading a graph's saved tensors is not a backward pass")

    def test_a_cache_attribute_on_a_module(self):
        r = run_worker("holders_cache", "gmem")
        self.show(r)
        groups = self.holder_groups(r, "attribute")
        self.assertTrue(groups, r["section"])
        self.assertTrue(groups[0]["holder"].startswith("list `model.2.cache` ← local `model` of "
                                                       "worker_holders_cache()"), groups[0]["holder"])
        self.assertTrue(r["first_advice"].startswith("`model.2.cache` keeps"), r["first_advice"])

    def test_gmem_run_names_the_hook_at_an_oom(self):
        # The program as a new user runs it: python -m gmem.run, a forward hook keeping
        # every activation, until gmem's cap runs out. The holders are searched at the OOM
        # (torch's OOM observer) and printed after the error, the hook's fix first.
        import tempfile
        script = """import torch, gmem, gmem.torch

def main():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gmem.enable_tracking()
    gmem.torch.watch(optimizer)
    gmem.set_memory_limit(1 << 30)
    feats = []
    model[1].register_forward_hook(lambda m, i, o: feats.append(o))
    x = torch.randn(1024, 1024, device="cuda")
    for _ in range(1000):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

main()
"""
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "hooked.py")
            with open(path, "w") as f:
                f.write(script)
            result = run_python(["-m", "gmem.run", path], timeout=300, GMEM_DEVICE=None)
        err = result.stderr
        print("\n" + err[err.find("gmem: Who holds it"):][:3000])
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("OutOfMemoryError", err)
        self.assertIn("kept by list `feats` ← closure of `<lambda>` (hooked.py:11) ← forward hook "
                      "on model.1 ← local `model` of main() (hooked.py:", err)
        self.assertIn("What to do first:\n  - `feats` keeps every output its hook sees", err)

    def test_a_dataloader_worker_that_initialised_cuda(self):
        # PyTorch's own allocator in the job: the check is NVML's view of the processes, and the
        # worker must be able to start CUDA after the fork.
        r = run_worker("holders_dataloader", "native")
        print("\n" + r["processes"])
        self.assertTrue(r["available"], r["processes"])
        if r["me"] not in r["pids"]:
            self.skipTest("NVML names processes by pids of another pid namespace (a container "
                          "without the host's pids): " + r["processes"])
        rows = {row["pid"]: row for row in r["rows"]}
        self.assertEqual(rows[r["me"]]["relation"], "this process")
        self.assertIn(r["worker_pid"], rows, r["processes"])
        self.assertEqual(rows[r["worker_pid"]]["relation"],
                         "child of this process (forked: a DataLoader worker?)")
        self.assertGreaterEqual(rows[r["worker_pid"]]["bytes"], 64 * MiB)
        self.assertIn("child of this process", r["summary_tail"])


# --- the worker -------------------------------------------------------------------------------


def _ipc_child(tensor):
    tensor.add_(1)


def worker_ipc(torch, result):
    ctx = torch.multiprocessing.get_context("spawn")
    t = torch.ones(16, device="cuda")
    try:
        p = ctx.Process(target=_ipc_child, args=(t,))
        p.start()
        p.join(60)
        result.update(outcome="worked" if p.exitcode == 0 else "child failed",
                      error="exit code %s" % p.exitcode)
    except Exception as e:  # noqa: BLE001 (what the user would see)
        result.update(outcome="refused", error="%s: %s" % (type(e).__name__, e))


def holders_result(found, result):
    """What the holder tests judge: the findings' holders, the report's section and advice."""
    text = str(found)
    result["section"] = "Who holds it" + text.split("Who holds it", 1)[-1].split("What to do:")[0]
    result["first_advice"] = text.split("What to do:\n  - ", 1)[-1].splitlines()[0]
    result["findings"] = [{"site": f["site"], "holders": f.get("holders", [])} for f in found]
    result["visited"] = found.holders.visited if found.holders else 0
    result["ms"] = found.holders.ms if found.holders else 0.0


def small_model(torch):
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 256)).cuda()


def worker_holders_hook(torch, result):
    # The case: a forward hook appends each activation to a list.
    import gmem

    gmem.enable_tracking()
    model = small_model(torch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watching = gmem.torch.watch(optimizer)
    feats = []
    model[1].register_forward_hook(lambda m, i, o: feats.append(o))
    result["hook_line"] = sys._getframe().f_lineno - 1
    x = torch.randn(512, 256, device="cuda")
    for _ in range(8):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    holders_result(gmem.leaks(), result)
    watching.remove()


def worker_holders_losses(torch, result):
    # Validation losses kept with their graph (never run backward): the activations they saved.
    import gmem

    gmem.enable_tracking()
    model = small_model(torch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watching = gmem.torch.watch(optimizer)
    x = torch.randn(512, 256, device="cuda")
    val = torch.randn(512, 256, device="cuda")
    losses = []
    for _ in range(8):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(model(val).square().mean())

    def saved_blocks():  # blocks flagged as saved for a backward pass that has not used them
        return sum(1 for seg in gmem.snapshot()["segments"] for b in seg["blocks"]
                   if b.get("saved_for_backward"))

    result["saved_before"] = saved_blocks()
    holders_result(gmem.leaks(), result)
    result["saved_after"] = saved_blocks()
    watching.remove()


def worker_holders_cache(torch, result):
    # A cache attribute on a module, growing a step at a time.
    import gmem

    gmem.enable_tracking()
    model = small_model(torch)
    model[2].cache = []
    x = torch.randn(512, 256, device="cuda")
    for _ in range(8):
        with torch.no_grad():
            model[2].cache.append(model(x))
        gmem.step()
    holders_result(gmem.leaks(), result)


class HoldingDataset:
    # A dataset whose worker puts memory on the GPU (the guides' ghost memory of DataLoader
    # workers): each item allocates 64 MiB there, kept in the worker.
    held = []

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import torch
        HoldingDataset.held.append(torch.empty(64 * MiB, dtype=torch.uint8, device="cuda"))
        return torch.zeros(4)


def worker_holders_dataloader(torch, result):
    import os
    import time

    import gmem

    loader = torch.utils.data.DataLoader(HoldingDataset(), batch_size=1, num_workers=1,
                                         multiprocessing_context="fork", persistent_workers=True)
    it = iter(loader)
    next(it)                                   # the worker forked and touched CUDA
    worker_pid = it._workers[0].pid
    held = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")   # this process too
    torch.cuda.synchronize()
    time.sleep(1.0)
    found = gmem.processes()
    result.update(available=found.available, processes=str(found), rows=found.rows,
                  pids=[r["pid"] for r in found.rows], me=os.getpid(), worker_pid=worker_pid)
    result["summary_tail"] = gmem.memory_summary().split("Processes on device", 1)[-1]
    del held
    del it


def worker(mode, allocator):
    import warnings

    result = {"mode": mode, "allocator": allocator}
    if allocator == "gmem":
        import gmem.torch

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gmem.torch.enable()
        result.update(entry_points=gmem.torch.entry_points(), mode=gmem.torch.mode(),
                      warnings=[str(w.message) for w in caught])
    import torch

    probe = None
    if mode == "oom" and allocator == "gmem" and result["mode"] == "full":
        probe = cpp_probe(torch)
        probe.watch_ooms()
    workers = {"train": worker_train, "storages": worker_storages, "oom": worker_oom,
               "stats": worker_stats, "host_alloc": worker_host_alloc,
               "compile": worker_compile, "graph": worker_graph,
               "history": worker_history, "cudnn": worker_cudnn, "ipc": worker_ipc,
               "sites": worker_sites, "graphs_compile": worker_graphs_compile,
               "graph_reuse": worker_graph_reuse, "graph_record_stream": worker_graph_record_stream,
               "pool_peaks": worker_pool_peaks, "graph_dropped": worker_graph_dropped,
               "fit": worker_fit, "holders_hook": worker_holders_hook,
               "holders_losses": worker_holders_losses, "holders_cache": worker_holders_cache,
               "holders_dataloader": worker_holders_dataloader}
    workers[mode](torch, result)
    if probe is not None:
        result["observer_calls"] = probe.oom_calls()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        # support (imported above for the tests) points gmem at the simulated device; a worker
        # runs real kernels, so it needs the GPU.
        os.environ.pop("GMEM_DEVICE", None)
        worker(sys.argv[1], sys.argv[2])
    else:
        unittest.main()
