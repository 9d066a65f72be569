"""Who holds it: the Python objects that keep GPU memory alive, and the processes that hold memory
outside gmem (docs/holders.md).

    print(gmem.holders())                 # for each leak finding: what keeps its blocks alive
    gmem.holders(0x7f0000800000)          # the block at (or containing) an address
    gmem.holders("train.py:173:train")    # the live blocks of a site, as leak findings name it
    print(gmem.processes())               # the processes on the device, through NVML

The search runs only when asked for (these calls, gmem.leaks(), gmem.memory_summary(), an OOM
report): nothing is added to malloc or free. It finds the objects that expose device memory
(torch tensors and their views, by their storage; anything with __cuda_array_interface__ or
DLPack), maps them to gmem's live blocks, and follows their referrers (gc.get_referrers, one pass
over the heap per level) up to a root a person recognises: a module global, a local of a live
frame, a closure of a function defined at file:line, an nn.Module attribute by path, a hook on a
module, an optimizer's state, or the autograd graph of a tensor that is itself held. It is
bounded in time and in objects visited, and says so when it stops at the bound.
"""

import collections
import ctypes
import gc
import json
import os
import sys
import threading
import time
import types

from . import _lib
from ._summary import format_bytes
from .memory import _device_ordinal, device_index

DEFAULT_TIMEOUT = 2.0            # seconds
DEFAULT_MAX_OBJECTS = 50000000   # objects visited (one heap pass visits every tracked object)
MAX_DEPTH = 16                   # referrer levels followed up from an object
MAX_PARENTS = 6                  # referrers kept per object (the chains to choose from)
MAX_NEW_PER_LEVEL = 200000       # objects added to the search per level
MAX_GRAPH_NODES = 200000         # autograd nodes walked

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

# nn.Module's hook dicts, by attribute: what the reader calls them.
_HOOK_ATTRS = {
    "_forward_hooks": "forward hook",
    "_forward_hooks_with_kwargs": "forward hook",
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_pre_hooks_with_kwargs": "forward pre-hook",
    "_backward_hooks": "backward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_state_dict_hooks": "state-dict hook",
    "_load_state_dict_pre_hooks": "load-state-dict hook",
}
_MODULE_CONTAINERS = ("_modules", "_parameters", "_buffers")

_lock = threading.RLock()  # one search at a time (they are bounded; a second waits for the first)


# --- blocks ---------------------------------------------------------------------------------------

_live_fn = None


def _live_blocks(device, site=None):
    """{"tracked", "step", "blocks": [{"address", "size", ...}]} from libgmem (without the
    history a snapshot carries)."""
    global _live_fn
    if _live_fn is None:
        lib = _lib.lib()
        try:
            fn = lib.gmem_live_blocks_json
        except AttributeError as e:
            raise _lib.GmemError("%s lacks gmem_live_blocks_json: is it an older libgmem? "
                                 "(rebuild it)" % _lib.library_path()) from e
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                       ctypes.POINTER(ctypes.c_size_t)]
        _live_fn = fn
    return json.loads(_lib.text(_live_fn, device, site.encode("utf-8") if site else None))


# --- objects that expose device memory ------------------------------------------------------------

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


# --- roots and edges ------------------------------------------------------------------------------

def _is_module_object(obj):
    d = _instance_dict(obj)
    return d is not None and "_modules" in d and "_forward_hooks" in d


def _is_optimizer(obj):
    d = _instance_dict(obj)
    return d is not None and "param_groups" in d and "state" in d


def _instance_dict(obj):
    if isinstance(obj, (type, types.ModuleType, types.FunctionType, dict, list, tuple)):
        return None
    try:
        d = object.__getattribute__(obj, "__dict__")
    except Exception:
        return None
    return d if isinstance(d, dict) else None


def _short(path):
    return os.path.basename(path) if path else "?"


def _frame_where(frame):
    code = frame.f_code
    return "%s() (%s:%d)" % (code.co_name, _short(code.co_filename), frame.f_lineno)


def _function_where(fn):
    code = getattr(fn, "__code__", None)
    if code is None:
        return "`%s`" % getattr(fn, "__qualname__", type(fn).__name__)
    return "`%s` (%s:%d)" % (code.co_name, _short(code.co_filename), code.co_firstlineno)


def _key_text(key):
    if isinstance(key, str):
        return key
    if isinstance(key, (int, float, bool)) or key is None:
        return repr(key)
    return "<%s>" % type(key).__name__


