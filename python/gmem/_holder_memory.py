"""The objects that expose device memory, for the holder search (gmem._holders): torch tensors
(by their storage), anything with __cuda_array_interface__, and DLPack producers, each read as the
(address, bytes) range it spans."""

import ctypes
import sys


def _kind_of_type(tp, cache):
    kind = cache.get(tp, 0)
    if kind != 0:
        return kind
    kind = None
    try:
        torch = sys.modules.get("torch")
        tensor = getattr(torch, "Tensor", None) if torch is not None else None
        if isinstance(tensor, type) and issubclass(tp, tensor):
            kind = "tensor"
        elif getattr(tp, "__cuda_array_interface__", None) is not None:
            kind = "cai"
        elif getattr(tp, "__dlpack__", None) is not None and \
                getattr(tp, "__dlpack_device__", None) is not None:
            kind = "dlpack"
    except Exception:
        kind = None
    cache[tp] = kind
    return kind


def _extent(shape, strides, itemsize):
    """Bytes an array spans from its first element (strides in bytes; None: C-contiguous)."""
    if any(int(n) == 0 for n in shape):
        return 0
    if strides is None:
        total = itemsize
        for n in shape:
            total *= int(n)
        return total
    return itemsize + sum((int(n) - 1) * abs(int(s)) for n, s in zip(shape, strides))


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DL_CUDA = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def _dlpack_range(obj):
    device = obj.__dlpack_device__()
    if int(device[0]) not in _DL_CUDA:
        return None
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    address = get(capsule, b"dltensor")  # the capsule is not consumed: its deleter frees it
    t = ctypes.cast(address, ctypes.POINTER(_DLTensor)).contents
    itemsize = max(1, t.dtype.bits * t.dtype.lanes // 8)
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = [t.strides[i] * itemsize for i in range(t.ndim)] if t.strides else None
    return (t.data or 0) + t.byte_offset, _extent(shape, strides, itemsize)


def _memory_of(obj, kind):
    """(address, bytes, storage?) of the device memory `obj` exposes, or None. For a tensor, its
    storage: a view keeps its whole base alive (pytorch #50432)."""
    try:
        if kind == "tensor":
            if obj.device.type != "cuda":
                return None
            storage = obj.untyped_storage()
            return storage.data_ptr(), storage.nbytes(), obj.numel() * obj.element_size()
        if kind == "cai":
            cai = obj.__cuda_array_interface__
            typestr = cai["typestr"]
            itemsize = int(typestr[2:]) if len(typestr) > 2 else 1
            ptr = int(cai["data"][0])
            size = _extent(cai["shape"], cai.get("strides"), itemsize)
            return ptr, size, size
        if kind == "dlpack":
            found = _dlpack_range(obj)
            return (found[0], found[1], found[1]) if found else None
    except Exception:
        return None
    return None
