"""Workers of test_torch_gpu.py: run in the child process a test starts
(`python test_torch_gpu.py MODE ALLOCATOR`, which dispatches to them), each fills `result` for
the test to judge. Training, storages, out of memory, statistics read from C++, host
allocations, memory history, cuDNN and call sites; CUDA graphs, torch.compile, graph tracking
and fit are in torch_graph_workers.py. Imported by test_torch_gpu.py, which puts this folder
on the path first.
"""

import os

from support import round_up

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


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
    del third
    if result.get("mode") == "full":  # the pluggable allocator cannot answer it
        result["memory_fraction"] = torch.cuda.get_per_process_memory_fraction()
    result["num_ooms"] = torch.cuda.memory_stats().get("num_ooms", 0)


def cpp_probe(torch):
    """A tiny C++ extension (ctypes, no pybind) that asks c10's current CUDA allocator."""
    import ctypes
    import subprocess
    import tempfile

    from gmem import _shim

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    source = (
        "#include <c10/cuda/CUDACachingAllocator.h>\n"
        "#include <atomic>\n"
        "#include <cstring>\n"
        "namespace cca = c10::cuda::CUDACachingAllocator;\n"
        "static std::atomic<int> ooms{0};\n"
        "extern \"C\" long long allocated(int d) {\n"
        "  return cca::getDeviceStats(d).allocated_bytes[0].current; }\n"
        "extern \"C\" int name(char* out, int n) {\n"
        "  std::string s = cca::name(); std::strncpy(out, s.c_str(), n); return 0; }\n"
        "extern \"C\" void watch_ooms() {\n"
        "  cca::attachOutOfMemoryObserver([](int64_t, size_t, size_t, size_t) { ++ooms; }); }\n"
        "extern \"C\" int oom_calls() { return ooms.load(); }\n")
    tmp = tempfile.mkdtemp()
    with open(os.path.join(tmp, "probe.cpp"), "w") as f:
        f.write(source)
    lib = os.path.join(tmp, "libprobe.so")
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    subprocess.check_call(["c++", "-std=c++17", "-shared", "-fPIC",
                           "-D_GLIBCXX_USE_CXX11_ABI=%d" % abi,
                           "-isystem", os.path.join(torch_dir, "include"), "-isystem",
                           _shim.cuda_include_dir(), os.path.join(tmp, "probe.cpp"), "-o", lib,
                           "-L" + os.path.join(torch_dir, "lib"), "-lc10_cuda", "-lc10",
                           "-Wl,-rpath," + os.path.join(torch_dir, "lib")])
    probe = ctypes.CDLL(lib)
    probe.allocated.restype = ctypes.c_longlong
    return probe


def worker_stats(torch, result):
    """Statistics read from C++: the probe calls c10's getDeviceStats."""
    import ctypes

    torch.cuda.init()
    probe = cpp_probe(torch)
    name = ctypes.create_string_buffer(64)
    probe.name(name, 64)
    keep = [torch.empty(8 * MiB, dtype=torch.uint8, device="cuda") for _ in range(3)]
    result.update(cpp_allocated=probe.allocated(0), py_allocated=torch.cuda.memory_allocated(),
                  cpp_name=name.value.decode())
    del keep[0]
    result.update(cpp_allocated_after_free=probe.allocated(0),
                  py_allocated_after_free=torch.cuda.memory_allocated(),
                  num_ooms=torch.cuda.memory_stats()["num_ooms"])


def imports_operator_new(library):
    """Whether `library` calls a global operator new through the dynamic linker (one that a
    preloaded library replaces), read from its dynamic symbols with nm."""
    import subprocess

    symbols = subprocess.run(["nm", "-D", "--undefined-only", library], stdout=subprocess.PIPE,
                             universal_newlines=True, check=True).stdout
    return any(line.split()[-1].split("@")[0] in ("_Znwm", "_Znam") for line in symbols.splitlines()
               if line.strip())


def build_count_new(test):
    """Compiles count_new.cpp (a library that counts operator new, for LD_PRELOAD) into a
    temporary directory; returns its path."""
    import shutil
    import subprocess
    import tempfile

    if shutil.which("c++") is None:
        test.skipTest("no C++ compiler (c++) to build the operator new counter")
    tmp = tempfile.mkdtemp()
    test.addCleanup(shutil.rmtree, tmp, True)
    lib = os.path.join(tmp, "libcount_new.so")
    subprocess.check_call(["c++", "-std=c++17", "-O2", "-shared", "-fPIC",
                           os.path.join(HERE, "count_new.cpp"), "-o", lib])
    return lib


