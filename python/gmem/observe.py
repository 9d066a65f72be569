"""Who holds GPU memory, and why an allocation failed: tracking, scopes, snapshots, OOM reports.

    gmem.enable_tracking()                  # record every allocation from now on (cheap)
    with gmem.scope("validation"):          # tag what is allocated inside
        ...
    gmem.torch.track_modules(model)         # tag by module path, forward and backward
    for batch in loader:
        ...
        gmem.step()                         # a step ends: leak detection samples here
    gmem.snapshot()                         # dict (docs/snapshot-schema.md)
    gmem.dump_snapshot("mem.pickle")        # open at https://pytorch.org/memory_viz
    gmem.last_oom_report()                  # why the last allocation failed, and what to do
    gmem.leaks()                            # the leak findings so far, and the cause

Scopes and call sites are per thread. Python stacks are recorded where this module sets them
(scope entry, module calls with track_modules(stacks=True), set_frames()): PyTorch's allocator
calls gmem from C++, where no Python stack can be taken cheaply.

This module is the core the Python layer's features are built on, and imports none of them: they
plug in when imported (gmem/__init__ imports them all, so `import gmem` behaves as one piece).
gmem.distributed publishes this rank's row at step() through step_listeners; gmem._holders adds
who holds the leaked memory, and the processes on the device, to leaks() and last_oom_report()
through _set_report_sections().
"""

import contextlib
import ctypes
import json
import numbers
import os
import sys
import threading

from . import _lib
from ._format import _insert_sections
from .errors import InvalidArgumentError
from .memory import device_index

_status = ctypes.c_int
_size_p = ctypes.POINTER(ctypes.c_size_t)

# name: (restype, argtypes), from include/gmem/gmem_observe.h
_PROTOTYPES = {
    "gmem_tracking_enable": (_status, [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]),
    "gmem_python_stacks_skip": (_status, [ctypes.c_char_p]),
    "gmem_tracking_disable": (_status, [ctypes.c_int]),
    "gmem_tracking_enabled": (ctypes.c_int, [ctypes.c_int]),
    "gmem_scope_push": (_status, [ctypes.c_char_p]),
    "gmem_scope_push_module": (_status, [ctypes.c_char_p]),
    "gmem_scope_pop": (_status, []),
    "gmem_scope_depth": (ctypes.c_size_t, []),
    "gmem_scope_pop_to": (_status, [ctypes.c_size_t]),
    "gmem_set_frames": (_status, [ctypes.c_char_p]),
    "gmem_current_frames": (ctypes.c_uint32, []),
    "gmem_restore_frames": (_status, [ctypes.c_uint32]),
    "gmem_step": (_status, []),
    "gmem_annotate": (_status, [ctypes.c_char_p]),
    "gmem_graph_saved": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
    "gmem_graph_backward": (_status, []),
    "gmem_snapshot_json": (_status, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, _size_p]),
    "gmem_snapshot_pickle": (_status, [ctypes.c_int, ctypes.c_char_p]),
    "gmem_oom_report_text": (_status, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, _size_p]),
    "gmem_oom_report_json": (_status, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, _size_p]),
    "gmem_leaks_json": (_status, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, _size_p]),
    "gmem_top_sites_json": (_status, [ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p,
                                      ctypes.c_size_t, _size_p]),
}

_declared = threading.Lock()
_api = None


def _c():
    """libgmem with the observability prototypes declared."""
    global _api
    if _api is None:
        with _declared:
            if _api is None:
                lib = _lib.lib()
                for name, (restype, argtypes) in _PROTOTYPES.items():
                    try:
                        fn = getattr(lib, name)
                    except AttributeError as e:
                        raise _lib.GmemError("%s lacks %s: is it an older libgmem?"
                                             % (_lib.library_path(), name)) from e
                    fn.restype, fn.argtypes = restype, argtypes
                _api = lib
    return _api


