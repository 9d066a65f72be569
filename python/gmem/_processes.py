"""The processes that hold memory on a device outside gmem (gmem.processes), through NVML loaded
at run time (gmem.Nvml; GMEM_NVML names another library, or 0 to leave NVML out), each related
to this process: itself, a child, a sibling rank, or another that looks like a leftover."""

import ctypes
import os

from ._format import format_bytes
from .memory import _device_ordinal


class _ProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_t as nvmlDeviceGetComputeRunningProcesses_v3 fills it (nvml.h, CUDA 12).
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class _ProcessInfoV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


_NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE


class Nvml:
    """NVML, loaded at run time as the driver is (libnvidia-ml.so.1). device_processes(index)
    gives [(pid, bytes or None)] of the processes with a compute context on an NVML device.
    Tests pass a fake with the same method to gmem.processes(nvml=...)."""

    def __init__(self, path="libnvidia-ml.so.1"):
        self.lib = ctypes.CDLL(path)  # OSError where there is no NVIDIA driver
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")

    def _check(self, status, what):
        if status != 0:
            text = ""
            try:
                fn = self.lib.nvmlErrorString
                fn.restype = ctypes.c_char_p
                text = (fn(status) or b"").decode("utf-8", "replace")
            except Exception:
                pass
            raise OSError("%s failed: %s (NVML status %d)" % (what, text, status))

    def handle(self, index):
        handle = ctypes.c_void_p()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            entries = [e.strip() for e in visible.split(",") if e.strip()]
            if index < len(entries):
                entry = entries[index]
                if entry.isdigit():
                    index = int(entry)
                else:
                    self._check(self.lib.nvmlDeviceGetHandleByUUID(entry.encode(),
                                                                   ctypes.byref(handle)),
                                "nvmlDeviceGetHandleByUUID")
                    return handle
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index),
                                                           ctypes.byref(handle)),
                    "nvmlDeviceGetHandleByIndex_v2")
        return handle

    def device_processes(self, index):
        handle = self.handle(index)
        for name, struct in (("nvmlDeviceGetComputeRunningProcesses_v3", _ProcessInfo),
                             ("nvmlDeviceGetComputeRunningProcesses_v2", _ProcessInfo),
                             ("nvmlDeviceGetComputeRunningProcesses", _ProcessInfoV1)):
            fn = getattr(self.lib, name, None)
            if fn is None:
                continue
            count = ctypes.c_uint(64)
            while True:
                infos = (struct * count.value)()
                status = fn(handle, ctypes.byref(count), infos)
                if status == 7:  # NVML_ERROR_INSUFFICIENT_SIZE: more processes since
                    count = ctypes.c_uint(count.value + 16)
                    continue
                self._check(status, name)
                break
            return [(int(i.pid), None if i.usedGpuMemory == _NOT_AVAILABLE else int(i.usedGpuMemory))
                    for i in infos[:count.value]]
        raise OSError("NVML has no nvmlDeviceGetComputeRunningProcesses")


