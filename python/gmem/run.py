"""Runs a PyTorch program with gmem as its CUDA allocator, unchanged:

    python -m gmem.run train.py --epochs 3
    python -m gmem.run -m mypackage.train --epochs 3

gmem is enabled before the program starts, so it owns every CUDA allocation. GMEM=0 in the
environment runs the program with PyTorch's own allocator instead (for comparisons).
"""

import os
import runpy
import sys

USAGE = "usage: python -m gmem.run (SCRIPT | -m MODULE) [ARGS...]   (GMEM=0 skips gmem)"


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "-m" and len(argv) < 2:
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] != "-m" and not os.path.isfile(argv[0]):
        print("gmem.run: no such script: %s" % argv[0], file=sys.stderr)
        return 2

    if os.environ.get("GMEM", "1") != "0":
        from gmem import torch as gmem_torch

        gmem_torch.enable()

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
            _report_ranks()
        raise
    return 0


def _is_out_of_memory(error):
    names = {cls.__name__ for cls in type(error).__mro__}
    return "OutOfMemoryError" in names


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
