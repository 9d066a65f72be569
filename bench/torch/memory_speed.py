"""Is memory from gmem as fast for kernels and copies as memory from cudaMalloc? Times, in one
process under ALLOC (gmem, the default, native, or expandable), operations whose speed depends on
the memory rather than on what they compute
(docs/notes/2026-11-29-copies-run-slower-on-2-mib-chunks.md):

- copy: `dst.copy_(src)` of a SIZE_GIB buffer, which PyTorch makes as cudaMemcpyAsync through
  the allocator's memcpyAsync (the driver's copy, not a kernel);
- copy_shifted: the same copy, its source read 1 MiB further on (source and target bytes at
  different offsets within their 2 MiB pages);
- fill, sum: writing that buffer, reading it (bandwidth, one way);
- scale: multiplying it in place (each byte read, then written where it was);
- gather: 64M float32 reads at random indices of that buffer (each read a different page, so
  the GPU's TLB reach and page walks decide its speed);
- decode: a batch-1 pass through 32 bf16 weight matrices of 4096 x 11008 (86 MiB each,
  allocated one by one as a model's are): a language model's decode step reads every weight
  once, so its speed is the memory's bandwidth.

Each kernel REPS times after a warm-up; the median in ms, one JSON line (common.emit). Run
several processes of each allocator, alternated: a process's physical memory is what it got.

    ALLOC=gmem SIZE_GIB=8 python3 bench/torch/memory_speed.py [--out FILE]
"""
import argparse
import os
import statistics
import sys

from profile_steps import enable_allocator

allocator = os.environ.get("ALLOC", "gmem")
if allocator == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
enable_allocator("gmem" if allocator == "gmem" else "native")
import torch  # noqa: E402 (gmem.torch must be enabled first)

from common import emit  # noqa: E402


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    gib = float(os.environ.get("SIZE_GIB", "8"))
    reps = int(os.environ.get("REPS", "20"))
    n = int(gib * (1 << 30)) // 4
    generator = torch.Generator(device="cuda").manual_seed(0)
    src = torch.rand(n, device="cuda", generator=generator)
    dst = torch.empty_like(src)
    index = torch.randint(0, n, (64 << 20,), device="cuda", generator=generator)
    out = torch.empty(64 << 20, device="cuda")
    shift = (1 << 20) // 4
    weights = [torch.randn(11008, 4096, device="cuda", dtype=torch.bfloat16, generator=generator)
                for _ in range(32)]
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=generator)

    def decode():
        for w in weights:
            torch.nn.functional.linear(x, w)

    record = {
        "kind": "memory_speed", "allocator": allocator, "gib": gib, "reps": reps,
        "page_size": os.environ.get("GMEM_PAGE_SIZE") or "2M" if allocator == "gmem" else None,
        "copy_ms": timed(lambda: dst.copy_(src), reps),
        "copy_shifted_ms": timed(lambda: dst[: n - shift].copy_(src[shift:]), reps),
        "fill_ms": timed(lambda: dst.fill_(1.0), reps),
        "sum_ms": timed(lambda: src.sum(), reps),
        "scale_ms": timed(lambda: dst.mul_(1.0), reps),
        "gather_ms": timed(lambda: torch.index_select(src, 0, index, out=out), reps),
        "decode_ms": timed(decode, reps),
        "torch": torch.__version__, "device": torch.cuda.get_device_name(),
    }
    emit(record, args.out)


if __name__ == "__main__":
    sys.exit(main())