def _edge(parent, child):
    """How `parent` refers to `child`: (kind, name)."""
    try:
        if isinstance(parent, types.FrameType):
            wanted = child.cell_contents if isinstance(child, types.CellType) else child
            for name, value in parent.f_locals.items():
                if value is wanted:
                    return "local", name
            return "local", "?"
        if isinstance(parent, dict):
            for k, v in list(parent.items()):
                if v is child:
                    return "key", k
                if k is child:
                    return "dictkey", k
            return "ref", None
        if isinstance(parent, (list, tuple, collections.deque)):
            for i, v in enumerate(list(parent)):
                if v is child:
                    return "index", i
            return "ref", None
        if isinstance(parent, (set, frozenset)):
            return "item", None
        if isinstance(parent, types.CellType):
            return "cell", None
        if isinstance(parent, types.FunctionType):
            if parent.__closure__ is child:
                return "closure", None
            if parent.__defaults__ is child or parent.__kwdefaults__ is child:
                return "defaults", None
            return "ref", None
        if isinstance(parent, types.MethodType):
            return ("self", None) if parent.__self__ is child else ("ref", None)
        d = _instance_dict(parent)
        if d is not None:
            if d is child:
                return "__dict__", None
            for k, v in list(d.items()):
                if v is child:
                    return "attr", k
        for name in getattr(type(parent), "__slots__", ()) or ():
            if getattr(parent, name, None) is child:
                return "attr", name
    except Exception:
        pass
    return "ref", None


# --- the search -----------------------------------------------------------------------------------

