"""gmem: a fragmentation-free GPU memory manager, from Python.

The engine lives in libgmem.so (see gmem._lib for where it is looked for); this package is a
pure-Python layer over its C API, so importing it needs no compiler.

    import gmem
    gmem.memory_stats()                 # PyTorch's statistic names, plus gmem's own
    gmem.set_memory_limit(0.5)          # half the device; an int is bytes
    print(gmem.memory_summary())

    fit = gmem.fit_batch_size(step)     # the largest batch that fits, by measurement

To make gmem PyTorch's CUDA allocator, call gmem.torch.enable() before the first CUDA
allocation, or run a script with `python -m gmem.run train.py ...`.

The modules import one way, from the bottom up (tests/python/test_import_layers.py checks it):
leaves (errors, _format, _version), then _lib, memory, observe (the core), then what is built on
it: _processes and the _holder_* parts, _holders, distributed, _summary, the fit modules, and
torch, run and this file at the top. The core calls up only through hooks the modules above
register when imported (observe.step_listeners, observe._set_report_sections); this file imports
them all, _holders and distributed included, so that `import gmem` has every one in place.
"""

from ._lib import library_path
from ._format import format_bytes
from ._summary import memory_summary
from ._version import __version__
from . import distributed  # noqa: F401  (gmem.step() publishes the rank's row: its hook)
from .observe import (
    annotate,
    disable_tracking,
    dump_snapshot,
    enable_tracking,
    is_tracking,
    last_oom_report,
    Leaks,
    leaks,
    ModuleTracking,
    python_stack,
    scope,
    set_frames,
    snapshot,
    step,
    top_sites,
    track_modules,
)
from .report import report
from .find_batch import find_executable_batch_size
from ._holders import Holders, Nvml, Processes, holders, processes
from .fit import Fit, Probe, fit_batch_size, is_out_of_memory
from .levers import Row, WhatFits, what_fits
from .errors import (
    BadInputError,
    DeviceError,
    DoubleFreeError,
    FitError,
    GmemError,
    InvalidArgumentError,
    InvalidPointerError,
    OutOfMemoryError,
)
from .memory import (
    empty_cache,
    free,
    malloc,
    mark_step,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_limit,
    memory_reserved,
    memory_stat,
    memory_stats,
    record_stream,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    set_memory_limit,
)

__all__ = [
    "BadInputError", "DeviceError", "DoubleFreeError", "GmemError", "InvalidArgumentError",
    "InvalidPointerError", "OutOfMemoryError",
    "annotate", "disable_tracking", "dump_snapshot", "enable_tracking", "is_tracking",
    "last_oom_report", "Leaks", "leaks", "ModuleTracking", "python_stack", "scope", "set_frames",
    "snapshot", "step", "top_sites", "track_modules", "report",
    "Holders", "Nvml", "Processes", "holders", "processes",
    "Fit", "FitError", "Probe", "Row", "WhatFits", "find_executable_batch_size", "fit_batch_size",
    "is_out_of_memory", "what_fits",
    "empty_cache", "format_bytes", "free", "library_path", "malloc", "mark_step", "max_memory_allocated",
    "max_memory_reserved", "memory_allocated", "memory_limit", "memory_reserved", "memory_stat",
    "memory_stats", "memory_summary", "record_stream", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "set_memory_limit",
]
