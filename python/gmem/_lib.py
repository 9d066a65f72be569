"""Finds libgmem.so and declares its C API (include/gmem/gmem.h) for ctypes.

Where the library is looked for, first match wins:
  1. the environment variable GMEM_LIBRARY (a path to the .so);
  2. libgmem.so next to this package (`pip install .` puts it there);
  3. build/libgmem.so in the repository this package lives in.
"""

import ctypes
import os
import threading

from .errors import GmemError, error_for_status

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))  # python/gmem -> repository root

_uintptr = ctypes.c_size_t  # uintptr_t: same width as size_t on every platform gmem supports
_status = ctypes.c_int

# ctypes wraps an int that does not fit its C type (2**64 + 4096 becomes 4096 as a size_t, 2**32
# becomes device 0 as an int) instead of refusing it: arguments are checked against these first.
SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1
UINTPTR_MAX = (1 << (8 * ctypes.sizeof(_uintptr))) - 1
INT_MIN = -(1 << (8 * ctypes.sizeof(ctypes.c_int) - 1))
INT_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_int) - 1)) - 1

# name: (restype, argtypes)
_PROTOTYPES = {
    "gmem_last_error": (ctypes.c_char_p, []),
    "gmem_malloc": (_status, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int, _uintptr]),
    "gmem_free": (_status, [ctypes.c_void_p]),
    "gmem_record_stream": (_status, [ctypes.c_void_p, _uintptr]),
    "gmem_empty_cache": (_status, [ctypes.c_int]),
    "gmem_mark_step": (_status, [ctypes.c_int]),
    "gmem_set_memory_limit": (_status, [ctypes.c_int, ctypes.c_size_t]),
    "gmem_set_memory_fraction": (_status, [ctypes.c_int, ctypes.c_double]),
    "gmem_reset_peak_stats": (_status, [ctypes.c_int]),
    "gmem_reset_accumulated_stats": (_status, [ctypes.c_int]),
    "gmem_stat": (_status, [ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64)]),
    "gmem_stats_text": (_status, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
                                  ctypes.POINTER(ctypes.c_size_t)]),
    "gmem_memory_summary": (_status, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
                                      ctypes.POINTER(ctypes.c_size_t)]),
    "gmem_torch_empty_cache": (None, []),  # every device's engine, like torch.cuda.empty_cache
}

# The torch.cuda CUDAPluggableAllocator entry points: only their addresses are needed.
TORCH_ENTRY_POINTS = (
    "gmem_torch_malloc",
    "gmem_torch_free",
    "gmem_torch_empty_cache",
    "gmem_torch_memory_fraction",
    "gmem_torch_record_stream",
    "gmem_torch_reset_peak",
)

_lock = threading.Lock()
_lib = None
_path = None


def candidate_paths():
    """Where the library is looked for, in order."""
    env = os.environ.get("GMEM_LIBRARY")
    if env:
        return [os.path.abspath(env)]
    return [os.path.join(_HERE, "libgmem.so"), os.path.join(_REPO, "build", "libgmem.so")]


def _load():
    global _lib, _path
    candidates = candidate_paths()
    for path in candidates:
        if os.path.isfile(path):
            break
    else:
        raise GmemError(
            "libgmem.so not found; looked at: %s. Install gmem with `pip install .` from the "
            "repository (it builds the library into the package), or build it (cmake -S . -B build "
            "&& cmake --build build) or point GMEM_LIBRARY at it." % ", ".join(candidates))
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise GmemError("cannot load %s: %s" % (path, e)) from e
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as e:
            raise GmemError("%s lacks %s: is it an older libgmem?" % (path, name)) from e
        fn.restype = restype
        fn.argtypes = argtypes
    _lib, _path = lib, path


def lib():
    """The loaded library (loads it on first use)."""
    if _lib is None:
        with _lock:
            if _lib is None:
                _load()
    return _lib


def library_path():
    """Absolute path of the library in use (loads it on first use)."""
    lib()
    return _path


def address_of(name):
    """Address of an exported function, as an int (for torch's allocator hooks)."""
    fn = getattr(lib(), name)
    return ctypes.cast(fn, ctypes.c_void_p).value


def last_error():
    message = lib().gmem_last_error()
    return message.decode("utf-8", "replace") if message else ""


def check(status, requested=None):
    """Raises the gmem exception for a failed status; returns None when it succeeded."""
    if status != 0:
        raise error_for_status(status, last_error(), requested=requested)


def text(fn, *args):
    """Calls a C API function (args..., buf, size, needed) that writes text, growing the buffer
    until the text fits."""
    needed = ctypes.c_size_t(0)
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        check(fn(*args, buf, size, ctypes.byref(needed)))
        if needed.value <= size:
            return buf.value.decode("utf-8", "replace")
        size = needed.value + needed.value // 4  # it may grow before the next call
