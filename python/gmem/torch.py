"""gmem as PyTorch's CUDA allocator.

    import gmem.torch
    gmem.torch.enable()      # before the first tensor goes to the GPU
    ...                      # torch.cuda.memory_allocated() & co now answer from gmem

enable() makes gmem PyTorch's CUDA allocator, one of two ways:

  full       gmem's complete c10 CUDAAllocator (gmem/_torch_allocator.cpp), built by `pip install`
             against the torch installed then (torch 2.11), else compiled at first use against
             the running torch and cached (`python -m gmem.doctor` says which).
             Everything PyTorch asks its
             allocator is answered by gmem from C++: statistics, empty_cache, CUDA graph pools
             (torch.cuda.graph, MemPool, torch.compile(mode="reduce-overhead")), memory history
             and snapshots, OOM observers. No Python function is patched.
  pluggable  the fallback when that cannot be built (no compiler, no headers, another torch):
             torch.cuda.memory.CUDAPluggableAllocator with malloc/free, PyTorch's optional hooks
             (empty_cache, memory fraction, record_stream) wired to gmem, and torch.cuda's
             statistics functions patched in Python to read gmem's. Said once, with a warning.

GMEM_TORCH_ALLOCATOR=0 asks for the pluggable route. An allocator can only be swapped before CUDA
is initialised, so enable() must come first.
"""

import collections
import os
import warnings
import threading

from . import _format, _lib, _shim, _summary, distributed, memory
from .errors import GmemError
from . import observe
from .observe import track_modules  # noqa: F401  (gmem.torch.track_modules(model))
from .distributed import summary as distributed_summary  # noqa: F401  (one row per rank)

# torch.cuda functions answered by gmem while it is the allocator (in torch.cuda and
# torch.cuda.memory, which hold separate references).
PATCHED = (
    "memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved",
    "memory_stats", "memory_stats_as_nested_dict", "memory_summary", "reset_peak_memory_stats",
    "reset_accumulated_memory_stats", "empty_cache",
)

# Optional hooks of torch._C._cuda_CUDAAllocator (torch >= 2.1): setter -> libgmem function.
HOOKS = (
    ("set_reset_fn", "gmem_torch_empty_cache"),              # torch.cuda.empty_cache()
    ("set_memory_fraction_fn", "gmem_torch_memory_fraction"),  # set_per_process_memory_fraction
    ("set_record_stream_fn", "gmem_torch_record_stream"),    # Tensor.record_stream(stream)
)

_TOO_LATE = (
    "gmem.torch.enable() must run before the first CUDA allocation: PyTorch has already "
    "initialised CUDA and its own caching allocator%s. Call it at the top of your program, before "
    "any tensor or module goes to the GPU (and before torch.cuda.init()), or start the program "
    "with `python -m gmem.run your_script.py ...`.")

_FALLBACK = (
    "gmem: using the CUDAPluggableAllocator fallback, because gmem's full PyTorch allocator is "
    "unavailable (%s). malloc/free and torch.cuda's statistics work; CUDA graph pools "
    "(torch.compile(mode='reduce-overhead')), memory history/snapshots and statistics read from "
    "C++ do not.")

_state = {"allocator": None, "entry_points": None, "originals": {}, "mode": None,
          "fallback_warned": False, "step_hook": None}


def is_enabled():
    return _state["allocator"] is not None


def mode():
    """'full' (gmem's CUDAAllocator), 'pluggable' (the fallback), or None when not enabled."""
    return _state["mode"]


def entry_points():
    """(library path, alloc function, free function) PyTorch calls, or None when not enabled."""
    return _state["entry_points"]


