"""Builds (once, cached) and loads _torch_shim.cpp: gmem's allocator entry points for PyTorch
that raise torch.OutOfMemoryError. Needs a C++ compiler and the installed torch's headers; when
either is missing gmem.torch falls back to libgmem's own entry points.

GMEM_TORCH_SHIM=0 skips the shim; GMEM_TORCH_SHIM=/path/lib.so uses a prebuilt one.
The cache is $GMEM_CACHE_DIR, else $XDG_CACHE_HOME/gmem, else ~/.cache/gmem.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess

from . import _lib

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torch_shim.cpp")
ALLOC_FN = "gmem_torch_shim_malloc"
FREE_FN = "gmem_torch_shim_free"


class ShimUnavailable(Exception):
    """Why the shim could not be had (the caller warns and falls back)."""


def cache_dir():
    if os.environ.get("GMEM_CACHE_DIR"):
        return os.environ["GMEM_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gmem")


def _compiler():
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def build(torch):
    """Path of the shim built for this torch, compiling it when not cached yet."""
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    include, libdir = os.path.join(torch_dir, "include"), os.path.join(torch_dir, "lib")
    if not os.path.isfile(os.path.join(include, "c10", "util", "Exception.h")):
        raise ShimUnavailable("torch's C++ headers are not installed under %s" % include)
    cxx = _compiler()
    if cxx is None:
        raise ShimUnavailable("no C++ compiler found (set CXX)")
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), torch_dir.encode(),
                                     str(abi).encode(), cxx.encode()])).hexdigest()[:16]
    out = os.path.join(cache_dir(), "libgmem_torch_shim-%s.so" % key)
    if os.path.isfile(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = "%s.%d.tmp" % (out, os.getpid())
    errors = []
    for std in ("c++17", "c++20"):  # whichever the installed headers accept
        cmd = [cxx, "-std=" + std, "-O2", "-shared", "-fPIC", "-D_GLIBCXX_USE_CXX11_ABI=%d" % abi,
               "-isystem", include, SOURCE, "-o", tmp, "-L" + libdir, "-lc10",
               "-Wl,-rpath," + libdir]
        try:
            result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    universal_newlines=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ShimUnavailable("compiling %s failed: %s" % (SOURCE, e))
        if result.returncode == 0:
            os.replace(tmp, out)  # atomic: concurrent builders never see half a file
            return out
        errors.append(result.stdout[-2000:])
    if os.path.exists(tmp):
        os.remove(tmp)
    raise ShimUnavailable("compiling %s failed:\n%s" % (SOURCE, errors[-1]))


def load(torch):
    """Builds or finds the shim, binds it to libgmem, and returns its path."""
    choice = os.environ.get("GMEM_TORCH_SHIM", "")
    if choice == "0":
        raise ShimUnavailable("GMEM_TORCH_SHIM=0")
    path = choice if choice else build(torch)
    try:
        shim = ctypes.CDLL(path)
    except OSError as e:
        raise ShimUnavailable("cannot load %s: %s" % (path, e))
    bind = shim.gmem_torch_shim_bind
    bind.restype = None
    bind.argtypes = [ctypes.c_void_p] * 3
    bind(_lib.address_of("gmem_malloc"), _lib.address_of("gmem_free"),
         _lib.address_of("gmem_last_error"))
    return path
