"""Runs a PyTorch program with gmem as its CUDA allocator, unchanged:

    python -m gmem.run train.py --epochs 3
    python -m gmem.run -m mypackage.train --epochs 3
    python -m gmem.run --report report.html train.py   # and where its memory went, as a page

gmem is enabled before the program starts, so it owns every CUDA allocation. GMEM=0 in the
environment runs the program with PyTorch's own allocator instead (for comparisons).
`python -m gmem.run --help` lists the options and every environment variable gmem reads.
"""

import os
import runpy
import sys

USAGE = "usage: python -m gmem.run [--report FILE.html] (SCRIPT | -m MODULE) [ARGS...]"

HELP = USAGE + """

Runs a PyTorch program with gmem as its CUDA allocator, unchanged: gmem is enabled before the
program starts (gmem.torch.enable()), so it owns every CUDA allocation. The program sees its
own arguments and sys.argv, as under `python SCRIPT ARGS...` or `python -m MODULE ARGS...`.

  SCRIPT ARGS...     a Python file and its arguments
  -m MODULE ARGS...  a module, as python -m runs it (e.g. -m torch.distributed.run ...)
  --report FILE      write gmem report's HTML page of the run to FILE (docs/report.md): at
                     exit, and at an out-of-memory error before it propagates, with the
                     program's last gmem.fit_batch_size table. Turns on gmem's tracking
                     (with GMEM=0: PyTorch's _record_memory_history)
  -h, --help         this text

When the program runs out of memory in a torch.distributed job, gmem says which rank died and
what the other ranks held. `python -m gmem.doctor` says which allocator route gmem will take.

Environment (all optional):
  GMEM=0                   run with PyTorch's own allocator instead of gmem (for comparisons)
  GMEM_DEVICE=cuda         the device behind gmem: cuda (default), segment (cudaMalloc'd
                           segments: the fallback for GPUs without virtual memory management),
                           sim (a simulated device: no GPU, not usable with PyTorch's kernels)
  GMEM_SIM_CAPACITY=BYTES  the simulated device's memory, with GMEM_DEVICE=sim
  GMEM_PAGE_SIZE=2M        gmem's page size, a power of two from 2M to 1G; 8M makes a quarter
                           of the driver calls for about 1% more reserved memory
  GMEM_EMPTY_CACHE=strict  every torch.cuda.empty_cache() gives back everything (default auto:
                           gmem keeps what recent steps used once the calls cost time)
  GMEM_MAP_AHEAD=0         do not map planned pages ahead on gmem's thread (default on a GPU: on)
  GMEM_STREAM_HANDOVERS=0  do not hand freed memory between streams without a host wait
  GMEM_PLAN_STEPS=0        do not mark a step after every optimizer step (planned step layouts)
  GMEM_OOM_REPORT=0        do not append gmem's report to out-of-memory errors
  GMEM_TORCH_ALLOCATOR=0   use PyTorch's CUDAPluggableAllocator route instead of gmem's full
                           allocator; =/path/lib.so: a prebuilt full allocator
  GMEM_TORCH_SHIM=0        on the pluggable route, skip the shim that raises
                           torch.OutOfMemoryError (=/path/lib.so: a prebuilt one)
  GMEM_LIBRARY=PATH        the libgmem.so to load (default: the one in the package, then the
                           repository's build/libgmem.so)
  GMEM_CACHE_DIR=DIR       where allocators compiled at first use are cached (default
                           $XDG_CACHE_HOME/gmem, else ~/.cache/gmem)
  GMEM_INCLUDE_DIR=DIR     where gmem/gmem.h is, for a compile at first use outside the package
  CUDA_HOME, CXX           CUDA's headers and the C++ compiler, for a compile at first use
  GMEM_NVML=PATH           the NVML library the OOM report's process list loads (default
                           libnvidia-ml.so.1); 0 leaves the list out
  GMEM_CLI=PATH            the gmem command-line tool that --report and gmem.report() run
                           (default: the one in the package, then the repository's build/gmem)
  GMEM_CHROMIUM=PATH       the headless Chromium that `gmem report --png` runs (default:
                           chromium, chromium-browser or google-chrome on PATH)
"""