class _Search:
    """One holder search over the heap: exposing objects -> blocks, referrers -> roots."""

    def __init__(self, timeout, max_objects):
        self.start = time.monotonic()
        self.deadline = self.start + timeout
        self.timeout = timeout
        self.max_objects = max_objects
        self.visited = 0
        self.passes = 0
        self.bound = None          # why the search stopped early, if it did
        self.nodes = {}            # id -> object: everything the search keeps alive while it runs
        self.parents = {}          # id -> [ids of referrers]
        self.heap = 0
        self.module_dicts = {}     # id(module.__dict__) -> module name
        self.frames = []           # live frames, materialized (3.11+ frames are objects only so)
        self.ignore = set()        # ids of the search's own containers, kept alive in .keep
        self.keep = []

    def elapsed_ms(self):
        return (time.monotonic() - self.start) * 1000.0

    def over(self, next_cost):
        if time.monotonic() > self.deadline:
            self.bound = "its time bound (%.1f s)" % self.timeout
        elif self.visited + next_cost > self.max_objects:
            self.bound = "its bound of %d objects visited" % self.max_objects
        return self.bound is not None

    def own(self, obj):
        """The search's own container: never a holder. Kept alive until the search ends, so
        that its id cannot name another object meanwhile."""
        self.ignore.add(id(obj))
        self.keep.append(obj)
        return obj

    def scan(self, wanted):
        """Every object exposing device memory inside one of `wanted`'s blocks (sorted
        [(address, size, block)]): {block address: [(object, address, bytes, view bytes)]}; and
        the tensors that have an autograd graph (for the graph pass)."""
        import bisect
        starts = [b[0] for b in wanted]
        found, graphs, cache = self.own({}), self.own([]), {}
        objects = gc.get_objects()
        self.heap = len(objects)
        self.visited += len(objects)
        self.passes += 1
        for obj in objects:
            kind = _kind_of_type(type(obj), cache)
            if kind is None:
                continue
            memory = _memory_of(obj, kind)
            if memory is None:
                continue
            ptr, size, own = memory
            if kind == "tensor":
                try:
                    if obj.grad_fn is not None:
                        graphs.append(obj)
                except Exception:
                    pass
            i = bisect.bisect_right(starts, ptr) - 1
            if i < 0:
                continue
            start, length, block = wanted[i]
            if ptr < start + length:
                entries = found.get(start)
                if entries is None:
                    entries = found[start] = self.own([])
                entries.append(self.own((obj, ptr, size, own)))
        del objects
        return found, graphs

    def prepare_roots(self):
        for name, module in list(sys.modules.items()):
            d = getattr(module, "__dict__", None) if module is not None else None
            if isinstance(d, dict):
                self.module_dicts[id(d)] = name
        for frame in list(sys._current_frames().values()):
            while frame is not None:
                if not frame.f_code.co_filename.startswith(_PACKAGE_DIR):
                    self.frames.append(frame)
                frame = frame.f_back
        self.own(self.frames)

    def is_root(self, obj):
        return (isinstance(obj, (types.FrameType, type, types.ModuleType))
                or (isinstance(obj, dict) and id(obj) in self.module_dicts)
                or (isinstance(obj, dict) and "__builtins__" in obj and "__name__" in obj))

    def ours(self, obj):
        if id(obj) in self.ignore:
            return True
        if isinstance(obj, types.FrameType):
            return obj.f_code.co_filename.startswith(_PACKAGE_DIR)
        return False

    def climb(self, sources):
        """Follows referrers up from `sources`, level by level, one heap pass per level."""
        frontier = [s for s in sources if not self.is_root(s)]
        for s in sources:
            self.nodes[id(s)] = s
        self.own(frontier)
        self.own(sources)
        self.own(self.nodes)
        self.own(self.parents)
        depth = 0
        while frontier and depth < MAX_DEPTH:
            if self.over(self.heap):
                break
            depth += 1
            wanted = tuple(frontier)
            self.own(wanted)
            ids = set(id(o) for o in wanted)
            referrers = gc.get_referrers(*wanted)
            self.own(referrers)
            self.visited += self.heap
            self.passes += 1
            # Frames first: the locals of a running function are visible to gc only through its
            # frame object (3.11+ makes those lazily).
            for frame in self.frames:
                try:
                    values = list(frame.f_locals.values())
                except Exception:
                    continue
                for v in values:
                    if id(v) in ids:
                        self.link(v, frame)
            values = v = None  # not a referrer at the next level
            following = []
            self.own(following)
            for r in referrers:
                # `wanted` is also the call's argument tuple (CPython passes an exact tuple as is)
                if self.ours(r) or r is wanted:
                    continue
                try:
                    referents = gc.get_referents(r)
                except Exception:
                    continue
                linked = False
                for c in referents:
                    if id(c) in ids:
                        self.link(c, r)
                        linked = True
                referents = c = None
                if not linked:
                    continue
                if id(r) not in self.nodes:
                    self.nodes[id(r)] = r
                    if not self.is_root(r):
                        if len(following) >= MAX_NEW_PER_LEVEL:
                            self.bound = "its bound of %d new objects a level" % MAX_NEW_PER_LEVEL
                            continue
                        following.append(r)
            frontier = following
            r = None
            if self.bound:
                break

    def link(self, child, parent):
        if isinstance(parent, types.FrameType):
            self.nodes.setdefault(id(parent), parent)
        lst = self.parents.setdefault(id(child), [])
        if id(parent) not in lst and len(lst) < MAX_PARENTS:
            lst.append(id(parent))

    # A chain goes from an object up to its root; its score prefers recognisable roots.
    def root_score(self, obj):
        if isinstance(obj, dict):
            return 4
        if isinstance(obj, (type, types.ModuleType)):
            return 3
        if isinstance(obj, types.FrameType):
            return 2
        return 0

    def best_chain(self, oid, memo, path):
        if oid in memo:
            return memo[oid]
        obj = self.nodes.get(oid)
        if obj is None:
            return (0, ())
        if self.is_root(obj):
            result = (self.root_score(obj), (oid,))
            memo[oid] = result
            return result
        path.add(oid)
        best = None
        for pid in self.parents.get(oid, ()):
            if pid in path or len(path) > MAX_DEPTH + 2:
                continue
            score, chain = self.best_chain(pid, memo, path)
            if isinstance(obj, types.FunctionType) and score > 0:
                score += 2  # a closure or a hook names the code that keeps it
            candidate = (score, (oid,) + chain)
            if best is None or (candidate[0], -len(candidate[1])) > (best[0], -len(best[1])):
                best = candidate
        path.discard(oid)
        result = best if best is not None else (0, (oid,))
        memo[oid] = result
        return result

    # --- autograd graphs ---------------------------------------------------------------------------

    def graph_pass(self, graphs, unheld):
        """For blocks nothing in Python refers to: the held tensors whose autograd graph saved
        them. {block start: (holding tensor, node name)}."""
        found = self.own({})
        if not graphs or not unheld:
            return found
        import bisect
        starts = sorted(unheld)
        seen = set()
        names_of = {}
        nodes = 0
        quiet = _quiet_unpack()
        try:
            for tensor in graphs:
                if len(found) == len(starts) or self.over(0) or nodes > MAX_GRAPH_NODES:
                    break
                stack = [tensor.grad_fn]
                while stack and nodes <= MAX_GRAPH_NODES:
                    node = stack.pop()
                    if node is None or id(node) in seen:
                        continue
                    seen.add(id(node))
                    self.own(node)
                    nodes += 1
                    tp = type(node)
                    names = names_of.get(tp)
                    if names is None:
                        names = names_of[tp] = [n for n in dir(tp) if n.startswith("_saved_")]
                    for name in names:
                        try:
                            value = getattr(node, name)
                        except Exception:
                            continue
                        for t in (value if isinstance(value, (list, tuple)) else (value,)):
                            memory = _memory_of(t, "tensor") if hasattr(t, "untyped_storage") else None
                            if memory is None:
                                continue
                            i = bisect.bisect_right(starts, memory[0]) - 1
                            if i >= 0 and starts[i] == memory[0] and starts[i] not in found:
                                found[starts[i]] = self.own((tensor, tp.__name__))
                    try:
                        stack.extend(n for n, _ in node.next_functions)
                    except Exception:
                        pass
        finally:
            quiet.close()
        self.visited += nodes
        return found

    # --- what a chain says -------------------------------------------------------------------------

    def describe(self, chain):
        """(holder text, kind, name) for a chain (object first, root last)."""
        objs = [self.nodes[i] for i in chain]
        if len(objs) < 2:
            return ("nothing in Python refers to it (held from C or C++: an extension, an "
                    "autograd graph, a CUDA graph)", "none", None)
        root = objs[-1]
        phrases = []          # root-first landmarks
        expr = None           # how the current object is reached, as Python would spell it
        owner = None          # the instance whose __dict__ is the current object
        pending = None        # ("hook", text, module expr) / ("opt", expr, type) / ("closure", fn)
        leaf = None
        for k in range(len(objs) - 1, 0, -1):
            parent, child = objs[k], objs[k - 1]
            kind, name = _edge(parent, child)
            last = k == 1
            if k == len(objs) - 1:  # the root
                if isinstance(parent, types.FrameType):
                    expr = name
                    root_phrase = "local `%s` of %s" % (name, _frame_where(parent))
                elif isinstance(parent, dict):
                    mod = self.module_dicts.get(id(parent)) or parent.get("__name__", "?")
                    expr = _key_text(name)
                    f = parent.get("__file__")
                    where = _short(f) if f and mod == "__main__" else mod
                    root_phrase = "global `%s` in %s" % (expr, where)
                elif isinstance(parent, type):
                    # A class attribute: the class's namespace dict comes next.
                    expr = parent.__name__
                    root_phrase = "class `%s`" % expr
                    owner = parent
                else:
                    expr = "<%s>" % type(parent).__name__
                    root_phrase = ("a %s that nothing in Python refers to (held from C or C++)"
                                   % type(parent).__name__)
                phrases.append(root_phrase)
                if last:
                    leaf = root_phrase
                continue
            if kind == "__dict__":
                owner = parent
                continue
            holder = parent
            if owner is not None and isinstance(parent, dict):
                holder = owner  # an instance's __dict__: its keys are attributes
                if kind == "key":
                    kind = "attr"
            owner = None
            if isinstance(parent, types.FunctionType) and kind == "closure":
                pending = ("closure", parent)
                continue
            if isinstance(parent, tuple) and pending and pending[0] == "closure":
                fn = pending[1]
                try:
                    name = fn.__code__.co_freevars[name]
                except Exception:
                    name = "?"
                phrases.append("closure of %s" % _function_where(fn))
                expr = name
                pending = None
                if last:
                    leaf = "closure variable `%s` of %s" % (name, _function_where(fn))
                continue
            if isinstance(parent, types.CellType):
                continue
            if kind == "attr" and _is_module_object(holder):
                if name in _HOOK_ATTRS:
                    pending = ("hook", _HOOK_ATTRS[name], expr)
                    continue
                if name in _MODULE_CONTAINERS:
                    pending = ("module", name, expr)
                    continue
            if kind == "attr" and _is_optimizer(holder) and name == "state":
                pending = ("opt", expr, type(holder).__name__)
                continue
            if kind == "key" and pending and pending[0] == "hook":
                phrases.append("%s on %s" % (pending[1], pending[2]))
                expr = "<hook>"
                pending = None
                continue
            if kind == "key" and pending and pending[0] == "module":
                expr = "%s.%s" % (pending[2], _key_text(name))
                pending = None
                if last:
                    leaf = "attribute `%s`" % expr
                continue
            if kind == "key" and pending and pending[0] == "opt":
                phrases.append("state of optimizer `%s` (%s)" % (pending[1], pending[2]))
                expr = "%s.state[<param>]" % pending[1]
                pending = None
                continue
            pending = None
            if kind == "attr":
                expr = "%s.%s" % (expr, name)
                if last:
                    leaf = "attribute `%s`" % expr
            elif kind == "key":
                if not last:
                    expr = "%s[%r]" % (expr, name) if isinstance(name, str) else "%s[...]" % expr
                elif isinstance(parent, dict):
                    leaf = "%s `%s`" % (type(parent).__name__, expr)
            elif kind == "index":
                if not last and not expr.endswith("[...]"):  # nested lists: one group
                    expr = "%s[...]" % expr
                else:
                    leaf = "%s `%s`" % (type(parent).__name__, expr)
            elif kind == "self":
                expr = "%s.__self__" % expr
            else:
                if last:
                    leaf = "%s `%s`" % (type(parent).__name__, expr)
                expr = "%s.<%s>" % (expr, type(child).__name__)
            if last and leaf is None:
                leaf = "%s `%s`" % (type(parent).__name__, expr)
        # Innermost first: the holder, then the code and module it hangs from, then the root.
        texts = [leaf] + [p for p in reversed(phrases) if p != leaf]
        if len(texts) == 2 and texts[1].startswith(("global `", "local `")) and \
                "`%s`" % texts[1].split("`")[1] in leaf:
            # "list `losses` (a global in train.py)", not the name twice
            texts = ["%s (%s)" % (leaf, texts[1].replace("`%s` " % texts[1].split("`")[1], "", 1))]
        kind = "global" if isinstance(root, dict) else "local" if isinstance(root, types.FrameType) \
            else "class"
        if any(p.startswith("closure of") for p in phrases):
            kind = "closure"
        if any(" hook on " in p for p in phrases):
            kind = "hook"
        if any(p.startswith("state of optimizer") for p in phrases):
            kind = "optimizer"
        name = leaf.split("`")[1] if leaf and "`" in leaf else None
        if kind in ("global", "local") and name and "." in name:
            kind = "attribute"  # reached through an attribute (model.2.cache, trainer.cache)
        return " ← ".join(texts), kind, name