HOST_ALLOC_SIZES = (512, 4096, 70000, MiB, 3 * MiB, 40 * MiB)  # slabs and pages, as in the C test


def worker_host_alloc(torch, result):
    """operator new calls (count_new.cpp, preloaded) on this thread while gmem's CUDAAllocator
    serves torch.cuda.caching_allocator_alloc / caching_allocator_delete in steady state.

    Those two reach the allocator with nothing else of torch's between: the Python wrappers
    (torch/cuda/memory.py) call torch._C._cuda_cudaCachingAllocator_raw_alloc(size, stream) under
    `with torch.cuda.device(device)` and _raw_delete(ptr), whose C functions
    (torch/csrc/cuda/Module.cpp) parse the arguments with PyArg_ParseTuple / PyLong_AsVoidPtr and
    call c10::cuda::CUDACachingAllocator::raw_alloc_with_stream / raw_delete, i.e. gmem's
    GmemAllocator::raw_alloc_with_stream / raw_delete. To rule out the wrappers and the binding
    anyway, a baseline runs the identical loop at size 0 in the same process: the same Python,
    binding and c10 call into gmem's allocator, which returns nullptr for 0 bytes (and
    raw_delete(nullptr) returns) before the engine. The test judges each step's count minus its
    baseline's (both 0 on reading the sources).

    Steps are marked as gmem.torch does after an optimizer step (gmem.mark_step), counted
    separately and reported; so are all threads' calls and a plain torch.empty/del step, where
    torch itself makes TensorImpl and StorageImpl objects (not a claim of gmem's)."""
    import ctypes

    import gmem
    from gmem import _lib

    counter = ctypes.CDLL(None)  # the preloaded library is in the global scope
    if not hasattr(counter, "count_new_start"):
        raise RuntimeError("count_new.cpp is not preloaded (LD_PRELOAD=%r)"
                           % os.environ.get("LD_PRELOAD"))
    counter.count_new_stop.restype = ctypes.c_long
    counter.count_new_all_threads.restype = ctypes.c_long

    def counted(fn):
        """(calls on this thread, calls on all threads) to operator new during fn()."""
        counter.count_new_start()
        fn()
        mine = counter.count_new_stop()
        return mine, counter.count_new_all_threads()

    torch.cuda.init()
    torch.empty(1024, device="cuda")  # the first CUDA tensor: counted below is torch's own work
    result["control_torch_empty"] = counted(lambda: torch.empty(1024, device="cuda"))[0]
    result["control_gmem_stats_text"] = counted(
        lambda: _lib.text(_lib.lib().gmem_stats_text, 0))[0]
    result["libgmem"] = _lib.library_path()

    side = torch.cuda.Stream()
    streams = (torch.cuda.current_stream(0).cuda_stream, side.cuda_stream)
    alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete
    rounds = 4
    ptrs = [0] * (rounds * len(HOST_ALLOC_SIZES))
    seen = {"nonzero": True}

    def step(scale=1):  # scale 0: the baseline, every call for 0 bytes
        n = 0
        for i in range(rounds):
            stream = streams[i % 2]
            for size in HOST_ALLOC_SIZES:
                ptrs[n] = alloc(size * scale, 0, stream)
                n += 1
        if scale and not all(ptrs):
            seen["nonzero"] = False
        for p in ptrs:
            delete(p)

    def mark():
        gmem.mark_step(0)

    for _ in range(10):  # warm-up: the engine's structures for these sizes, steps planned
        step()
        mark()
    torch.cuda.synchronize()
    steps = 20
    before = gmem.memory_stat("allocation.all.allocated", 0)
    maps_before = gmem.memory_stat("gmem.num_maps", 0)
    steady, steady_all, baseline, marks = [], [], [], []
    for _ in range(steps):
        mine, everyone = counted(step)
        steady.append(mine)
        steady_all.append(everyone)
        marks.append(counted(mark)[0])
        baseline.append(counted(lambda: step(0))[0])
    result.update(engine_allocations=gmem.memory_stat("allocation.all.allocated", 0) - before,
                  expected_allocations=steps * len(ptrs), pointers_nonzero=seen["nonzero"],
                  maps_in_steady_steps=gmem.memory_stat("gmem.num_maps", 0) - maps_before,
                  steady=steady, steady_all=steady_all, baseline=baseline, marks=marks)

    def tensors():
        kept = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in HOST_ALLOC_SIZES]
        del kept

    for _ in range(3):
        tensors()
    result["tensors"] = [counted(tensors)[0] for _ in range(5)]
    torch.cuda.synchronize()


