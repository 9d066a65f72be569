"""Would mapping gmem's plan region on a helper thread hide its cost? A measurement of the CUDA
driver and PyTorch alone (native allocator, no gmem): Llama training steps of one length
(train_bench's model), each run in one of three ways: alone; while a C thread (no GIL) maps and
sets access on PAGES pages of 2 MiB (the plan region's first mapping in a Llama run is ~3,380),
started as the step begins; or after the same calls made inline (what gmem pays today). Steps
take turns among the three after a warm-up; the pages are unmapped between steps, outside the
timing. Prints each way's median step, and the helper's time a page during a step and alone.

  python3 bench/torch/overlap_maps.py [PAGES] [STEPS]     (on a GPU machine; builds its helper)
"""
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

HELPER = r"""
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static CUcontext ctx; static CUdeviceptr va; static CUmemGenericAllocationHandle* h;
static int pages; static size_t page = 2u << 20; static CUmemAccessDesc acc;
static pthread_t thread; static double took; static int failed;
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define CK(x) do { if ((x) != CUDA_SUCCESS) { failed = __LINE__; return; } } while (0)
static void map_all() {
  for (int i = 0; i < pages; ++i) {
    CK(cuMemMap(va + (CUdeviceptr)i * page, page, 0, h[i], 0));
    CK(cuMemSetAccess(va + (CUdeviceptr)i * page, page, &acc, 1));
  }
}
int setup(int n) {
  CUdevice dev; pages = n;
  if (cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) return 1;
  if (cuCtxGetDevice(&dev) != CUDA_SUCCESS) return 2;
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = dev;
  h = (CUmemGenericAllocationHandle*)calloc(n, sizeof *h);
  for (int i = 0; i < n; ++i) if (cuMemCreate(&h[i], page, &prop, 0) != CUDA_SUCCESS) return 3;
  if (cuMemAddressReserve(&va, (size_t)n * page, 0, 0, 0) != CUDA_SUCCESS) return 4;
  acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return 0;
}
static void* run(void* unused) {
  (void)unused;
  if (cuCtxSetCurrent(ctx) != CUDA_SUCCESS) { failed = -1; return 0; }
  double t0 = now(); map_all(); took = now() - t0; return 0;
}
double map_inline(void) { double t0 = now(); map_all(); return failed ? -failed : now() - t0; }
int start(void) { return pthread_create(&thread, 0, run, 0); }
double join(void) { pthread_join(thread, 0); return failed ? -failed : took; }
double unmap_all(void) {
  double t0 = now();
  for (int i = 0; i < pages; ++i) if (cuMemUnmap(va + (CUdeviceptr)i * page, page) != CUDA_SUCCESS) return -1;
  return now() - t0;
}
"""


def build_helper():
    out = os.path.join(tempfile.mkdtemp(), "overlap_helper.so")
    src = out.replace(".so", ".c")
    with open(src, "w") as f:
        f.write(HELPER)
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    subprocess.check_call(["gcc", "-O2", "-shared", "-fPIC", "-o", out, src, "-I" + cuda + "/include",
                           "-lcuda", "-lpthread"])
    lib = ctypes.CDLL(out)
    lib.join.restype = ctypes.c_double
    lib.unmap_all.restype = ctypes.c_double
    lib.map_inline.restype = ctypes.c_double
    return lib


def main():
    pages = int(sys.argv[1]) if len(sys.argv) > 1 else 3380
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    import torch

    sys.path.insert(0, HERE)
    import models

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    lib = build_helper()
    if lib.setup(pages) != 0:
        raise SystemExit("helper setup failed")
    length = 1024
    step = models.llama_step(torch, 8 + steps, lengths=[length] * (8 + steps))
    for i in range(8):
        step(i)
    torch.cuda.synchronize()
    # The helper alone, with the GPU idle: its time a page.
    lib.start()
    alone = lib.join()
    lib.unmap_all()
    modes = ("alone", "helper", "inline")
    times = {m: [] for m in modes}
    helper_during = []
    for i in range(steps):
        mode = modes[i % 3]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if mode == "helper":
            lib.start()
        elif mode == "inline":
            if lib.map_inline() < 0:
                raise SystemExit("inline maps failed")
        step(8 + i)
        torch.cuda.synchronize()
        times[mode].append(time.perf_counter() - t0)
        if mode == "helper":
            helper_during.append(lib.join())
            if helper_during[-1] < 0:
                raise SystemExit("helper failed at line %d" % -helper_during[-1])
        if mode != "alone":
            lib.unmap_all()
    med = {m: statistics.median(times[m]) * 1e3 for m in modes}
    print("pages %d, Llama seq %d, %d steps each: step %.1f ms alone, %.1f ms with the helper mapping "
          "(+%.1f ms), %.1f ms mapping inline first (+%.1f ms); helper %.1f us a page alone, "
          "%.1f us a page during a step (%.1f ms)"
          % (pages, length, len(times["alone"]), med["alone"], med["helper"], med["helper"] - med["alone"],
             med["inline"], med["inline"] - med["alone"], alone / pages * 1e6,
             statistics.median(helper_during) / pages * 1e6, statistics.median(helper_during) * 1e3))
    for m in modes:
        print("steps %s (ms):" % m, " ".join("%.1f" % (t * 1e3) for t in times[m]))

if __name__ == "__main__":
    main()
