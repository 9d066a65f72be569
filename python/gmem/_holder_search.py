"""The holder search's walk over the Python heap (gmem._holders): the objects exposing one of the
wanted blocks, their referrers followed up level by level (gc.get_referrers, one heap pass per
level) to a root, the best chain for each object, and the autograd graphs that saved a block
nothing else refers to. Bounded in time and in objects visited; it says which bound stopped it."""

import gc
import os
import sys
import time
import types

from ._holder_memory import _kind_of_type, _memory_of

DEFAULT_TIMEOUT = 2.0            # seconds
DEFAULT_MAX_OBJECTS = 50000000   # objects visited (one heap pass visits every tracked object)
MAX_DEPTH = 16                   # referrer levels followed up from an object
MAX_PARENTS = 6                  # referrers kept per object (the chains to choose from)
MAX_NEW_PER_LEVEL = 200000       # objects added to the search per level
MAX_GRAPH_NODES = 200000         # autograd nodes walked

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


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