def _count(value, what):
    """`value` as a size_t for C, or InvalidArgumentError: ctypes would wrap -1 or 2**64 + 16."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError("%s must be an int, not %r" % (what, value))
    if value < 0 or value > _lib.SIZE_MAX:
        raise InvalidArgumentError("%s must be between 0 and %d, not %d"
                                   % (what, _lib.SIZE_MAX, value))
    return int(value)


def _bytes(text):
    return text.encode("utf-8") if text is not None else None


# --- tracking ---------------------------------------------------------------------------------


_STACKS = {"thread": 0, "cpp": 1, "python": 2}


def enable_tracking(device=None, history=131072, backtrace=False, stacks="python"):
    """Records every allocation on `device` from now on: size, stream, time, step, scope and call
    site, plus a history of the last `history` events. Allocations made before stay untracked.

    history: events kept, oldest dropped first, 56 bytes of host memory each (the default: 7 MiB
    per tracked device). An allocation makes two events (alloc and free), so the default holds
    about 13 training steps of a Llama-style model (~9,400 events a step) or 40 of GPT-2 (~3,000):
    enough for leak detection. A snapshot of a longer run holds only the last `history` events and
    says so; gmem leaks / summary / replay rebuild what was live before them
    (docs/wrapped-histories.md). A ring larger than the CPU's L2 cache costs a few ns per malloc on
    some CPUs (docs/diagnostics.md).

    stacks: where call sites come from. "python" (the default): each allocation's Python stack,
    read by libgmem from C++ (PyTorch's operators included, which call the allocator with the
    GIL released; gmem's own files left out); threads without a Python stack (autograd's) use
    "thread". "thread": only what set_frames()/scope() set. "cpp" (or backtrace=True): a C++
    backtrace per allocation (slow: microseconds each)."""
    if backtrace:
        stacks = "cpp"
    if stacks not in _STACKS:
        raise ValueError("stacks must be one of %s, not %r" % (", ".join(_STACKS), stacks))
    _skip_own_files()
    _lib.check(_c().gmem_tracking_enable(device_index(device), _count(history, "history"),
                                         _STACKS[stacks]))


def disable_tracking(device=None):
    _lib.check(_c().gmem_tracking_disable(device_index(device)))


def is_tracking(device=None):
    enabled = _c().gmem_tracking_enabled(device_index(device))
    if enabled < 0:
        _lib.check(1)  # raises with gmem's message
    return enabled == 1


def step():
    """A training step ended. Steps number the allocations; leak detection compares steps.
    Also clears this thread's scopes left open by backward hooks that never fired."""
    _clear_backward_scopes()
    _lib.check(_c().gmem_step())
    for listener in tuple(step_listeners):
        listener()


# Called after each gmem.step(), in order. gmem.distributed puts itself first when imported: in a
# torch.distributed job, this rank's memory goes to the store, so that a rank that runs out of
# memory can say what the others held (gmem.distributed.peers). gmem.find_executable_batch_size
# stops a probe here.
step_listeners = []


def annotate(text):
    """A note in the history of every tracked device ("epoch 3", "eval starts")."""
    _lib.check(_c().gmem_annotate(_bytes(str(text))))


# --- call sites -------------------------------------------------------------------------------

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _skip_own_files():
    _lib.check(_c().gmem_python_stacks_skip(_bytes(_PACKAGE_DIR + os.sep)))


