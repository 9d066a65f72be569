"""Workers of test_torch_gpu.py (see torch_workers.py): CUDA graphs and private pools,
torch.compile, autograd-graph tracking, and gmem.fit_batch_size.
"""

from torch_workers import MiB, deterministic


def worker_graphs_compile(torch, result):
    # A compiled model trained with graph tracking on: same losses as without, no findings; then
    # compiled inference without no_grad keeping its outputs: a graph kept alive.
    import gmem

    gmem.enable_tracking()

    def train(graphs):
        deterministic(torch)
        model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                    torch.nn.Linear(2048, 512)).cuda()
        compiled = torch.compile(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        watching = gmem.torch.watch(optimizer, graphs=graphs)
        x = torch.randn(256, 512, device="cuda")
        losses = []
        for _ in range(8):
            loss = compiled(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return model, compiled, watching, losses

    _, _, watching, result["losses_without"] = train(False)
    watching.remove()
    model, compiled, watching, result["losses_with"] = train(True)
    result["findings"] = gmem.leaks().as_dicts()
    outputs = []
    for _ in range(10):
        outputs.append(compiled(torch.randn(256, 512, device="cuda")))
        gmem.step()
    found = gmem.leaks()
    result["cause"] = found.cause
    result["findings_after"] = found.as_dicts()
    # A cache of detached outputs, kept on purpose: it grows, but holds no graph.
    del outputs[:]
    cache = []
    for _ in range(12):
        cache.append(model(torch.randn(256, 512, device="cuda")).detach())
        gmem.step()
    found = gmem.leaks()
    result["cache_cause"] = found.cause
    result["cache_graph_bytes"] = [f["graph_bytes"] for f in found]
    watching.remove()



def worker_graph_dropped(torch, result):
    # A forward of ReLU layers (each saves its own output) whose output is dropped unused.
    import gc
    import gmem

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                                      torch.nn.ReLU()) for _ in range(4)]).cuda()
    x = torch.randn(256, 1024, device="cuda")

    def left_after_forward():
        gc.collect()
        base = torch.cuda.memory_allocated()
        y = model(x)
        del y
        gc.collect()
        return torch.cuda.memory_allocated() - base

    left_after_forward()  # the first forward creates cuBLAS's workspace, which stays
    result["left_plain"] = left_after_forward()
    gmem.enable_tracking()
    tracking = gmem.torch.track_graphs()
    result["left_tracked"] = left_after_forward()
    model(x).sum().backward()
    tracked = model[0][0].weight.grad.clone()
    tracking.remove()
    model.zero_grad()
    model(x).sum().backward()
    result["grads_equal"] = bool(torch.equal(tracked, model[0][0].weight.grad))


def worker_fit(torch, result):
    # A small MLP trained with AdamW under a 2 GiB cap: fit, then the pick and one more.
    import gc
    import gmem

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 10)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())

    def step(batch_size):
        x = torch.randn(batch_size, 64, 4096, device="cuda")  # 64 tokens a sample
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(1)  # cuBLAS's workspaces (forward and backward threads) and the optimizer's state
    result["allocated_before"] = torch.cuda.memory_allocated()
    cap = 2 << 30
    fit = gmem.fit_batch_size(step, limit=cap, restore=(model, optimizer))
    result["allocated_after"] = torch.cuda.memory_allocated()
    result["steps"] = len(fit.steps)
    print(fit, flush=True)

    def runs(b):
        try:
            step(b)
            return True
        except torch.OutOfMemoryError as e:
            e.__traceback__ = None
            del e
            gc.collect()
            return False

    gmem.set_memory_limit(cap)
    result["pick_runs"] = runs(fit.batch_size)
    result["next_runs"] = runs(fit.batch_size + 1)
    result["two_above_runs"] = runs(fit.batch_size + 2)
    result["fit_text"] = str(fit)
    gmem.set_memory_limit(0)
    table = gmem.what_fits(step, model=model, limit=cap, restore=(model, optimizer))
    print(table, flush=True)
    result["what_fits_first"] = table.recommendation.setting


class SmallNet:
    @staticmethod
    def make(torch):
        nn = torch.nn
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.LayerNorm(64),
                             nn.Linear(64, 16)).cuda()