def enable(oom_shim=True, _allow_simulated=False, full=None, plan_steps=None):
    """Makes gmem PyTorch's CUDA allocator. Idempotent.

    plan_steps: mark a step after every optimizer step (gmem.mark_step), so that steps whose
    shapes take turns (sequence lengths drawn per step) are laid out from their last occurrence:
    at peak allocated and with no device calls once every shape has come back (docs/notes/2026-11-24-planned-step-layouts.md). None (the default): on, unless GMEM_PLAN_STEPS=0. A program whose
    steps keep their shape is laid out as without marks. Whether or not it marks, in a
    torch.distributed job the rank's row goes to the process group's store after an optimizer
    step, at most once a second (gmem.distributed.publish_now_and_then), so that a rank that runs
    out of memory says what the others held with no gmem call in the program.

    full: use gmem's complete CUDAAllocator (None: unless GMEM_TORCH_ALLOCATOR=0); when it cannot
    be built, warn once and fall back to the pluggable route.
    oom_shim: on the pluggable route, build/use the small shim (gmem/_torch_shim.cpp) that turns
    gmem's out-of-memory into torch.OutOfMemoryError; without it PyTorch reports a RuntimeError.
    Raises GmemError when PyTorch is missing or CUDA is already initialised.
    """
    if is_enabled():
        return
    try:
        import torch
    except ImportError as e:
        raise GmemError("gmem.torch.enable() needs PyTorch, which cannot be imported: %s" % e) from e
    if os.environ.get("GMEM_DEVICE") == "sim" and not _allow_simulated:
        raise GmemError("gmem.torch.enable() needs the real GPU, but GMEM_DEVICE=sim makes gmem hand "
                        "out simulated addresses that CUDA kernels cannot use; unset GMEM_DEVICE")
    _check_not_too_late(torch)

    if full is None:
        full = os.environ.get("GMEM_TORCH_ALLOCATOR", "") != "0"
    if full:
        try:
            library = _shim.load_allocator(torch)
        except _shim.ShimUnavailable as e:
            _warn_fallback(str(e))
        else:
            _install_full(library)
            _hook_optimizer_steps(plan_steps)
            return
    _enable_pluggable(torch, oom_shim)
    _hook_optimizer_steps(plan_steps)


def _hook_optimizer_steps(plan_steps):
    """After every optimizer step (torch.optim's global step post-hook), without a change to the
    training loop: gmem.mark_step() when steps are planned, so that steps whose shapes take turns
    are laid out from their last occurrence (docs/notes/2026-11-24-planned-step-layouts.md); and in a
    torch.distributed job, this rank's row into the store now and then (what gmem.run's report
    of an out-of-memory on another rank reads)."""
    if plan_steps is None:
        plan_steps = os.environ.get("GMEM_PLAN_STEPS", "") != "0"
    try:  # (torch.optim does not keep `optimizer` as an attribute: import from the module)
        from torch.optim.optimizer import register_optimizer_step_post_hook as register
    except ImportError:  # PyTorch before 2.0: no global optimizer hooks, no marks
        return
    if _state["step_hook"] is not None:
        return

    def after_optimizer_step(optimizer, args, kwargs):
        if plan_steps:
            memory.mark_step()
        distributed.publish_now_and_then()

    _state["step_hook"] = register(after_optimizer_step)


def _warn_fallback(reason):
    if _state["fallback_warned"]:
        return
    _state["fallback_warned"] = True
    warnings.warn(_FALLBACK % reason, RuntimeWarning, stacklevel=3)


def _install_full(library):
    import ctypes
    error = ctypes.create_string_buffer(4096)
    if library.gmem_torch_allocator_install(error, len(error)) != 0:
        reason = error.value.decode("utf-8", "replace")
        if "initialized" in reason:  # "Can't swap an already initialized allocator"
            raise GmemError(_TOO_LATE % (" (%s)" % reason))
        raise GmemError("gmem.torch.enable(): PyTorch refused gmem's allocator: %s" % reason)
    _state["allocator"] = library  # keeps the library loaded for the process' lifetime
    _state["entry_points"] = None
    _state["mode"] = "full"


def _enable_pluggable(torch, oom_shim):
    lib_path = _lib.library_path()
    points = (lib_path, "gmem_torch_malloc", "gmem_torch_free")
    if oom_shim:
        try:
            points = (_shim.load(torch), _shim.ALLOC_FN, _shim.FREE_FN)
        except _shim.ShimUnavailable as e:
            warnings.warn("gmem: running without the torch shim (%s); out-of-memory will surface "
                          "as RuntimeError rather than torch.OutOfMemoryError" % e, RuntimeWarning,
                          stacklevel=3)

    allocator = torch.cuda.memory.CUDAPluggableAllocator(*points)
    native = allocator.allocator()
    for setter, symbol in HOOKS:
        hook = getattr(native, setter, None)
        if hook is not None:
            hook(_lib.address_of(symbol))
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as e:  # "Can't swap an already initialized allocator"
        raise GmemError(_TOO_LATE % (" (%s)" % e)) from e
    # Keep the allocator (and through it the loaded libraries) alive for the process' lifetime.
    _state["allocator"] = allocator
    _state["entry_points"] = points
    _state["mode"] = "pluggable"
    _patch(torch)