def python_stack(skip=0, limit=32):
    """The calling thread's Python stack as gmem's frames text: "file:line:function" lines,
    innermost first, without gmem's own frames."""
    frame = sys._getframe(skip + 1)
    lines = []
    while frame is not None and len(lines) < limit:
        code = frame.f_code
        if not os.path.abspath(code.co_filename).startswith(_PACKAGE_DIR + os.sep):
            lines.append("%s:%d:%s" % (code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return "\n".join(lines)


def set_frames(frames="stack"):
    """Sets this thread's call site for the allocations it makes next. "stack" (the default)
    takes the current Python stack; a str is "file:line:function" lines, innermost first; a list
    holds (filename, line, function) tuples, innermost first; None clears."""
    if frames == "stack":
        frames = python_stack(skip=1)
    elif isinstance(frames, (list, tuple)):
        frames = "\n".join("%s:%d:%s" % (f, int(line), name) for f, line, name in frames)
    _lib.check(_c().gmem_set_frames(_bytes(frames)))


# --- scopes -----------------------------------------------------------------------------------


class scope(contextlib.ContextDecorator):
    """Tags the allocations made inside with `name` (nested: "outer/name"); per thread.

        with gmem.scope("validation"):
            evaluate(model)

    stack=True also records the Python stack at entry as their call site."""

    def __init__(self, name, stack=True):
        if not name:
            raise ValueError("gmem.scope needs a non-empty name")
        self.name = str(name)
        self.stack = stack
        self._saved = threading.local()

    def __enter__(self):
        c = _c()
        saved = getattr(self._saved, "list", None)
        if saved is None:
            saved = self._saved.list = []
        saved.append((c.gmem_scope_depth(), c.gmem_current_frames()))
        _lib.check(c.gmem_scope_push(self.name.encode("utf-8")))
        if self.stack:
            c.gmem_set_frames(python_stack(skip=1).encode("utf-8"))
        return self

    def __exit__(self, *exc):
        depth, frames = self._saved.list.pop()
        c = _c()
        c.gmem_scope_pop_to(depth)
        c.gmem_restore_frames(frames)
        return False


# --- snapshots and OOM reports ------------------------------------------------------------------


def snapshot(device=None):
    """What gmem holds on `device` now, block by block, with the tracking history (when tracking
    is on), as a dict in gmem's schema (docs/snapshot-schema.md)."""
    return json.loads(_lib.text(_c().gmem_snapshot_json, device_index(device)))


def dump_snapshot(path, device=None):
    """Writes a snapshot as torch.cuda.memory._dump_snapshot() does (a pickle): drag it onto
    https://pytorch.org/memory_viz, or read it with torch.cuda._memory_viz."""
    _lib.check(_c().gmem_snapshot_pickle(device_index(device), os.fsencode(path)))


def last_oom_report(device=None, as_json=False):
    """The report of the last failed allocation (on any device when device is None): the
    request, the limit, the device's memory and who else holds it, what gmem holds, the cause
    with its evidence (leak, memory held outside gmem, batch too large, model and state too
    large, live memory, fragmentation: README, "What is the cause?"), the largest holders by scope
    and call site, leak suspects, and what to do, the fix for the cause first. A str (a dict with as_json=True); None if no
    allocation has failed."""
    dev = -1 if device is None else device_index(device)
    text = _raw_oom_report(dev)
    if text is None:
        return None
    # Who holds the leaked memory, and the processes on the device (gmem.holders): searched once
    # per OOM, at the OOM where gmem.run's observer ran, else now; never raises.
    sections = _report_sections
    if not as_json:
        return sections["oom_text"](text, dev) if sections["oom_text"] else text
    report = _raw_oom_json(dev)
    return sections["oom_json"](report, dev, text) if sections["oom_json"] else report


def _raw_oom_report(dev):
    """libgmem's OOM report text, without the Python layer's sections; None if none failed."""
    text = _lib.text(_c().gmem_oom_report_text, dev)
    return text or None


def _raw_oom_json(dev):
    """libgmem's OOM report as a dict, without the Python layer's sections (no holder search);
    None if none failed."""
    text = _lib.text(_c().gmem_oom_report_json, dev)
    return json.loads(text) if text else None


# --- leaks ---------------------------------------------------------------------------------------


class Leaks:
    """What gmem.leaks() returns: the leak findings so far, with the cause as OOM reports decide it.

    print(leaks) gives the report (`gmem leaks`' layout); len(leaks), iteration and leaks[i] give
    the findings (dicts: site, bytes_per_step, surviving_bytes, first_step, periods,
    growing_periods, first_seen_us, sample); leaks.as_dicts() gives them as a list;
    leaks.cause / leaks.evidence / leaks.steps the verdict and what it rests on."""

    def __init__(self, report, holders=None):
        self._report = report
        self.holders = holders  # a gmem.Holders, or None (leaks(holders=False), or no findings)
        self.text = report.pop("text")
        if holders is not None:
            self.text = _insert_sections(self.text, [str(holders)], holders.advice)
            for finding, target in zip(self.findings_of(report), holders.targets):
                finding["holders"] = target["groups"]
            report["holders"] = holders.as_dict()
        self.steps = report["periods"]
        self.cause = report["cause"]
        self.evidence = report["evidence"]
        self.findings = report["leaks"]

    @staticmethod
    def findings_of(report):
        return report["leaks"]

    def as_dicts(self):
        return [dict(f) for f in self.findings]

    def as_dict(self):
        """The whole report: steps, cause, evidence and the findings ("leaks")."""
        return dict(self._report)

    def __len__(self):
        return len(self.findings)

    def __iter__(self):
        return iter(self.findings)

    def __getitem__(self, index):
        return self.findings[index]

    def __bool__(self):
        return bool(self.findings)

    def __str__(self):
        return self.text

    def __repr__(self):
        sites = ", ".join("%s +%d B/step" % (f["site"], f["bytes_per_step"]) for f in self.findings)
        return "<gmem.Leaks: %d step(s), cause %s%s>" % (self.steps, self.cause,
                                                          ": " + sites if sites else "")


def top_sites(n=10, device=None):
    """The `n` call sites holding the most live memory, most first, named as summaries and OOM
    reports name them: [{"site", "bytes", "count"}]. [] when `device` is not tracked or holds no
    tracked allocation, with a warning that says which (an empty list alone reads as "nothing
    is held")."""
    sites = _top_sites(n, device)
    if not sites:
        import warnings
        where = "device %s" % (device_index(device) if device is not None else "(the current one)")
        if not is_tracking(device):
            why = ("%s is not tracked: call gmem.enable_tracking() first (allocations made before "
                   "it stay untracked)" % where)
        else:
            why = ("no allocation tracked on %s since tracking began is live now (is gmem the "
                   "allocator? gmem.torch.enable(), or python -m gmem.run)" % where)
        warnings.warn("gmem.top_sites: no sites: " + why, RuntimeWarning, stacklevel=2)
    return sites


def _top_sites(n, device):
    """top_sites without the warning, for gmem's own periodic use (gmem.distributed's rows)."""
    return json.loads(_lib.text(_c().gmem_top_sites_json, device_index(device), _count(n, "n")))


def leaks(device=None, holders=True):
    """The leak findings so far on `device` (tracking must be on; steps come from gmem.step(),
    or gmem.torch.watch()): the sites whose memory kept across steps grows step after step. A
    Leaks object: print it, or read .as_dicts(). Cheap enough to call every few steps (it looks
    at the sites' per-step totals, not at every block) with holders=False, or while nothing
    leaks. holders=True (the default): when there are findings, also what holds each one's
    blocks (gmem.holders: a bounded search of the Python heap, docs/holders.md), first in the
    advice; each finding gets "holders", the report .holders."""
    report = json.loads(_lib.text(_c().gmem_leaks_json, device_index(device)))
    found = None
    search = _report_sections["leak_holders"]
    if holders and report["leaks"] and search is not None:
        found = search(list(report["leaks"]), device)
    return Leaks(report, found)


# --- the sections gmem._holders adds --------------------------------------------------------------

# Set by gmem._holders when it is imported (gmem/__init__ imports it); None: the reports are
# libgmem's alone.
_report_sections = {"leak_holders": None, "oom_text": None, "oom_json": None}


def _set_report_sections(leak_holders, oom_text, oom_json):
    """How the layer above adds its sections to the reports, none of them raising:
    leak_holders(findings, device) -> gmem.Holders, what holds each leak finding's blocks (leaks());
    oom_text(report_text, device) -> the OOM report with the holders and processes sections;
    oom_json(report, device, report_text) -> the OOM report's dict with them (last_oom_report())."""
    _report_sections.update(leak_holders=leak_holders, oom_text=oom_text, oom_json=oom_json)


# --- modules (PyTorch) --------------------------------------------------------------------------

_backward = threading.local()  # per autograd thread: [[depth, path]] of open backward scopes


def _backward_stack():
    stack = getattr(_backward, "stack", None)
    if stack is None:
        stack = _backward.stack = []
    return stack


def _clear_backward_scopes():
    stack = _backward_stack()
    if stack:
        _c().gmem_scope_pop_to(stack[0][0])
        del stack[:]


def _tensors(value, out, limit=64):
    """The tensors in a module's inputs or outputs (nested tuples, lists, dicts), up to `limit`."""
    if len(out) >= limit:
        return out
    if hasattr(value, "register_hook") and hasattr(value, "requires_grad"):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out, limit)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out, limit)
    return out