def _proc(pid):
    """{"ppid", "command"} from /proc, or None where the process is not visible from here."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            command = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        return {"ppid": ppid, "command": command}
    except (OSError, ValueError, IndexError):
        return None


class Processes:
    """What gmem.processes() returns: the processes with memory on the device. print() it;
    .available (NVML answered), .why (why not), .rows [{"pid", "command", "bytes", "relation",
    "leftover"}], .as_dict()."""

    def __init__(self, device, rows=(), available=True, why=None):
        self.device = device
        self.rows = list(rows)
        self.available = available
        self.why = why

    def as_dict(self):
        return {"device": self.device, "available": self.available, "why": self.why,
                "processes": self.rows}

    def __str__(self):
        if not self.available:
            return "Processes on device %d: unknown: %s" % (self.device, self.why)
        if not self.rows:
            return "Processes on device %d (NVML): none with a compute context" % self.device
        lines = ["Processes on device %d (NVML):" % self.device]
        for r in self.rows:
            lines.append("  %10s  pid %-7d %s: %s" % (
                format_bytes(r["bytes"]) if r["bytes"] is not None else "? B", r["pid"],
                r["relation"], r["command"] or "(command not visible from here)"))
        return "\n".join(lines)

    def __repr__(self):
        return "<gmem.Processes: device %d, %s>" % (
            self.device, "%d process(es)" % len(self.rows) if self.available else self.why)


def processes(device=None, nvml=None, proc=None):
    """The processes holding memory on `device`, through NVML (loaded at run time; none where
    there is no NVIDIA driver, and the result says so): pid, command, bytes, and how each relates
    to this one: this process, a child of it (a DataLoader worker that touched CUDA), a sibling
    (another rank of the same launcher), or another, marked as a leftover when it looks like one
    (orphaned, or running this same command outside this job). nvml: an object with
    device_processes(index) -> [(pid, bytes)] (tests); proc: pid -> {"ppid", "command"} or None."""
    index = _device_ordinal(device)
    proc = proc or _proc
    try:
        if nvml is None:
            # GMEM_NVML: another path to the library, or 0 to leave NVML out (tests that must
            # read the same on machines with and without a driver).
            path = os.environ.get("GMEM_NVML", "libnvidia-ml.so.1")
            if path == "0":
                return Processes(index, available=False,
                                 why="NVML is not available here (left out: GMEM_NVML=0)")
            nvml = Nvml(path)
        found = nvml.device_processes(index)
    except OSError as e:
        why = str(e)
        if "libnvidia-ml" in why or "cannot open" in why:
            why = "NVML is not available here (no NVIDIA driver: libnvidia-ml.so.1 not found)"
        return Processes(index, available=False, why=why)
    except Exception as e:
        return Processes(index, available=False, why="NVML failed: %s: %s" % (type(e).__name__, e))
    me = os.getpid()
    mine = proc(me) or {"ppid": os.getppid(), "command": ""}
    ancestors = set()
    pid = mine["ppid"]
    for _ in range(64):
        if pid in (0, 1) or pid in ancestors:
            break
        ancestors.add(pid)
        info = proc(pid)
        pid = info["ppid"] if info else 0
    rows = []
    for pid, used in found:
        info = proc(pid)
        row = {"pid": pid, "bytes": used, "command": info["command"] if info else None,
               "leftover": False}
        if pid == me:
            row["relation"] = "this process"
        elif info is None:
            row["relation"] = "not visible from here (another container or user)"
        else:
            chain, p = [], info["ppid"]
            for _ in range(64):
                if p in (0, 1) or p == me or p in chain:
                    break
                chain.append(p)
                parent = proc(p)
                p = parent["ppid"] if parent else 0
            if p == me:
                forked = info["command"] == mine["command"]
                row["relation"] = ("child of this process%s" % (
                    " (forked: a DataLoader worker?)" if forked else ""))
            elif info["ppid"] == mine["ppid"] and info["ppid"] not in (0, 1):
                row["relation"] = "sibling (same parent: another rank of this job?)"
            elif pid in ancestors:
                row["relation"] = "a parent of this process"
            else:
                orphan = info["ppid"] in (0, 1)
                same = bool(mine["command"]) and info["command"] == mine["command"]
                row["leftover"] = orphan or same
                row["relation"] = "another process" + (
                    ", looks like a leftover (%s)" % ("orphaned" if orphan else
                                                     "this same command, outside this job")
                    if row["leftover"] else "")
        rows.append(row)
    rows.sort(key=lambda r: -(r["bytes"] or 0))
    return Processes(index, rows)


def _safe_processes(device=None, nvml=None):
    try:
        return processes(device, nvml)
    except Exception as e:
        return Processes(0, available=False, why="failed: %s: %s" % (type(e).__name__, e))