def _check_not_too_late(torch):
    if not torch.cuda.is_initialized():
        return
    detail = ""
    try:
        held = torch.cuda.memory_reserved()
        detail = ", which holds %s" % _format.format_bytes(held)
    except Exception:  # the current allocator may not report statistics
        pass
    raise GmemError(_TOO_LATE % detail)


# --- torch.cuda's statistics, answered by gmem ---------------------------------------------


def _replacements(torch):
    def index(device):
        if device is None:
            return None
        get = getattr(torch.cuda, "_get_device_index", None)
        return get(device, optional=True) if get is not None else memory.device_index(device)

    def memory_stats_as_nested_dict(device=None):
        nested = collections.OrderedDict()
        for name, value in memory.memory_stats(index(device)).items():
            node = nested
            *parents, leaf = name.split(".")
            for part in parents:
                node = node.setdefault(part, collections.OrderedDict())
            node[leaf] = value
        return nested

    return {
        "memory_allocated": lambda device=None: memory.memory_allocated(index(device)),
        "memory_reserved": lambda device=None: memory.memory_reserved(index(device)),
        "max_memory_allocated": lambda device=None: memory.max_memory_allocated(index(device)),
        "max_memory_reserved": lambda device=None: memory.max_memory_reserved(index(device)),
        "memory_stats": lambda device=None: memory.memory_stats(index(device)),
        "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
        "memory_summary": lambda device=None, abbreviated=False:
            _summary.memory_summary(index(device), abbreviated),
        "reset_peak_memory_stats": lambda device=None: memory.reset_peak_memory_stats(index(device)),
        "reset_accumulated_memory_stats":
            lambda device=None: memory.reset_accumulated_memory_stats(index(device)),
        "empty_cache": lambda: _lib.lib().gmem_torch_empty_cache(),
    }


def _patch(torch):
    replacements = _replacements(torch)
    for module in (torch.cuda, torch.cuda.memory):
        for name in PATCHED:
            if hasattr(module, name):
                _state["originals"][(module, name)] = getattr(module, name)
            fn = replacements[name]
            fn.__name__ = name
            fn.__doc__ = "gmem's answer to torch.cuda.%s (gmem.torch is enabled)." % name
            setattr(module, name, fn)


# --- track_graphs(): memory saved for backward -------------------------------------------------


class GraphTracking:
    """What track_graphs() returns: remove() stops graph tracking (also as a context manager)."""

    def __init__(self, hooks):
        self._hooks = hooks

    def remove(self):
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False


def track_graphs():
    """Tells gmem which memory PyTorch keeps for a backward pass, so that leak detection can tell
    a graph kept alive from memory kept on purpose:

        gmem.enable_tracking()
        gmem.torch.track_graphs()     # (gmem.torch.watch() does this for you)

    Through torch.autograd.graph.saved_tensors_hooks: when autograd saves a tensor for backward,
    gmem flags its block; when backward uses it, the flag goes. A block still flagged steps later
    is a graph kept alive: the leak's report says so, and its advice is torch.no_grad() when no
    backward pass ever ran (inference keeping its outputs), or loss.item() / tensor.detach() when
    backward runs but not for these (a loss kept in a list). A cache of detached tensors, or an
    EMA of weights, is never flagged.

    The hooks are the calling thread's (forward passes run there) and sit below any the program
    pushes itself; remove() takes them off. Cost: two small Python calls per saved tensor (see
    docs/diagnostics.md, "Graphs kept alive", for the measured cost per training step). torch.compile runs the hooks too, on the
    compiled graph's saved tensors."""
    import torch

    mark = observe._c().gmem_graph_saved
    backward_seen = [False]

    # The hooks run for every saved tensor (hundreds a step), so they are kept to a few calls: the
    # storage's start from the tensor's own pointer (untyped_storage() makes an object), and the C
    # function called through a void* prototype (the cheapest ctypes conversion), which finds the
    # device from the pointer and ignores host memory.
    def mark_block(tensor, saved):
        try:
            ptr = tensor.data_ptr()
            offset = tensor.storage_offset()
            if offset:
                ptr -= offset * tensor.element_size()
        except (RuntimeError, NotImplementedError, TypeError):
            return  # sparse or subclass tensors without one storage
        mark(ptr, saved)

    def pack(tensor):
        mark_block(tensor, 1)
        # Not the tensor itself: an output its own node saves (ReLU's, say) would hold that node
        # through its grad_fn, a cycle through C++ that no collector frees, so a graph never run
        # backward (inference without no_grad, whose output is dropped) would never be freed.
        return tensor.detach()

    def unpack(tensor):
        if getattr(_reading_saved, "on", False):
            return tensor  # gmem.holders reading a graph's saved tensors: not a backward pass
        if not backward_seen[0]:
            backward_seen[0] = True
            _lib.check(observe._c().gmem_graph_backward())
        mark_block(tensor, 0)
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    hooks.__enter__()
    return GraphTracking(hooks)


