"""`python -m gmem.doctor`: what gmem finds on this machine and what it will do, and why.

    python -m gmem.doctor

Prints, one finding a line with its reason: gmem's package and libgmem.so (and whether that was
built with the CUDA backend), the NVIDIA driver and its version, each GPU with its memory and
whether it supports virtual memory management (VMM: gmem maps pages; without it gmem grows in
cudaMalloc'd segments), torch's version and CUDA, which route gmem.torch.enable() will take to
become PyTorch's allocator (full: built at install, compiled at first use, or prebuilt through
GMEM_TORCH_ALLOCATOR; or the pluggable fallback) and why, and the GMEM_* variables set. The last
line is the verdict. Nothing is changed: no device memory is allocated and CUDA is not
initialised in PyTorch (the driver is asked directly, through ctypes).

The exit status is 0 whatever is found (a machine with no GPU is a finding, not a failure).
"""

import ctypes
import os
import sys

from . import _lib
from ._version import __version__

# CUdevice_attribute values (cuda.h).
_ATTR_CC_MAJOR = 75
_ATTR_CC_MINOR = 76
_ATTR_VMM = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_CUDA_ERROR_NO_DEVICE = 100


def _bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024.0


def library():
    """(path, why, built_with_cuda): the libgmem.so gmem loads, or (None, why not, None)."""
    env = os.environ.get("GMEM_LIBRARY")
    for path in _lib.candidate_paths():
        if os.path.isfile(path):
            why = ("GMEM_LIBRARY" if env else
                   "in the package" if os.path.dirname(path) == os.path.dirname(_lib.__file__)
                   else "the repository's CMake build")
            try:
                with open(path, "rb") as f:
                    # Only a library built without the CUDA backend carries this message.
                    cuda = b"gmem was built without CUDA" not in f.read()
            except OSError:
                cuda = None
            return path, why, cuda
    return None, "not found; looked at %s" % ", ".join(_lib.candidate_paths()), None


def driver():
    """(version string or None, why, devices): the NVIDIA driver through libcuda, and each GPU as
    a dict (index, name, total, cc, vmm). No driver, or no device, is said in `why`."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return None, ("no NVIDIA driver: libcuda.so.1 cannot be loaded (%s). No GPU here, or its "
                      "driver is not installed" % e), []
    version = ctypes.c_int(0)
    cuda.cuDriverGetVersion(ctypes.byref(version))
    text = "%d.%d" % (version.value // 1000, version.value % 1000 // 10)
    status = cuda.cuInit(0)
    if status == _CUDA_ERROR_NO_DEVICE:
        return text, "the driver is installed but sees no GPU (cuInit: no device)", []
    if status != 0:
        return text, "cuInit failed with CUDA error %d" % status, []
    count = ctypes.c_int(0)
    cuda.cuDeviceGetCount(ctypes.byref(count))
    devices = []
    for index in range(count.value):
        dev = ctypes.c_int(0)
        if cuda.cuDeviceGet(ctypes.byref(dev), index) != 0:
            continue
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGetName(name, len(name), dev)
        total = ctypes.c_size_t(0)
        cuda.cuDeviceTotalMem_v2(ctypes.byref(total), dev)

        def attribute(attr):
            value = ctypes.c_int(0)
            return value.value if cuda.cuDeviceGetAttribute(ctypes.byref(value), attr, dev) == 0 else None

        devices.append({"index": index, "name": name.value.decode(errors="replace"),
                        "total": total.value,
                        "cc": "%s.%s" % (attribute(_ATTR_CC_MAJOR), attribute(_ATTR_CC_MINOR)),
                        "vmm": attribute(_ATTR_VMM)})
    return text, "%d device%s" % (len(devices), "" if len(devices) == 1 else "s"), devices


def torch_finding():
    """(torch module or None, one line about it)."""
    try:
        import torch
    except ImportError as e:
        return None, ("not installed (%s): gmem.torch and python -m gmem.run need it (pip install "
                      "torch); the C API, the gmem command and GMEM_DEVICE=sim work without" % e)
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    return torch, "%s at %s, built for CUDA %s" % (torch.__version__,
                                                   os.path.dirname(torch.__file__), cuda)


def findings():
    """[(topic, finding)]: what main() prints, in order, the verdict last."""
    from . import _shim

    out = []
    here = os.path.dirname(os.path.abspath(__file__))
    out.append(("gmem", "%s, package %s" % (_version(), here)))
    lib_path, lib_why, lib_cuda = library()
    if lib_path is None:
        out.append(("libgmem", lib_why))
    else:
        out.append(("libgmem", "%s (%s)%s" % (
            lib_path, lib_why,
            "" if lib_cuda or lib_cuda is None else
            "; built WITHOUT the CUDA backend (CMake found no CUDA toolkit): it runs only the "
            "simulated device (GMEM_DEVICE=sim)")))
    version, driver_why, devices = driver()
    out.append(("driver", ("%s, %s" % (version, driver_why)) if version else driver_why))
    for d in devices:
        vmm = ("VMM yes: gmem maps pages (cuMemCreate/cuMemMap)" if d["vmm"] else
               "VMM no: gmem grows in cudaMalloc'd segments instead of mapping pages")
        out.append(("device %d" % d["index"], "%s, %s, compute %s; %s"
                    % (d["name"], _bytes(d["total"]), d["cc"], vmm)))
    torch, torch_why = torch_finding()
    out.append(("torch", torch_why))
    if torch is not None:
        route, route_why = _shim.allocator_route(torch)
        out.append(("allocator", "%s: %s" % (route, route_why)))
    else:
        record = _shim.prebuilt_record()
        route = None
        out.append(("allocator", "none without torch%s" % (
            "; at install: %s" % record.get("reason") if record and not record.get("built") else "")))
    settings = sorted((k, v) for k, v in os.environ.items() if k == "GMEM" or k.startswith("GMEM_"))
    out.append(("environment", ", ".join("%s=%s" % kv for kv in settings) if settings else
                "no GMEM variable set (python -m gmem.run --help lists them)"))
    out.append(("verdict", _verdict(lib_path, lib_cuda, devices, torch, route)))
    return out


def _verdict(lib_path, lib_cuda, devices, torch, route):
    if lib_path is None:
        return "gmem cannot run: libgmem.so is missing (pip install . from the repository builds it)"
    if not devices:
        return ("no GPU here: the gmem command (replay, leaks, summary) and the simulated device "
                "(GMEM_DEVICE=sim) work; gmem.torch needs a GPU")
    if lib_cuda is False:
        return "libgmem.so has no CUDA backend: rebuild it where the CUDA toolkit is installed"
    if torch is None:
        return "GPU ready for gmem's C API; install torch to use gmem as PyTorch's allocator"
    if route == "pluggable":
        return ("gmem.torch.enable() will work through CUDAPluggableAllocator: no CUDA graph pools "
                "(see 'allocator' above for why)")
    return "gmem.torch.enable() will install gmem's full allocator (%s)" % route


def _version():
    return __version__


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        sys.stdout.write(__doc__)
        return 0
    if argv:
        print("usage: python -m gmem.doctor   (no arguments)", file=sys.stderr)
        return 2
    rows = findings()
    width = max(len(topic) for topic, _ in rows)
    print("gmem doctor: what gmem finds here, and what it will do")
    for topic, text in rows:
        print("%-*s  %s" % (width, topic, text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