def make_history_tensors(torch):
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (MiB, 3 * MiB, 5000)]
    temp = torch.empty(2 * MiB, device="cuda")
    del temp
    return keep


def worker_history(torch, result):
    import tempfile

    from torch.cuda import _memory_viz

    torch.cuda.init()
    torch.cuda.memory._record_memory_history(max_entries=10000, stacks="python")
    result["history_enabled"] = torch._C._cuda_isHistoryEnabled() \
        if hasattr(torch._C, "_cuda_isHistoryEnabled") else True
    keep = make_history_tensors(torch)
    snap = torch.cuda.memory._snapshot()

    def names(frames):
        return [f.get("name") for f in frames or []]

    ptrs = {t.data_ptr() for t in keep}
    block_frames = [names(b.get("frames")) for seg in snap["segments"] for b in seg["blocks"]
                    if seg["address"] in ptrs]
    result["some_frames"] = block_frames[:1]
    result["block_frames_name_the_function"] = len(block_frames) == 3 and all(
        "make_history_tensors" in f for f in block_frames)
    trace = snap["device_traces"][0]
    result["alloc_events"] = sum(1 for e in trace if e["action"] == "alloc")
    result["free_events"] = sum(1 for e in trace if e["action"] == "free_completed")
    result["trace_frames_name_the_function"] = any(
        "make_history_tensors" in names(e.get("frames")) for e in trace if e["action"] == "alloc")
    result["trace_plot_bytes"] = len(_memory_viz.trace_plot(snap))
    result["segment_plot_bytes"] = len(_memory_viz.segment_plot(snap))
    path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
    torch.cuda.memory._dump_snapshot(path)
    result["dumped"] = os.path.getsize(path) > 0
    torch.cuda.memory._record_memory_history(enabled=None)


def worker_cudnn(torch, result):
    nn = torch.nn
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 5, padding=2),
                        nn.ReLU(), nn.Conv2d(64, 8, 1)).cuda()
    torch.backends.cudnn.allow_tf32 = False
    xs = [torch.randn(n, 3, 40, 40, device="cuda") for n in (4, 8, 4, 16)]
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    reference = [net(x) for x in xs]
    torch.backends.cudnn.deterministic = False
    torch.backends.cudnn.benchmark = True
    ok = True
    for x, ref in zip(xs, reference):
        out = net(x)
        out.sum().backward()
        ok = ok and torch.allclose(out, ref, rtol=1e-3, atol=1e-4)
    torch.cuda.synchronize()
    result.update(close_to_reference=bool(ok), convs=len(xs))


def hold_memory(torch):
    return torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")  # the site reports name


def worker_sites(torch, result):
    import time

    import gmem

    torch.cuda.init()

    def per_malloc(n=10000):
        start = time.perf_counter()
        for _ in range(n):
            torch.empty(1024, device="cuda")
        return (time.perf_counter() - start) / n * 1e9

    def deep(depth, fn):
        return fn() if depth == 0 else deep(depth - 1, fn)

    def untracked():
        gmem.disable_tracking(0)
        return per_malloc()

    def fixed():  # a thread's own frames: tracked, but no stack is taken
        gmem.enable_tracking(0)
        gmem.set_frames([("fixed.py", 1, "fixed")])
        try:
            return per_malloc()
        finally:
            gmem.set_frames(None)

    def sites():
        gmem.enable_tracking(0)
        return per_malloc()

    def sites_deep():
        gmem.enable_tracking(0)
        return deep(40, per_malloc)

    per_malloc(2000)
    conditions = {"ns_off": untracked, "ns_fixed": fixed, "ns_sites": sites,
                  "ns_deep": sites_deep}
    best = dict.fromkeys(conditions, float("inf"))
    for _ in range(5):  # interleaved, best of five: other load hits every condition alike
        for name, measure in conditions.items():
            best[name] = min(best[name], measure())
    result.update(best)
    gmem.enable_tracking(0)

    gmem.set_memory_limit(512 * MiB)
    held = hold_memory(torch)
    try:
        torch.empty(400 * MiB, dtype=torch.uint8, device="cuda")
        result["report"] = "no OOM"
    except torch.OutOfMemoryError as e:
        result["report"] = str(e)
    result["last_report"] = gmem.last_oom_report() or ""
    result["expected_site"] = "torch_workers.py:%d:hold_memory" % (
        hold_memory.__code__.co_firstlineno + 1)
    del held
