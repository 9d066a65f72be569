"""The cost of a holder search (gmem.holders, docs/holders.md) on a realistic Python heap, without
torch, on the simulated device: a process with about N Python objects gc tracks (a tokenised
dataset of dicts and lists, a vocabulary, model-like objects with OrderedDicts of attributes),
a training loop whose forward hook keeps every activation in a closure's list and whose losses
are kept in a global list. Prints the heap size, the objects visited and the milliseconds of
gmem.leaks() with and without the search, and of gmem.holders() alone, best of 5.

    GMEM_DEVICE=sim PYTHONPATH=python python3 bench/holders_bench.py [--objects 1000000]
"""

import argparse
import collections
import gc
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
os.environ.setdefault("GMEM_DEVICE", "sim")

import gmem  # noqa: E402


class Array:
    """A device array over gmem memory (__cuda_array_interface__), like CuPy's."""

    def __init__(self, ptr, size):
        self.ptr, self.size = ptr, size

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.size // 4,), "typestr": "<f4", "data": (self.ptr, False),
                "version": 3}


class Module:
    """nn.Module's layout: OrderedDicts of parameters, buffers, hooks and children."""

    def __init__(self, name, children=()):
        self.name = name
        self.training = True
        self._parameters = collections.OrderedDict()
        self._buffers = collections.OrderedDict()
        self._forward_hooks = collections.OrderedDict()
        self._forward_pre_hooks = collections.OrderedDict()
        self._modules = collections.OrderedDict((str(i), c) for i, c in enumerate(children))

    def __call__(self, x):
        for child in self._modules.values():
            x = child(x)
        out = Array(gmem.malloc(256 << 10), 256 << 10)
        for hook in self._forward_hooks.values():
            hook(self, x, out)
        gmem.free(x.ptr) if x is not None and not getattr(x, "kept", False) else None
        return out


def build_heap(objects):
    """About `objects` gc-tracked objects, shaped like a data pipeline and a model's host side."""
    vocab = {"tok%d" % i: i for i in range(50000)}
    dataset = []
    per_sample = 3  # a dict, its token list, its label list (the metadata dict holds atoms: untracked)
    for i in range(max(0, objects - 15000) // per_sample):
        dataset.append({"ids": [i % 50000, (i * 7) % 50000, 3, 4, 5],
                        "labels": [0, 1], "meta": {"source": "shard%d" % (i % 64), "index": i}})
    blocks = [Module("block%d" % i, [Module("attn"), Module("mlp")]) for i in range(48)]
    model = Module("model", blocks)
    return vocab, dataset, model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=1000000)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    heap = build_heap(args.objects)
    model = heap[2]
    gmem.enable_tracking()
    feats = []
    model._modules["3"]._forward_hooks[0] = lambda m, i, o: (setattr(o, "kept", True),
                                                             feats.append(o))
    global losses
    losses = []
    for _ in range(args.steps):
        gmem.set_frames([("train.py", 173, "train")])
        out = model(None)
        gmem.set_frames([("train.py", 180, "train")])
        losses.append(Array(gmem.malloc(512), 512))
        gmem.free(out.ptr)
        gmem.step()
    gc.collect()
    tracked = len(gc.get_objects())

    def best(fn, n=5):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            result = fn()
            times.append((time.perf_counter() - start) * 1000)
        return min(times), result

    plain_ms, _ = best(lambda: gmem.leaks(holders=False))
    leaks_ms, found = best(lambda: gmem.leaks())
    holders_ms, h = best(lambda: gmem.holders())
    print("python %s, %d objects tracked by gc, %d live blocks" % (
        sys.version.split()[0], tracked, len(gmem._holders._live_blocks(-1)["blocks"])))
    print("gmem.leaks(holders=False): %.1f ms" % plain_ms)
    print("gmem.leaks() with the holder search: %.1f ms" % leaks_ms)
    print("gmem.holders(): %.1f ms inside the search (%d objects visited, %d heap passes of %d), "
          "%.1f ms for the call" % (h.ms, h.visited, round(h.visited / max(1, h.heap)), h.heap,
                                    holders_ms))
    print(h)


if __name__ == "__main__":
    main()