def worker_compile(torch, result):
    torch.backends.cuda.matmul.allow_tf32 = False
    import torch._inductor.config as inductor_config
    inductor_config.max_autotune_gemm_backends = "TRITON"
    model = SmallNet.make(torch)
    data = torch.Generator().manual_seed(2)
    inputs = [torch.randn(32, 64, generator=data).cuda() for _ in range(5)]
    with torch.no_grad():
        eager = [model(x) for x in inputs]
        outputs, close = {}, {}
        for mode in ("default", "reduce-overhead", "max-autotune"):
            torch._dynamo.reset()
            compiled = torch.compile(model, mode=mode)
            outs = [compiled(x).clone() for x in inputs]  # several calls: record, then replay
            torch.cuda.synchronize()
            outputs[mode] = [o.flatten()[:64].tolist() for o in outs]
            close[mode] = all(torch.allclose(o, e, rtol=1e-3, atol=1e-4) for o, e in zip(outs, eager))
    # reduce-overhead with autograd: forward and backward graphs recorded into one tree, the
    # loss computed inside the compiled function (its output is all that leaves the graph).
    torch._dynamo.reset()
    net = SmallNet.make(torch)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    step = torch.compile(lambda x: net(x).square().mean(), mode="reduce-overhead")
    losses = []
    for x in inputs + inputs:
        torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        loss = step(x)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    # Shapes taking turns under reduce-overhead, as a server of a few padded shapes runs: each
    # shape's graph is recorded after another's, which puts the pool back to that graph's
    # checkpoint (setCheckpointPoolState: blocks freed since allocated again at their addresses).
    # Under gmem this crashed the process until 2026-11-25. cudagraph trees' own slow-path
    # asserts check the pool's live blocks against the live outputs after each.
    torch._dynamo.reset()
    inductor_config.triton.slow_path_cudagraph_asserts = True
    shaped = torch.compile(lambda x: model(x).float().sum(), mode="reduce-overhead")
    turns = []
    with torch.no_grad():
        for rows in (8, 8, 8, 1, 1, 1, 8, 1, 4, 4, 4, 8, 1, 4):
            torch.compiler.cudagraph_mark_step_begin()
            x = torch.randn(rows, 64, generator=data).cuda()
            turns.append([shaped(x).item(), model(x).float().sum().item()])
    inductor_config.triton.slow_path_cudagraph_asserts = False
    result.update(outputs=outputs, close_to_eager=close, train_losses=losses, shape_turns=turns)


def worker_graph(torch, result):
    model = SmallNet.make(torch)
    static_x = torch.randn(32, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    reserved_before = torch.cuda.memory_reserved()
    pool = torch.cuda.MemPool()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, pool=pool.id):
        static_y = model(static_x)
    ok = True
    for i in range(5):
        x = torch.randn(32, 64, device="cuda")
        static_x.copy_(x)
        graph.replay()
        with torch.no_grad():
            ok = ok and torch.allclose(static_y, model(x), rtol=1e-4, atol=1e-5)
    result["replays_match_eager"] = bool(ok)
    result["pool_reserved"] = torch.cuda.memory_reserved() - reserved_before

    # use_mem_pool: allocations go to the pool; its snapshot lists them.
    pool2 = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool2):
        in_pool = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    snap = pool2.snapshot()
    result["pool_block_in_snapshot"] = any(
        seg["address"] == in_pool.data_ptr() for seg in snap)
    result["use_count"] = pool2.use_count()
    # Freed inside the pool, never handed out outside it.
    address = in_pool.data_ptr()
    del in_pool
    outside = [torch.empty(16 * MiB, dtype=torch.uint8, device="cuda") for _ in range(4)]
    result["pool_not_reused_outside"] = all(
        not (address <= t.data_ptr() < address + 16 * MiB) for t in outside)
    del outside
    result["reserved_with_pool"] = torch.cuda.memory_reserved()
    del pool2
    import gc
    gc.collect()
    result["reserved_after_pool_deleted"] = torch.cuda.memory_reserved()
    del graph, static_y, pool


def worker_pool_peaks(torch, result):
    """Peak allocated over a private pool and the device's own memory, as deltas from the start."""
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    pool = torch.cuda.MemPool()
    peaks, currents = [], []

    def record():
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        currents.append(torch.cuda.memory_allocated() - base)

    with torch.cuda.use_mem_pool(pool):
        a = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del a
    b = torch.empty(48 * MiB, dtype=torch.uint8, device="cuda")
    record()  # 64: the pool's block and b were never live at once
    with torch.cuda.use_mem_pool(pool):
        c = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    record()  # 80: b and c
    del b, c
    torch.cuda.reset_peak_memory_stats()
    record()  # 0: the pool's reset with the device
    result.update(peaks=peaks, currents=currents)
    del pool


