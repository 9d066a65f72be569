"""What graph tracking (gmem.torch.track_graphs, on by default in gmem.torch.watch) costs a training
step: GPT-2 124M (batch 8 x 1024, bf16 autocast, AdamW; the program of train_bench.py) under gmem
with tracking on, its steps timed with graph tracking off and on, in alternating rounds within one
process, so that both see the same GPU state. Also the saved tensors packed per step.

    python3 bench/torch/graph_tracking_bench.py [--rounds 4] [--steps 5] [--out FILE]

Prints one JSON line: median step ms without and with graph tracking, their ratio, and the
packs per step.
"""

import argparse
import statistics
import time

from common import emit, import_gmem


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and setting")
    parser.add_argument("--out")
    args = parser.parse_args()

    gmem = import_gmem()
    import gmem.torch

    gmem.torch.enable()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    gmem.enable_tracking()
    model = GPT2LMHeadModel(GPT2Config()).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")
    steps = gmem.torch.watch(optimizer, graphs=False)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(n):
        times = []
        for _ in range(n):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return times

    # Packs per step, counted with hooks of our own above gmem's (the innermost pair is used).
    graphs = gmem.torch.track_graphs()
    count = [0]

    def pack(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    packs = count[0]
    timed(3)  # warm-up, graph tracking on
    graphs.remove()
    off, on = [], []
    for _ in range(args.rounds):
        off += timed(args.steps)
        graphs = gmem.torch.track_graphs()
        on += timed(args.steps)
        graphs.remove()
    steps.remove()
    findings = gmem.leaks()
    off_ms, on_ms = statistics.median(off), statistics.median(on)
    emit({"bench": "graph_tracking", "model": "gpt2", "device": torch.cuda.get_device_name(),
          "step_ms_without": round(off_ms, 2), "step_ms_with": round(on_ms, 2),
          "ratio": round(on_ms / off_ms, 4), "cost_ms_per_step": round(on_ms - off_ms, 2),
          "packs_per_step": packs, "steps_each": len(off), "leak_findings": len(findings),
          "cause": findings.cause}, args.out)


if __name__ == "__main__":
    main()