class _quiet_unpack:
    """gmem.torch.track_graphs' unpack hook leaves the blocks alone while the graph pass reads
    saved tensors (reading one is not a backward pass)."""

    def __init__(self):
        module = sys.modules.get("gmem.torch")
        self.flag = getattr(module, "_reading_saved", None)
        if self.flag is not None:
            self.flag.on = True

    def close(self):
        if self.flag is not None:
            self.flag.on = False


# --- results --------------------------------------------------------------------------------------

def _advice(kind, name, holder, what):
    name = name or "it"
    if kind == "graph":
        return ("`%s` keeps each tensor's autograd graph (%s): for inference, run it under "
                "torch.no_grad(); to keep a loss or a metric, keep `loss.item()` or "
                "`loss.detach()`, not the tensor with its graph" % (name, what))
    if kind == "hook":
        return ("`%s` keeps every output its hook sees (%s): append `o.detach().cpu()`, or remove "
                "the hook" % (name, what))
    if kind == "closure":
        return ("`%s`, kept by a closure, keeps %s: keep `t.detach().cpu()` or `.item()`, or "
                "clear it each step" % (name, what))
    if kind == "optimizer":
        return ("the optimizer's state keeps %s: it is meant to stay (made once per parameter); "
                "if it grows, parameters are being added" % what)
    if kind == "attribute":
        return ("`%s` keeps %s across steps: bound it, detach what it keeps, or keep it on the "
                "CPU" % (name, what))
    if kind == "local":
        return "`%s` (a local variable) keeps %s: `del %s` when done with it" % (name, what, name)
    if kind == "none":
        return None
    return ("`%s` keeps %s across steps: keep `t.detach().cpu()` or `.item()` in it, or clear "
            "it each step" % (name, what))