def capture_after_warm_up(torch, result, body, inside=None):
    """Runs `body` once on a side stream (a warm-up, outside the graph's pool), then captures
    it into a new graph, calling `inside` first within the capture: (graph, what the capture's
    `body` returned), or None with the capture's error in `result`."""
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        body()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            if inside is not None:
                inside()
            outputs = body()
        result["captured"] = True
    except Exception as e:  # noqa: BLE001 (the test reports it)
        result.update(captured=False, replays_correct=False, wrong=[],
                      error="%s: %s" % (type(e).__name__, e))
        return None
    return graph, outputs


def wrong_after_replays(torch, graph, scale, sums, expected_at, check=None):
    """Replays `graph` with `scale` set to 2, 0.5 and 3: what differs, each sum of `sums`
    against `expected_at(k)` (to rounding), and what `check(k)` finds."""
    wrong = []
    for k in (2.0, 0.5, 3.0):
        scale.fill_(k)
        graph.replay()
        torch.cuda.synchronize()
        wrong += ["scale %g: sum %d is %g, not %g" % (k, i, s.item(), e)
                  for i, (s, e) in enumerate(zip(sums, expected_at(k)))
                  if abs(s.item() - e) > 1e-5 * e]
        if check is not None:
            wrong += check(k)
    return wrong


def worker_graph_reuse(torch, result):
    """A graph captured into a private pool that reuses freed memory at other sizes, as a
    model's forward and backward do: four passes of four blocks of 3..10 MiB (each made as
    `full * scale`, so a temporary of the same size comes and goes), the pass's blocks freed at
    its end, the last pass's kept as outputs. Replayed with three scales, every output checked."""
    n = MiB // 4  # float32 elements in 1 MiB
    passes = [(4, 6, 4, 10), (6, 4, 10, 4), (10, 4, 6, 4), (3, 9, 5, 7)]
    scale = torch.ones(1, device="cuda")

    def body():
        sums = []
        for sizes in passes:
            kept = [torch.full((m * n,), float(m), device="cuda") * scale for m in sizes]
            sums += [x.sum() for x in kept]
        return sums, kept

    captured = capture_after_warm_up(torch, result, body)
    if captured is None:
        return
    graph, (sums, kept) = captured
    wrong = wrong_after_replays(
        torch, graph, scale, sums, lambda k: [k * m * m * n for sizes in passes for m in sizes],
        lambda k: ["scale %g: output of %d MiB is not %g throughout" % (k, m, k * m)
                   for m, x in zip(passes[-1], kept) if not bool((x == k * m).all())])
    result.update(replays_correct=not wrong, wrong=wrong[:8])
    del graph, sums, kept, captured


def worker_graph_record_stream(torch, result):
    """record_stream inside a capture, as a model that overlaps work on a second stream does:
    each pass makes a block on the capturing stream, uses it on a side stream forked into the
    capture (record_stream), frees it, and makes more blocks that must not take its memory
    while the side stream may still read it. A block made before the capture and used on a side
    stream is freed inside it too. Replayed with three scales, every output checked."""
    n = MiB // 4  # float32 elements in 1 MiB
    sizes = (3, 5, 4, 6)
    scale = torch.ones(1, device="cuda")
    side = torch.cuda.Stream()
    early_user = torch.cuda.Stream()
    early = [torch.full((4 * n,), 1.0, device="cuda")]  # freed inside the capture (clear)
    early_user.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(early_user):
        early_sum = early[0].sum()
    early[0].record_stream(early_user)

    def body():
        outs = []
        for m in sizes:
            a = torch.full((m * n,), float(m), device="cuda") * scale
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                outs.append((a * 2).sum())
            a.record_stream(side)
            del a
            outs.append((torch.full((m * n,), 1.0, device="cuda") * scale).sum())
        torch.cuda.current_stream().wait_stream(side)
        return outs

    # The early block's side stream use is not part of the capture.
    captured = capture_after_warm_up(torch, result, body, inside=early.clear)
    if captured is None:
        return
    graph, outs = captured
    wrong = wrong_after_replays(
        torch, graph, scale, outs,
        lambda k: [e for m in sizes for e in (2 * k * m * m * n, k * m * n)])
    result.update(replays_correct=not wrong, wrong=wrong[:8],
                  early_sum_right=early_sum.item() == 4 * n)
    # After the capture the engines' deferred frees go through: memory comes back.
    del graph, outs, captured
    torch.cuda.synchronize()
    x = torch.empty(64 * n, device="cuda")
    del x
    result["allocates_after"] = True
