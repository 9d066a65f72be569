"""Statistics, limits and raw allocations, named like torch.cuda's memory functions.

`device` is a CUDA ordinal, a torch.device, or None for the current device.
"""

import collections
import ctypes
import numbers

from . import _lib
from .errors import InvalidArgumentError


def device_index(device):
    """The C API's device argument: -1 (current) for None, else the ordinal. Takes what torch
    takes: an int, a torch.device, or a string such as "cuda:0" ("cuda": the current device)."""
    if device is None:
        return -1
    if isinstance(device, str):
        kind, _, ordinal = device.partition(":")
        if kind != "cuda" or (ordinal and not ordinal.isdigit()):
            raise InvalidArgumentError("device %r: expected 'cuda' or 'cuda:N'" % device)
        return int(ordinal) if ordinal else -1
    index = getattr(device, "index", device)  # torch.device has .index (None = current)
    if index is None:
        return -1
    if isinstance(index, bool) or not isinstance(index, numbers.Integral):
        raise TypeError("device must be an int, a torch.device or None, not %r" % (device,))
    return int(index)


def stream_handle(stream):
    """A cudaStream_t as an int: accepts ints and objects with .cuda_stream (torch streams)."""
    if stream is None:
        return 0
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, bool) or not isinstance(handle, numbers.Integral) or handle < 0:
        raise TypeError("stream must be a non-negative int or a torch.cuda.Stream, not %r" % (stream,))
    return int(handle)


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
    """Gives every free chunk back to the device."""
    _lib.check(_lib.lib().gmem_empty_cache(device_index(device)))


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
        if limit >= 1 << 64:  # ctypes would wrap it
            raise InvalidArgumentError("memory limit of %d bytes: more than any device" % limit)
        _lib.check(lib.gmem_set_memory_limit(dev, int(limit)))


# --- raw allocations (tests, interop) ---------------------------------------------------------


def malloc(size, stream=0, device=None):
    """Allocates `size` bytes of device memory on `stream`; returns the address as an int.
    Raises gmem.OutOfMemoryError when it cannot be served."""
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
        raise TypeError("size must be a non-negative int, not %r" % (size,))
    if size >= 1 << 64:  # ctypes would wrap it to a small size
        raise InvalidArgumentError("malloc(%d): larger than any device" % size)
    ptr = ctypes.c_void_p(None)
    status = _lib.lib().gmem_malloc(ctypes.byref(ptr), int(size), device_index(device),
                                    stream_handle(stream))
    _lib.check(status, requested=int(size))
    return ptr.value


def free(ptr):
    """Frees an address from malloc (or from PyTorch under gmem.torch)."""
    _lib.check(_lib.lib().gmem_free(ctypes.c_void_p(int(ptr))))


def record_stream(ptr, stream):
    """`ptr` is also used on `stream`: once freed, it is reused only after `stream` caught up."""
    _lib.check(_lib.lib().gmem_record_stream(ctypes.c_void_p(int(ptr)), stream_handle(stream)))