class Holders:
    """What gmem.holders() returns: for each target (a leak finding's site, an address, a site),
    its blocks grouped by what holds them. print() it for the report; .targets gives dicts:
    {"target", "blocks", "bytes", "groups": [{"holder", "kind", "name", "objects", "blocks",
    "bytes", "advice"}]}; .advice, .visited (objects), .ms, .bound (None, or why the search
    stopped early), .notes; .as_dict()."""

    def __init__(self, targets, visited=0, ms=0.0, bound=None, notes=(), heap=0):
        self.targets = targets
        self.visited = visited
        self.ms = ms
        self.bound = bound
        self.heap = heap
        self.notes = list(notes)

    @property
    def advice(self):
        """The holders' fixes, largest first, for holders of at least a quarter of what their
        target leaked (a finding's memory kept across steps; for other targets, all their
        bytes): a small holder (a local that happens to reference one block at the moment of
        the search) must not push the cause's own fix down. Every holder stays in the report's
        "Who holds it" section."""
        out = []
        for t in self.targets:
            for g in t["groups"]:
                major = 4 * g["bytes"] >= (t.get("leaked_bytes") or t.get("bytes", 0))
                if g.get("advice") and major and g["advice"] not in out:
                    out.append(g["advice"])
        return out

    def groups(self, target):
        for t in self.targets:
            if t["target"] == target:
                return t["groups"]
        return []

    def as_dict(self):
        return {"targets": self.targets, "visited": self.visited, "ms": round(self.ms, 1),
                "bound": self.bound, "heap_objects": self.heap, "notes": self.notes,
                "advice": self.advice}

    def header(self):
        head = "Who holds it (Python objects that reference the memory; %d objects visited in %.0f ms" \
            % (self.visited, self.ms)
        if self.bound:
            head += "; the search stopped at %s: chains may end short of their root" % self.bound
        return head + "):"

    def __str__(self):
        lines = [self.header()]
        for note in self.notes:
            lines.append("  " + note)
        for t in self.targets:
            lines.append("  %s: %d block%s, %s" % (t["target"], t["blocks"],
                                                  "" if t["blocks"] == 1 else "s",
                                                  format_bytes(t["bytes"])))
            if t.get("why"):
                lines.append("    " + t["why"])
            for g in t["groups"]:
                if g["kind"] == "none":
                    lines.append("    %s, %s: %s" % (_count(g["blocks"], "block"),
                                                     format_bytes(g["bytes"]), g["holder"]))
                    continue
                what = _count(g["objects"], g["noun"]) + (
                    " (view%s)" % ("" if g["objects"] == 1 else "s") if g.get("view") else "")
                lines.append("    %s, %s in %d block%s, kept by %s" % (
                    what, format_bytes(g["bytes"]), g["blocks"], "" if g["blocks"] == 1 else "s",
                    g["holder"]))
        return "\n".join(lines)

    def __repr__(self):
        return "<gmem.Holders: %d target(s), %d group(s), %d objects visited in %.0f ms>" % (
            len(self.targets), sum(len(t["groups"]) for t in self.targets), self.visited, self.ms)


