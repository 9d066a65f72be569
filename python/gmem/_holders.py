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

The parts: _holder_memory (what exposes device memory), _holder_search (the heap walk),
_holder_chains (how a chain reads), _holder_results (Holders and its advice), _processes (NVML).
This module asks the search (holders()) and adds its sections to the leak and OOM reports: it sits
above gmem.observe, and plugs them into observe's leaks() and last_oom_report() when imported
(observe._set_report_sections, at the end of this file).
"""

import collections
import ctypes
import gc
import json
import threading
import time

from . import _lib, observe
from ._format import _insert_sections, format_bytes
from ._holder_chains import describe
from ._holder_memory import _kind_of_type
from ._holder_results import Holders, _advice, _count
from ._holder_search import DEFAULT_MAX_OBJECTS, DEFAULT_TIMEOUT, _Search
# Re-exported: gmem, its reports and the tests take them from here.
from ._processes import Nvml, Processes, _proc, _safe_processes, processes  # noqa: F401
from .memory import device_index

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


# --- targets and the search -----------------------------------------------------------------------

def _targets_from(target, device):
    """[(label, [block dicts], kept)] for what holders() was asked about; kept: for a leak
    finding, the bytes it keeps across steps (its leaked memory), else None."""
    if target is None:
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
                    text, _, name = describe(search, chain)
                    holder = text  # worded below, with every node that saved a block
                    key, kind, noun, view = ("graph", text), "graph", "tensor", False
                elif a in best:
                    score, chain, entry = best[a]
                    text, kind, name = describe(search, chain)
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


# --- reports: leaks, OOM, summary -----------------------------------------------------------------

_oom = {"key": None, "holders": None, "processes": None}  # the OOM this module last looked at


def _on_oom(device=-1, *_):
    """torch's OOM observer (gmem.run attaches it): the holder search while the frames that ran
    out of memory are alive, kept for last_oom_report() and gmem.run's message. Never raises."""
    try:
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


# gmem.leaks() and gmem.last_oom_report() get these sections from now on.
observe._set_report_sections(_safe_holders, _oom_text, _oom_json)