class ModuleTracking:
    """What track_modules() returns: remove() takes its hooks off again."""

    def __init__(self, handles):
        self._handles = handles

    def remove(self):
        for handle in self._handles:
            handle.remove()
        del self._handles[:]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False


def track_modules(model, name="model", stacks=False):
    """Tags every allocation made in a module's forward and backward with the module's path
    ("model.transformer.h.3.mlp"), nested inside any gmem.scope. Summaries, snapshots and OOM
    reports group by it. stacks=True also records the Python stack at each module call (costs
    some microseconds per call).

    Backward is followed through tensor hooks (a module's backward starts when its output's
    gradient is computed, and ends when its input's is), not full backward hooks, which break
    models with in-place operations (ReLU(inplace=True) after a hooked module)."""
    c = _c()
    handles = []
    root = model
    for path, module in model.named_modules(prefix=name):
        encoded = path.encode("utf-8")
        forward_saved = threading.local()

        def pre_hook(module, args, _path=encoded, _saved=forward_saved):
            saved = getattr(_saved, "list", None)
            if saved is None:
                saved = _saved.list = []
            saved.append((c.gmem_scope_depth(), c.gmem_current_frames()))
            c.gmem_scope_push_module(_path)
            if stacks:
                c.gmem_set_frames(python_stack(skip=1).encode("utf-8"))

        def post_hook(module, args, output, _path=encoded, _saved=forward_saved):
            saved = getattr(_saved, "list", None)
            if saved:
                depth, frames = saved.pop()
                c.gmem_scope_pop_to(depth)
                c.gmem_restore_frames(frames)
            _hook_backward(module is root, _path, args, output)

        handles.append(module.register_forward_pre_hook(pre_hook))
        handles.append(module.register_forward_hook(post_hook))
    return ModuleTracking(handles)