def _count(n, noun):
    return "%d %s%s" % (n, noun, "" if n == 1 else "s")


def _targets_from(target, device):
    """[(label, [block dicts], kept)] for what holders() was asked about; kept: for a leak
    finding, the bytes it keeps across steps (its leaked memory), else None."""
    if target is None:
        from . import observe
        if not observe.is_tracking(device):
            return None, ("no target, and device %s is not tracked: no leak findings to look at "
                          "(gmem.enable_tracking(), or pass an address or a site)"
                          % device_index(device))
        findings = observe.leaks(device, holders=False)
        if not findings:
            return [], ("no leak findings (%d steps seen): nothing to search for; pass an address "
                        "or a site to ask about other memory" % findings.steps)
        target = list(findings)
    asked = target if isinstance(target, (list, tuple)) else [target]
    kept = {i["site"]: i.get("surviving_bytes") for i in asked if isinstance(i, dict) and "site" in i}
    items = [i["site"] if isinstance(i, dict) and "site" in i else i for i in asked]
    for item in items:
        if not isinstance(item, str) and (not isinstance(item, int) or isinstance(item, bool)):
            raise TypeError("gmem.holders: a target is an address (int), a site (str) or a leak "
                            "finding (dict), not %r" % (item,))
    # One copy of the live blocks for every target: each copy costs libgmem a copy of the
    # tracker's state (about 60 ms with a full history).
    if len(items) == 1 and isinstance(items[0], str):
        live = _live_blocks(device_index(device), items[0])["blocks"]
    else:
        live = _live_blocks(device_index(device))["blocks"]
    by_site = {}
    for b in live:
        by_site.setdefault(b.get("site"), []).append(b)
    out = []
    for item in items:
        if isinstance(item, str):
            out.append((item, by_site.get(item, []), kept.get(item)))
        else:
            hit = [b for b in live if b["address"] <= item < b["address"] + b["size"]]
            out.append(("block at 0x%x" % item, hit, None))
    return out, None