# Set by gmem.holders while it reads saved tensors (node._saved_self) to find what a kept graph
# holds: the unpack hook then leaves the blocks' flags alone. Per thread.
_reading_saved = threading.local()


# --- watch(): steps and module tracking in one line ---------------------------------------------


class Watch(observe.ModuleTracking):
    """What watch() returns: remove() takes its hooks off again (also as a context manager)."""


def watch(obj, name="model", stacks=False, graphs=True):
    """Marks gmem's steps for you, so that leak detection (gmem.leaks(), OOM reports) works
    without gmem.step() calls:

        gmem.torch.watch(optimizer)   # a step at each optimizer.step() (a step post-hook)
        gmem.torch.watch(model)       # module tracking (track_modules), and a step at each
                                      # forward of the top module

    Watching also marks a step when it begins (watch(optimizer)) or at the first forward
    (watch(model)): what was allocated before (the model's weights) is then told apart from
    what the first step allocates, so that running out of memory in the very first step is
    reported as a batch too large, or a model too large, rather than as unknown live memory.

    graphs=True (the default) also tracks autograd graphs (track_graphs()), so that a graph kept
    alive (inference without no_grad, losses.append(loss)) is reported as such.

    A model's steps begin at its forward, not at the end of its backward: inference has no
    backward, and a training step that runs forward once begins with it. Watch one or the other:
    a model called several times a step (gradient accumulation) counts a step per call, which
    leak detection takes in its stride (a leak is judged at the rhythm it grows). Returns a
    handle whose remove() takes the hooks off. Tracking must be on (gmem.enable_tracking())."""
    is_optimizer = hasattr(obj, "register_step_post_hook")
    if not is_optimizer and not (hasattr(obj, "named_modules") and
                                 hasattr(obj, "register_forward_pre_hook")):
        raise TypeError("gmem.torch.watch() takes a torch.optim.Optimizer (it has "
                        "register_step_post_hook) or a torch.nn.Module, not %s"
                        % type(obj).__name__)
    handles = [track_graphs()] if graphs else []
    if is_optimizer:
        handles.append(obj.register_step_post_hook(lambda optimizer, args, kwargs: observe.step()))
        observe.step()  # the loop begins: what exists now (the model) is step 0's
        return Watch(handles)

    def mark_step(module, args):
        # Each forward begins a step; the first one ends step 0, the model's own memory.
        observe.step()

    # Registered before track_modules' hooks, so that the step ends before the module's scope is
    # entered.
    handles.append(obj.register_forward_pre_hook(mark_step))
    handles.append(track_modules(obj, name=name, stacks=stacks))
    return Watch(handles)


def _reset_for_tests():
    """Undoes the patches and forgets the allocator (PyTorch itself cannot swap back)."""
    for (module, name), original in _state["originals"].items():
        setattr(module, name, original)
    if _state["step_hook"] is not None:
        _state["step_hook"].remove()
    _state.update(allocator=None, entry_points=None, originals={}, mode=None, step_hook=None)
