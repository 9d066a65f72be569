"""Builds (once, cached) and loads gmem's C++ pieces compiled against the installed torch:

  _torch_allocator.cpp  gmem's complete CUDAAllocator (c10::cuda::CUDACachingAllocator), written
                        for torch 2.11's interface; linked to libc10, libc10_cuda, libtorch_cuda
                        and libgmem.so. gmem.torch's first choice. One translation unit: it
                        includes its private headers, _torch_allocator/*.hpp, relative to itself
                        (no -I), and they are hashed with it into the cache key.
  _torch_shim.cpp       entry points for torch.cuda.memory.CUDAPluggableAllocator that raise
                        torch.OutOfMemoryError; linked to libc10 only. The fallback's helper.

Both need a C++ compiler and the installed torch's headers; the allocator also needs CUDA's
runtime headers and gmem's include/gmem/gmem.h. What is missing raises ShimUnavailable, and
gmem.torch falls back.

GMEM_TORCH_SHIM=0 skips the shim; GMEM_TORCH_SHIM=/path/lib.so uses a prebuilt one.
GMEM_TORCH_ALLOCATOR=0 skips the allocator; GMEM_TORCH_ALLOCATOR=/path/lib.so uses a prebuilt one.
The cache is $GMEM_CACHE_DIR, else $XDG_CACHE_HOME/gmem, else ~/.cache/gmem; a build is cached
under a hash of its sources, the torch version and place, the C++ ABI, the compiler and libgmem.

`pip install .` into an environment with torch compiles the allocator at install time, with the
same function and flags (build_allocator_into), into the package: libgmem_torch_allocator.so
next to libgmem.so, and torch_allocator.json saying which torch it was built for (or why it was
not built). load_allocator takes it when that torch is the one running; a compile at first use
remains for when it is not (torch absent at install, or upgraded since).
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
ALLOCATOR_HEADERS = os.path.join(_HERE, "_torch_allocator")  # its private headers (*.hpp)
# Built at install time (setup.py), inside the package.
PREBUILT_ALLOCATOR = "libgmem_torch_allocator.so"
PREBUILT_RECORD = "torch_allocator.json"
PACKAGE_DIR = _HERE  # where the install put them (a module global: tests point it elsewhere)


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


def _cached_path(name, sources, torch_dir, key_parts, cxx):
    """Where the cache keeps lib<name> built from these sources for this torch and compiler."""
    parts = []
    for path in sources:
        with open(path, "rb") as f:
            parts.append(f.read())
    parts += [p.encode() for p in key_parts] + [cxx.encode(), torch_dir.encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return os.path.join(cache_dir(), "lib%s-%s.so" % (name, key))


def _compile(name, sources, torch_dir, include_dirs, link_args, key_parts, out=None):
    """Compiles sources[0] (the others, headers it includes, only make the cache key) into the
    cached lib<name>-<hash>.so, or into `out` when given (the install-time build: always
    compiled); returns its path."""
    cxx = _compiler()
    if cxx is None:
        raise ShimUnavailable("no C++ compiler found (set CXX)")
    if out is None:
        out = _cached_path(name, sources, torch_dir, key_parts, cxx)
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


def allocator_sources():
    """_torch_allocator.cpp first (the one file compiled), then its private headers
    (_torch_allocator/*.hpp): all make the cache key, so a changed header rebuilds."""
    return [ALLOCATOR_SOURCE] + sorted(glob.glob(os.path.join(ALLOCATOR_HEADERS, "*.hpp")))


def _allocator_build(torch, libgmem, gmem_include, libgmem_rpath):
    """What compiling gmem's CUDAAllocator for this torch takes: (sources, torch_dir,
    include_dirs, link_args, key_parts), the same for a compile at first use and at install
    time, so that the two cannot disagree. Raises ShimUnavailable naming what is missing."""
    torch_dir, include, libdir = _torch_paths(torch)
    cuda_include = cuda_include_dir()
    if cuda_include is None:
        raise ShimUnavailable("CUDA's runtime headers (cuda_runtime_api.h) were not found; set "
                              "CUDA_HOME")
    if gmem_include is None:
        raise ShimUnavailable("gmem's headers (gmem/gmem.h) were not found; set GMEM_INCLUDE_DIR")
    abi = _abi(torch)
    # CUDA runtime calls resolve through libc10_cuda's own libcudart (the one torch loaded).
    link = ["-D_GLIBCXX_USE_CXX11_ABI=%d" % abi, "-L" + libdir, "-ltorch_cuda", "-lc10_cuda",
            "-lc10", libgmem, "-Wl,-rpath," + libdir, "-Wl,-rpath," + libgmem_rpath]
    return (allocator_sources() + [os.path.join(gmem_include, "gmem", "gmem.h")], torch_dir,
            [include, cuda_include, gmem_include], link, [torch.__version__, str(abi), libgmem])


def build_allocator(torch):
    """Path of gmem's CUDAAllocator built for this torch, compiling it when not cached yet."""
    libgmem = _lib.library_path()
    return _compile("gmem_torch_allocator",
                    *_allocator_build(torch, libgmem, gmem_include_dir(), os.path.dirname(libgmem)))


def torch_fingerprint(torch):
    """What an allocator built for one torch must find again in the running one."""
    return {"torch": torch.__version__, "cxx11_abi": _abi(torch),
            "cuda": getattr(getattr(torch, "version", None), "cuda", None)}


def build_allocator_into(torch, package_dir, libgmem, gmem_include):
    """The install-time build (setup.py): gmem's CUDAAllocator compiled for `torch` into
    package_dir/libgmem_torch_allocator.so, linked to `libgmem` (the build's, which setup.py puts
    next to it: found there through $ORIGIN), and its record. Raises ShimUnavailable."""
    out = os.path.join(package_dir, PREBUILT_ALLOCATOR)
    path = _compile("gmem_torch_allocator", *_allocator_build(torch, libgmem, gmem_include, "$ORIGIN"),
                    out=out)
    record = dict(torch_fingerprint(torch), built=True, torch_dir=os.path.dirname(torch.__file__))
    write_prebuilt_record(package_dir, record)
    return path


def write_prebuilt_record(package_dir, record):
    import json
    with open(os.path.join(package_dir, PREBUILT_RECORD), "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")


def prebuilt_record(package_dir=None):
    """The install's record (torch_allocator.json), or None when there is none (a build from the
    repository, an editable install, or a gmem installed before records were written)."""
    import json
    try:
        with open(os.path.join(package_dir or PACKAGE_DIR, PREBUILT_RECORD)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def prebuilt_allocator(torch, package_dir=None):
    """(path, why): the allocator built at install time when it was built for this very torch,
    else (None, why not)."""
    package_dir = package_dir or PACKAGE_DIR
    record = prebuilt_record(package_dir)
    if record is None:
        return None, "gmem was not installed with pip (no %s)" % PREBUILT_RECORD
    if not record.get("built"):
        return None, "not built at install time: %s" % record.get("reason", "no reason recorded")
    path = os.path.join(package_dir, PREBUILT_ALLOCATOR)
    if not os.path.isfile(path):
        return None, "%s is missing" % path
    running = torch_fingerprint(torch)
    built_for = {key: record.get(key) for key in running}
    if built_for != running:
        return None, ("built at install time for torch %s (C++ ABI %s, CUDA %s), but this is torch "
                      "%s (C++ ABI %s, CUDA %s)" % (built_for["torch"], built_for["cxx11_abi"],
                                                   built_for["cuda"], running["torch"],
                                                   running["cxx11_abi"], running["cuda"]))
    return path, "built at install time against torch %s" % record["torch"]


def allocator_route(torch):
    """(route, why): how gmem.torch.enable() will make gmem PyTorch's allocator, without doing it.
    route: "full (prebuilt: GMEM_TORCH_ALLOCATOR)", "full (built at install)", "full (compiled
    at first use, cached)", "full (compile at first use)" or "pluggable"."""
    choice = os.environ.get("GMEM_TORCH_ALLOCATOR", "")
    if choice == "0":
        return "pluggable", "GMEM_TORCH_ALLOCATOR=0 asks for PyTorch's CUDAPluggableAllocator route"
    if choice not in ("", "1"):
        if os.path.isfile(choice):
            return "full (prebuilt: GMEM_TORCH_ALLOCATOR)", "GMEM_TORCH_ALLOCATOR=%s" % choice
        return "pluggable", "GMEM_TORCH_ALLOCATOR=%s names no file (the fallback follows)" % choice
    path, why_not = prebuilt_allocator(torch)
    if path:
        return "full (built at install)", "%s: %s" % (why_not, path)
    try:
        libgmem = _lib.library_path()
        build = _allocator_build(torch, libgmem, gmem_include_dir(), os.path.dirname(libgmem))
        cxx = _compiler()
        if cxx is None:
            raise ShimUnavailable("no C++ compiler found (set CXX)")
    except Exception as e:  # whatever stops the compile (GmemError: no libgmem.so) is the reason
        return "pluggable", ("the full allocator is not prebuilt (%s) and cannot be compiled here "
                             "(%s): gmem.torch.enable() falls back, with a warning" % (why_not, e))
    cached = _cached_path("gmem_torch_allocator", build[0], build[1], build[4], cxx)
    if os.path.isfile(cached):
        return "full (compiled at first use, cached)", "%s; compiled earlier: %s" % (why_not, cached)
    return "full (compile at first use)", ("%s; gmem.torch.enable() compiles it once with %s "
                                           "(about a minute) into %s" % (why_not, cxx, cache_dir()))


def load_allocator(torch):
    """Builds or finds gmem's CUDAAllocator and loads it (not yet installed): the ctypes library,
    with gmem_torch_allocator_install(char*, size_t) -> int."""
    choice = os.environ.get("GMEM_TORCH_ALLOCATOR", "")
    if choice == "0":
        raise ShimUnavailable("GMEM_TORCH_ALLOCATOR=0")
    _lib.lib()  # libgmem first: the allocator links to this very copy
    if choice not in ("", "1"):
        path = choice
    else:  # the install's build when it is for this torch, else compiled (once, cached)
        path, why_not = prebuilt_allocator(torch)
        if path is None:
            try:
                path = build_allocator(torch)
            except ShimUnavailable as e:
                raise ShimUnavailable("%s (and the install's build is not usable: %s)" % (e, why_not))
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