def holders(target=None, device=None, timeout=DEFAULT_TIMEOUT, max_objects=DEFAULT_MAX_OBJECTS):
    """The Python objects that keep device memory alive, and what holds them, up to a root.

    target: None (each leak finding of gmem.leaks()), an address (the live block containing
    it), a site as leak findings name it ("train.py:173:train"), a finding (dict), or a list of
    those. Bounded: at most `timeout` seconds and `max_objects` objects visited (a heap pass
    visits every object gc tracks); the result says when the bound stopped it. Returns Holders."""
    with _lock:
        targets, why = _targets_from(target, device)
        if targets is None or not targets:
            return Holders([], notes=[why] if why else [])
        return _search(targets, timeout, max_objects)


def _search(targets, timeout, max_objects):
    search = _Search(timeout, max_objects)
    enabled = gc.isenabled()
    gc.disable()  # no collection while the search holds the heap's objects in its lists
    try:
        blocks = {}
        for _, bs, _ in targets:
            for b in bs:
                blocks[b["address"]] = b
        wanted = sorted((a, b["size"], b) for a, b in blocks.items())
        found, graphs = search.scan(wanted)
        search.prepare_roots()
        sources = [entry[0] for entries in found.values() for entry in entries]
        search.climb(sources)
        memo = {}
        best = {}   # block start -> (score, chain, exposing entry)
        for start, entries in found.items():
            for entry in entries:
                score, chain = search.best_chain(id(entry[0]), memo, set())
                if start not in best or (score, -len(chain)) > (best[start][0], -len(best[start][1])):
                    best[start] = (score, chain, entry)
        unheld = [a for a in blocks if a not in best or best[a][0] == 0]
        through_graph = search.graph_pass(graphs, unheld)
        if through_graph:
            extra = [t for t, _ in through_graph.values() if id(t) not in search.nodes]
            if extra and not search.bound:
                search.climb(extra)
            memo = {}
        results = []
        for label, bs, leaked in targets:
            groups = collections.OrderedDict()
            total = sum(b["size"] for b in bs)
            for b in bs:
                a = b["address"]
                if a in through_graph:
                    tensor, node = through_graph[a]
                    _, chain = search.best_chain(id(tensor), memo, set())
                    text, _, name = search.describe(chain)
                    holder = text  # worded below, with every node that saved a block
                    key, kind, noun, view = ("graph", text), "graph", "tensor", False
                elif a in best:
                    score, chain, entry = best[a]
                    text, kind, name = search.describe(chain)
                    obj, ptr, size, own = entry
                    noun = "tensor" if _kind_of_type(type(obj), {}) == "tensor" else \
                        type(obj).__name__
                    holder = text
                    view = own + 512 <= b["size"]  # live blocks are rounded up to 512 B
                    if view:
                        holder = "%s; a view of %s keeps the whole block (%s) alive" % (
                            text, format_bytes(own), format_bytes(b["size"]))
                    key = holder
                else:
                    key, kind, name, noun, view = None, "none", None, "block", False
                    holder = ("no Python object found that exposes them (tensors, "
                              "__cuda_array_interface__, DLPack): held from C or C++ (an autograd "
                              "graph no held tensor leads to, a CUDA graph, an extension), by "
                              "objects awaiting the garbage collector, or freed in Python but not "
                              "in gmem")
                g = groups.get((key, noun, view))
                if g is None:
                    g = groups[(key, noun, view)] = {
                        "holder": holder, "kind": kind, "name": name, "noun": noun, "view": view,
                        "objects": 0, "blocks": 0, "bytes": 0}
                g["objects"] += 1
                g["blocks"] += 1
                g["bytes"] += b["size"]
                if kind == "graph" and node not in g.setdefault("nodes", []):
                    g["nodes"].append(node)
            for g in groups.values():
                if g["kind"] == "graph":
                    g["holder"] = ("the autograd graph (`.grad_fn`, saved by %s) of %s held by %s"
                                   % (", ".join(sorted(g["nodes"])),
                                      "a tensor" if g["blocks"] == 1 else "tensors", g["holder"]))
            ordered = sorted(groups.values(), key=lambda g: -g["bytes"])
            for g in ordered:
                what = "%s (%s)" % (_count(g["objects"], g["noun"]), format_bytes(g["bytes"]))
                g["advice"] = _advice(g["kind"], g["name"], g["holder"], what)
            entry = {"target": label, "blocks": len(bs), "bytes": total, "groups": ordered}
            if leaked:
                entry["leaked_bytes"] = leaked
            if not bs:
                entry["why"] = "no live block there now (freed, or not gmem's)"
            results.append(entry)
        return Holders(results, visited=search.visited, ms=search.elapsed_ms(), bound=search.bound,
                       heap=search.heap)
    finally:
        search.nodes.clear()
        search.parents.clear()
        search.frames = []
        if enabled:
            gc.enable()


