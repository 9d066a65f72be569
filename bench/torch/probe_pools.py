"""Where a CUDA-graph training loop's memory sits: the device's total (torch.cuda) and, under gmem,
its device engine alone (the rest is the private pools), after each step.
   python3 bench/torch/probe_pools.py {native|gmem} [MODEL] [STEPS]   (MODEL: a models.*_step)"""
import ctypes
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    allocator = sys.argv[1]
    name = sys.argv[2] if len(sys.argv) > 2 else "gpt2_cudagraphs"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    engine_stats = None
    if allocator == "gmem":
        import gmem.torch
        from gmem import _lib

        gmem.torch.enable()
        lib = _lib.lib()
        handle = ctypes.c_void_p()

        def engine_stats():
            if not handle.value:
                assert lib.gmem_device_engine(0, ctypes.byref(handle)) == 0
            raw = (ctypes.c_int64 * 118)()
            assert lib.gmem_engine_stats(handle, 0, raw) == 0
            return raw[48], raw[60]  # allocated_bytes.all.current, reserved_bytes.all.current
    import torch

    sys.path.insert(0, HERE)
    import models

    step = getattr(models, name + "_step")(torch, steps)
    gib = float(1 << 30)
    for i in range(steps):
        step(i)
        torch.cuda.synchronize()
        line = "step %2d  allocated %6.3f  reserved %6.3f  peak allocated %6.3f  peak reserved %6.3f" % (
            i, torch.cuda.memory_allocated() / gib, torch.cuda.memory_reserved() / gib,
            torch.cuda.max_memory_allocated() / gib, torch.cuda.max_memory_reserved() / gib)
        if engine_stats is not None:
            allocated, reserved = engine_stats()
            line += "  | device engine allocated %6.3f reserved %6.3f" % (allocated / gib, reserved / gib)
        print(line, flush=True)


if __name__ == "__main__":
    main()
