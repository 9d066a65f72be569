"""Builds (once, cached) and loads gmem's C++ pieces compiled against the installed torch:

  _torch_allocator.cpp  gmem's complete CUDAAllocator (c10::cuda::CUDACachingAllocator), written
                        for torch 2.11's interface; linked to libc10, libc10_cuda, libtorch_cuda
                        and libgmem.so. gmem.torch's first choice.
  _torch_shim.cpp       entry points for torch.cuda.memory.CUDAPluggableAllocator that raise
                        torch.OutOfMemoryError; linked to libc10 only. The fallback's helper.

Both need a C++ compiler and the installed torch's headers; the allocator also needs CUDA's
runtime headers and gmem's include/gmem/gmem.h. What is missing raises ShimUnavailable, and
gmem.torch falls back.

GMEM_TORCH_SHIM=0 skips the shim; GMEM_TORCH_SHIM=/path/lib.so uses a prebuilt one.
GMEM_TORCH_ALLOCATOR=0 skips the allocator; GMEM_TORCH_ALLOCATOR=/path/lib.so uses a prebuilt one.
The cache is $GMEM_CACHE_DIR, else $XDG_CACHE_HOME/gmem, else ~/.cache/gmem; a build is cached
under a hash of its sources, the torch version and place, the C++ ABI, the compiler and libgmem.
"""

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import sys

from . import _lib

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(_HERE, "_torch_shim.cpp")
ALLOC_FN = "gmem_torch_shim_malloc"
FREE_FN = "gmem_torch_shim_free"
ALLOCATOR_SOURCE = os.path.join(_HERE, "_torch_allocator.cpp")


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


def _torch_paths(torch):
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    include, libdir = os.path.join(torch_dir, "include"), os.path.join(torch_dir, "lib")
    if not os.path.isfile(os.path.join(include, "c10", "util", "Exception.h")):
        raise ShimUnavailable("torch's C++ headers are not installed under %s" % include)
    return torch_dir, include, libdir


def _compile(name, sources, torch_dir, include_dirs, link_args, key_parts):
    """Compiles `sources` into the cached lib<name>-<hash>.so; returns its path."""
    cxx = _compiler()
    if cxx is None:
        raise ShimUnavailable("no C++ compiler found (set CXX)")
    parts = []
    for path in sources:
        with open(path, "rb") as f:
            parts.append(f.read())
    parts += [p.encode() for p in key_parts] + [cxx.encode(), torch_dir.encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    out = os.path.join(cache_dir(), "lib%s-%s.so" % (name, key))
    if os.path.isfile(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = "%s.%d.tmp" % (out, os.getpid())
    errors = []
    for std in ("c++17", "c++20"):  # whichever the installed headers accept
        cmd = [cxx, "-std=" + std, "-O2", "-shared", "-fPIC"]
        for directory in include_dirs:
            cmd += ["-isystem", directory]
        cmd += [sources[0], "-o", tmp] + link_args
        try:
            result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    universal_newlines=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ShimUnavailable("compiling %s failed: %s" % (sources[0], e))
        if result.returncode == 0:
            os.replace(tmp, out)  # atomic: concurrent builders never see half a file
            return out
        errors.append(_first_errors(result.stdout))
    if os.path.exists(tmp):
        os.remove(tmp)
    raise ShimUnavailable("compiling %s failed:\n%s" % (sources[0], errors[-1]))


def _first_errors(output, lines=12):
    """The compiler's first error lines (the rest is usually their consequences)."""
    errors = [line for line in output.splitlines() if "error" in line]
    return "\n".join((errors or output.splitlines())[:lines])[-3000:]


def _abi(torch):
    return int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))


def build(torch):
    """Path of the OOM shim built for this torch, compiling it when not cached yet."""
    torch_dir, include, libdir = _torch_paths(torch)
    abi = _abi(torch)
    return _compile("gmem_torch_shim", [SOURCE], torch_dir, [include],
                    ["-D_GLIBCXX_USE_CXX11_ABI=%d" % abi, "-L" + libdir, "-lc10",
                     "-Wl,-rpath," + libdir],
                    [torch.__version__, str(abi)])


def cuda_include_dir():
    """A directory holding CUDA's cuda_runtime_api.h, or None."""
    candidates = [os.path.join(os.environ[v], "include")
                  for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
                                       "include"))
    candidates.append("/usr/local/cuda/include")
    for site in sys.path:  # CUDA's pip packages (nvidia-cuda-runtime-*), as torch wheels use
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))
    for directory in candidates:
        if os.path.isfile(os.path.join(directory, "cuda_runtime_api.h")):
            return directory
    return None


def gmem_include_dir():
    """The directory holding gmem/gmem.h: $GMEM_INCLUDE_DIR, the package's include/ (where
    `pip install` puts the headers), or the repository's include/."""
    candidates = [os.environ.get("GMEM_INCLUDE_DIR"), os.path.join(_HERE, "include"),
                  os.path.join(os.path.dirname(os.path.dirname(_HERE)), "include")]
    for directory in candidates:
        if directory and os.path.isfile(os.path.join(directory, "gmem", "gmem.h")):
            return directory
    return None


def build_allocator(torch):
    """Path of gmem's CUDAAllocator built for this torch, compiling it when not cached yet."""
    torch_dir, include, libdir = _torch_paths(torch)
    cuda_include = cuda_include_dir()
    if cuda_include is None:
        raise ShimUnavailable("CUDA's runtime headers (cuda_runtime_api.h) were not found; set "
                              "CUDA_HOME")
    gmem_include = gmem_include_dir()
    if gmem_include is None:
        raise ShimUnavailable("gmem's headers (gmem/gmem.h) were not found; set GMEM_INCLUDE_DIR")
    libgmem = _lib.library_path()
    abi = _abi(torch)
    # CUDA runtime calls resolve through libc10_cuda's own libcudart (the one torch loaded).
    link = ["-D_GLIBCXX_USE_CXX11_ABI=%d" % abi, "-L" + libdir, "-ltorch_cuda", "-lc10_cuda",
            "-lc10", libgmem, "-Wl,-rpath," + libdir,
            "-Wl,-rpath," + os.path.dirname(libgmem)]
    return _compile("gmem_torch_allocator",
                    [ALLOCATOR_SOURCE, os.path.join(gmem_include, "gmem", "gmem.h")],
                    torch_dir, [include, cuda_include, gmem_include], link,
                    [torch.__version__, str(abi), libgmem])


def load_allocator(torch):
    """Builds or finds gmem's CUDAAllocator and loads it (not yet installed): the ctypes library,
    with gmem_torch_allocator_install(char*, size_t) -> int."""
    choice = os.environ.get("GMEM_TORCH_ALLOCATOR", "")
    if choice == "0":
        raise ShimUnavailable("GMEM_TORCH_ALLOCATOR=0")
    _lib.lib()  # libgmem first: the allocator links to this very copy
    path = choice if choice not in ("", "1") else build_allocator(torch)
    try:
        library = ctypes.CDLL(path)
    except OSError as e:
        raise ShimUnavailable("cannot load %s: %s" % (path, e))
    library.gmem_torch_allocator_install.restype = ctypes.c_int
    library.gmem_torch_allocator_install.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    library.gmem_torch_allocator_active.restype = ctypes.c_int
    library.gmem_torch_allocator_active.argtypes = []
    library.path = path
    return library


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