def _safe_holders(target=None, device=None, timeout=DEFAULT_TIMEOUT,
                 max_objects=DEFAULT_MAX_OBJECTS):
    """holders() for report paths (OOM, leaks, summaries): never raises; a failure becomes a
    note in the result."""
    try:
        return holders(target, device, timeout, max_objects)
    except BaseException as e:  # noqa: B902 - the report must not fail, whatever happened
        if isinstance(e, KeyboardInterrupt):
            raise
        return Holders([], notes=["the holder search failed: %s: %s" % (type(e).__name__, e)])


# --- processes outside gmem (NVML) ----------------------------------------------------------------

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


# --- reports: leaks, OOM, summary -----------------------------------------------------------------

def _insert_sections(text, sections, advice):
    """`text` (a report with a "What to do:" list) with `sections` before that list and `advice`
    first in it; appended at the end when the report has no such list."""
    sections = [s for s in sections if s]
    marker = "What to do:"
    at = text.find("\n" + marker)
    bullets = "".join("  - %s\n" % a for a in advice)
    if at < 0:
        out = text.rstrip("\n")
        for s in sections:
            out += "\n" + s
        if bullets:
            out += "\n" + marker + "\n" + bullets.rstrip("\n")
        return out + ("\n" if text.endswith("\n") else "")
    head, tail = text[:at + 1], text[at + 1 + len(marker):]
    middle = "".join(s + "\n" for s in sections)
    return head + middle + marker + "\n" + bullets + tail.lstrip("\n")


_oom = {"key": None, "holders": None, "processes": None}  # the OOM this module last looked at


def _on_oom(device=-1, *_):
    """torch's OOM observer (gmem.run attaches it): the holder search while the frames that ran
    out of memory are alive, kept for last_oom_report() and gmem.run's message. Never raises."""
    try:
        from . import observe
        report = observe._raw_oom_report(-1)
        if report is not None:
            _oom_sections(report, device if isinstance(device, int) else -1)
    except BaseException:  # noqa: B902 - an exception here would replace torch's OutOfMemoryError
        pass


_REUSE_S = 10.0  # OOMs in a burst (cuDNN retrying with less workspace) share one search


def _oom_sections(report_text, device=-1):
    """(holders, processes) for the OOM whose report is `report_text`, searched once."""
    if _oom["key"] != report_text:
        dev = None if device is None or device < 0 else device
        found, now = None, time.monotonic()
        try:
            from . import observe
            if observe.is_tracking(dev) and "Leak suspects" in report_text:
                last = _oom.get("searched")
                if last is not None and now - last[0] < _REUSE_S:
                    found = Holders(last[1].targets, last[1].visited, last[1].ms, last[1].bound,
                                    list(last[1].notes) + [
                                        "searched %.1f s earlier, at the out-of-memory error "
                                        "just before this one" % (now - last[0])], last[1].heap)
                else:
                    found = _safe_holders(None, dev)
                    _oom["searched"] = (now, found)
        except Exception as e:
            found = Holders([], notes=["the holder search failed: %s" % e])
        _oom.update(key=report_text, holders=found, processes=_safe_processes(dev))
    return _oom["holders"], _oom["processes"]


def _oom_text(report_text, device=-1):
    found, procs = _oom_sections(report_text, device)
    sections = []
    if found is not None and (found.targets or found.notes):
        sections.append(str(found))
    if procs is not None:
        sections.append(str(procs))
    return _insert_sections(report_text, sections, found.advice if found is not None else [])


def _oom_json(report, device=-1, report_text=None):
    found, procs = _oom_sections(report_text or json.dumps(report, sort_keys=True), device)
    if found is not None:
        report["holders"] = found.as_dict()
        report["advice"] = found.advice + list(report.get("advice", []))
    if procs is not None:
        report["processes"] = procs.as_dict()
    return report
