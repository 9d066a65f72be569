"""Statistics, limits and raw allocations, named like torch.cuda's memory functions.

`device` is what torch.cuda's memory functions take: None (the current device), an int ordinal,
a string "cuda" or "cuda:N", or a torch.device (any object with .index).
"""

import collections
import ctypes
import numbers
import sys

from . import _lib
from .errors import InvalidArgumentError, InvalidPointerError


def device_index(device):
    """The C API's device argument: -1 (the current device) for None, else the ordinal. Takes what
    torch takes: an int, a string "cuda" (the current device) or "cuda:N", or an object with
    .index such as torch.device("cuda", 0) (index None: the current device; its .type, where it
    has one, must be "cuda"). A bad string, a device of another type or an ordinal no C int holds
    raises InvalidArgumentError (a ValueError) naming it; an argument of another kind, TypeError."""
    if device is None:
        return -1
    if isinstance(device, str):
        kind, colon, ordinal = device.partition(":")
        if kind != "cuda" or (colon and not (ordinal.isascii() and ordinal.isdigit())):
            raise InvalidArgumentError("device %r: expected 'cuda' or 'cuda:N' (N a GPU's ordinal)"
                                       % device)
        index = int(ordinal) if colon else -1
    elif isinstance(device, numbers.Integral) and not isinstance(device, bool):
        index = int(device)
    elif hasattr(device, "index"):  # torch.device, or anything shaped like one
        kind = getattr(device, "type", "cuda")
        if isinstance(kind, str) and kind != "cuda":
            raise InvalidArgumentError("%r: expected a cuda device, not %s" % (device, kind))
        index = device.index
        if index is None:
            return -1
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError("device %r: its index must be an int or None, not %r" % (device, index))
        index = int(index)
    else:
        raise TypeError("device must be an int, a string such as 'cuda:0', a torch.device or None, "
                        "not %r" % (device,))
    if not _lib.INT_MIN <= index <= _lib.INT_MAX:  # ctypes would wrap it to another device
        raise InvalidArgumentError("device %r: no GPU has ordinal %d" % (device, index))
    return index


def _device_ordinal(device):
    """The ordinal `device` names: device_index's, with the current device (-1) resolved to
    torch's current CUDA device where torch has initialised CUDA, else 0 (gmem's first device:
    the current one where CUDA was never told otherwise)."""
    index = device_index(device)
    if index >= 0:
        return index
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.current_device()
    except Exception:
        pass
    return 0


def stream_handle(stream):
    """A cudaStream_t as an int: accepts ints and objects with .cuda_stream (torch streams)."""
    if stream is None:
        return 0
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, bool) or not isinstance(handle, numbers.Integral):
        raise TypeError("stream must be a non-negative int or a torch.cuda.Stream, not %r" % (stream,))
    if not 0 <= handle <= _lib.UINTPTR_MAX:  # ctypes would wrap it to another stream
        raise InvalidArgumentError("stream %r: a stream handle is an address, 0 to %d"
                                   % (stream, _lib.UINTPTR_MAX))
    return int(handle)


def _pointer_value(ptr, call):
    """An address as an int for the C API; one no pointer can hold raises InvalidPointerError
    rather than wrap around to another address."""
    address = int(ptr)
    if not 0 <= address <= _lib.UINTPTR_MAX:
        raise InvalidPointerError("%s(%d): not an address (0 to %d)" % (call, address, _lib.UINTPTR_MAX))
    return address


# --- statistics ---------------------------------------------------------------------------


def memory_stats(device=None):
    """Every statistic as {name: int}, sorted by name, in PyTorch's names
    ("allocated_bytes.all.current", ...) followed by gmem's own ("gmem.memory_limit", ...)."""
    stats = {}
    for line in _lib.text(_lib.lib().gmem_stats_text, device_index(device)).splitlines():
        if line.strip():
            name, value = line.rsplit(None, 1)
            stats[name] = int(value)
    return collections.OrderedDict(sorted(stats.items()))


def memory_stat(name, device=None):
    """One statistic by name, without formatting them all."""
    value = ctypes.c_int64(0)
    _lib.check(_lib.lib().gmem_stat(device_index(device), name.encode("utf-8"), ctypes.byref(value)))
    return value.value


def memory_allocated(device=None):
    """Bytes handed out and live (each block rounded up to 512 B), like torch.cuda.memory_allocated."""
    return memory_stat("allocated_bytes.all.current", device)


