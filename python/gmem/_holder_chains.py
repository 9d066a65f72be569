"""How a chain of referrers reads, for the holder search (gmem._holders): how each object refers
to the next (an attribute, a key, an index, a closure cell), and the chain worded from its root
down as a person recognises it (a global, a local of a frame, an nn.Module attribute by path, a
hook on a module, an optimizer's state), with the kind of holder that picks its advice."""

import collections
import os
import types

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


def describe(search, chain):
    """(holder text, kind, name) for a chain of `search`'s nodes (object first, root last)."""
    objs = [search.nodes[i] for i in chain]
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
                mod = search.module_dicts.get(id(parent)) or parent.get("__name__", "?")
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