TORCH_MISSING = ("gmem.run: PyTorch cannot be imported in this Python (%s: %s): install it "
                 "(pip install torch), or run the program with GMEM=0 to skip gmem")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        sys.stdout.write(HELP)
        return 0
    report_path = None
    if argv and (argv[0] == "--report" or argv[0].startswith("--report=")):
        if argv[0] == "--report":
            if len(argv) < 2:
                print("gmem.run: --report needs a file: --report report.html", file=sys.stderr)
                return 2
            report_path, argv = argv[1], argv[2:]
        else:
            report_path, argv = argv[0][len("--report="):], argv[1:]
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE + "   (python -m gmem.run --help: the options and environment)",
              file=sys.stderr)
        return 2
    if argv[0] != "-m" and not os.path.isfile(argv[0]):
        print("gmem.run: no such script: %s" % argv[0], file=sys.stderr)
        return 2

    if os.environ.get("GMEM", "1") != "0":
        # One line, not a traceback through gmem's modules: what is missing and what to do.
        try:
            import torch  # noqa: F401
        except ImportError as e:
            print(TORCH_MISSING % (sys.executable, e), file=sys.stderr)
            return 2
        from gmem import torch as gmem_torch
        from gmem.errors import GmemError

        try:
            gmem_torch.enable()
        except GmemError as e:
            print("gmem.run: %s" % e, file=sys.stderr)
            return 2
        _attach_oom_observer()
    if report_path is not None:
        _start_recording()

    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            # As `python script.py` would: the script's folder comes first on the path.
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except BaseException as e:
        if _is_out_of_memory(e):
            _report_holders(e)
            _report_ranks()
        if report_path is not None:  # at an OOM (or any exit by exception), before it propagates
            _write_report(report_path)
        raise
    if report_path is not None:
        _write_report(report_path)
    return 0


def _gmem_on():
    return os.environ.get("GMEM", "1") != "0"


def _start_recording():
    """The history the report draws: gmem's tracking, or PyTorch's under GMEM=0."""
    try:
        if _gmem_on():
            import gmem
            if not gmem.is_tracking():
                gmem.enable_tracking()
        else:
            import torch
            torch.cuda.memory._record_memory_history(max_entries=1000000)
    except Exception as e:
        print("gmem.run: --report: cannot record the history (%s)" % e, file=sys.stderr)


def _write_report(path):
    """Writes the page through the CLI (gmem.report); says why on stderr instead of raising, so
    that the program's own error or exit status stays what it was."""
    try:
        import importlib
        gmem_report = importlib.import_module("gmem.report")  # the module: gmem.report is its function
        if _gmem_on():
            gmem_report.report(path)
        else:  # PyTorch's snapshot, read by the same writer
            import subprocess
            import tempfile
            import torch
            with tempfile.TemporaryDirectory(prefix="gmem-report-") as work:
                snapshot = os.path.join(work, "snapshot.pickle")
                torch.cuda.memory._dump_snapshot(snapshot)
                binary = gmem_report.cli_binary()
                if binary is None:
                    raise RuntimeError("no gmem command-line tool in this installation")
                command = [binary, "report", snapshot, "-o", path]
                # The program's last batch-size fit, if it ran one (gmem.report does this itself).
                fit_module = sys.modules.get("gmem.fit")
                if fit_module is not None and fit_module.last_fit is not None:
                    import json
                    with open(os.path.join(work, "fit.json"), "w") as f:
                        json.dump(fit_module.last_fit.as_dict(), f)
                    command += ["--fit", os.path.join(work, "fit.json")]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(done.stderr.strip())
        print("gmem.run: wrote the report %s" % path, file=sys.stderr)
    except Exception as e:
        print("gmem.run: no report written (%s)" % e, file=sys.stderr)


def _is_out_of_memory(error):
    names = {cls.__name__ for cls in type(error).__mro__}
    return "OutOfMemoryError" in names


def _attach_oom_observer():
    """torch calls it at an out-of-memory, before raising, on the thread that ran out, with the
    GIL: the holder search then sees the frames that were running (gmem.holders, docs/holders.md).
    Best effort: an allocator route without OOM observers keeps the search at report time."""
    try:
        import torch
        from gmem import _holders
        torch._C._cuda_attach_out_of_memory_observer(_holders._on_oom)
    except Exception:
        pass


def _report_holders(error):
    """What holds the leaked memory and which processes hold the device, after gmem's report in
    the error (which C++ wrote without them). The traceback still holds the frames that ran out
    of memory, so their locals are searched too. Never raises."""
    try:
        import gmem
        from gmem import _holders
        raw = gmem.observe._raw_oom_report(-1)
        if raw is None:
            return
        found, procs = _holders._oom_sections(raw, -1)
        parts = [str(p) for p in (found, procs) if p is not None and (p is procs or found.targets or found.notes)]
        advice = found.advice if found is not None else []
        if advice:
            parts.append("What to do first:\n" + "\n".join("  - " + a for a in advice))
        if parts:
            print("gmem: " + "\n".join(parts), file=sys.stderr)
    except Exception as e:  # the report must not hide the out-of-memory error itself
        print("gmem: no holder report (%s)" % e, file=sys.stderr)


def _report_ranks():
    """In a torch.distributed job: which rank died, and what the others held (best effort,
    bounded wait: the other ranks may be stuck waiting for this one)."""
    try:
        from gmem import distributed
        text = distributed.oom_context(timeout=2.0)
    except Exception as e:  # the report must not hide the out-of-memory error itself
        text = "gmem: no cross-rank report (%s)" % e
    if text:
        print("gmem: " + text, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