def max_memory_allocated(device=None):
    return memory_stat("allocated_bytes.all.peak", device)


def memory_reserved(device=None):
    """Physical memory gmem holds from the device, like torch.cuda.memory_reserved."""
    return memory_stat("reserved_bytes.all.current", device)


def max_memory_reserved(device=None):
    return memory_stat("reserved_bytes.all.peak", device)


def memory_limit(device=None):
    """Bytes gmem may hold (the device's total unless set_memory_limit lowered it)."""
    return memory_stat("gmem.memory_limit", device)


def reset_peak_memory_stats(device=None):
    _lib.check(_lib.lib().gmem_reset_peak_stats(device_index(device)))


def reset_accumulated_memory_stats(device=None):
    _lib.check(_lib.lib().gmem_reset_accumulated_stats(device_index(device)))


# --- control --------------------------------------------------------------------------------


def empty_cache(device=None):
    """Gives every free chunk back to the device; once calls after every step are seen to cost
    the program time, keeps what the last steps used (GMEM_EMPTY_CACHE=strict: never)."""
    _lib.check(_lib.lib().gmem_empty_cache(device_index(device)))


def mark_step(device=None):
    """A training step ended (between its last free and the next step's first malloc). Once steps
    are marked, a step that comes back after other shapes ran (sequence lengths taking turns) is
    laid out from its last occurrence: no device calls and no more memory than its peak. Without
    marks nothing changes. gmem.torch.enable() marks a step after every optimizer step; call this
    yourself in a loop without a torch.optim optimizer."""
    _lib.check(_lib.lib().gmem_mark_step(device_index(device)))


def set_memory_limit(limit, device=None):
    """Caps the memory gmem may hold. An int is bytes (0 = the device's total, no cap); a float
    in (0, 1] is a fraction of the device's total memory."""
    lib = _lib.lib()
    dev = device_index(device)
    if isinstance(limit, bool) or not isinstance(limit, (numbers.Integral, float)):
        raise TypeError("limit must be bytes (int) or a fraction (float), not %r" % (limit,))
    if isinstance(limit, float):
        if not 0.0 < limit <= 1.0:
            raise InvalidArgumentError(
                "memory limit fraction must be in (0, 1], got %r; give bytes as an int" % limit)
        _lib.check(lib.gmem_set_memory_fraction(dev, limit))
    else:
        if limit < 0:
            raise InvalidArgumentError("memory limit must be >= 0 bytes, got %d" % limit)
        if limit > _lib.SIZE_MAX:  # ctypes would wrap it
            raise InvalidArgumentError("memory limit of %d bytes: more than any device" % limit)
        _lib.check(lib.gmem_set_memory_limit(dev, int(limit)))


# --- raw allocations (tests, interop) ---------------------------------------------------------


def malloc(size, stream=0, device=None):
    """Allocates `size` bytes of device memory on `stream`; returns the address as an int.
    Raises gmem.OutOfMemoryError when it cannot be served, InvalidArgumentError (a ValueError)
    for a size below 1 or beyond what size_t holds, TypeError for a size that is not an int."""
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
        raise TypeError("size must be an int (bytes), not %r" % (size,))
    if size < 0:
        raise InvalidArgumentError("malloc(%d): a size cannot be negative" % size)
    if size > _lib.SIZE_MAX:  # ctypes would wrap it: 2**64 + 4096 would allocate 4 KiB
        raise InvalidArgumentError("malloc(%d): larger than any device (size_t holds at most %d)"
                                   % (size, _lib.SIZE_MAX))
    ptr = ctypes.c_void_p(None)
    status = _lib.lib().gmem_malloc(ctypes.byref(ptr), int(size), device_index(device),
                                    stream_handle(stream))
    _lib.check(status, requested=int(size))
    return ptr.value


def free(ptr):
    """Frees an address from malloc (or from PyTorch under gmem.torch)."""
    _lib.check(_lib.lib().gmem_free(ctypes.c_void_p(_pointer_value(ptr, "free"))))


def record_stream(ptr, stream):
    """`ptr` is also used on `stream`: once freed, it is reused only after `stream` caught up."""
    _lib.check(_lib.lib().gmem_record_stream(ctypes.c_void_p(_pointer_value(ptr, "record_stream")),
                                             stream_handle(stream)))