def _hook_backward(is_root, path, args, output):
    outputs = [t for t in _tensors(output, []) if t.requires_grad]
    if not outputs:
        return  # no_grad / inference: no backward
    inputs = [t for t in _tensors(args, []) if t.requires_grad]
    state = {"entry": None, "left": False}
    c = _c()

    def start(grad):
        # The first of the module's output gradients: its backward begins (on this thread).
        if state["entry"] is not None:
            return None
        if is_root:
            _clear_backward_scopes()  # a new backward pass: drop what the last one left open
        entry = [c.gmem_scope_depth(), path]
        c.gmem_scope_push_module(path)
        _backward_stack().append(entry)
        state["entry"] = entry
        return None

    def end(grad):
        # The first of its input gradients: its backward is over. Modules that began after it
        # and go on (their input is this one's output) are entered again on top.
        entry = state["entry"]
        if entry is None or state["left"]:
            return None
        state["left"] = True
        stack = _backward_stack()
        at = next((i for i, e in enumerate(stack) if e is entry), None)
        if at is None:
            return None  # a later backward pass cleared it
        above = stack[at + 1:]
        del stack[at:]
        c.gmem_scope_pop_to(entry[0])
        for e in above:
            e[0] = c.gmem_scope_depth()
            c.gmem_scope_push_module(e[1])
            stack.append(e)
        return None

    for t in outputs:
        t.register_hook(start)
    for t in inputs:
        t.register_hook(end)
