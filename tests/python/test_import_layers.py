"""The package's modules import each other one way: from the core (gmem._lib, gmem.memory,
gmem.observe) up to the features built on it (gmem._holders, gmem.distributed, gmem._summary,
gmem.torch) and gmem/__init__ at the top, never back down-to-up. Every import of a gmem module
counts, those inside functions (lazy imports) too: a cycle hidden in a function still ties the
layers together. The core hears from the layers above through hooks they register
(gmem.observe.step_listeners, gmem.observe._set_report_sections).

GMEM_PACKAGE_DIR points the check at another copy of the package (to see it fail on one with a
cycle)."""

import ast
import os
import tempfile
import unittest

from support import PYTHON_DIR

PACKAGE = "gmem"


def package_dir():
    return os.environ.get("GMEM_PACKAGE_DIR") or os.path.join(PYTHON_DIR, PACKAGE)


def module_names(folder):
    """The package's modules, by their name in it ("observe"; "__init__" for the package)."""
    return {name[:-3] for name in os.listdir(folder) if name.endswith(".py")}


def imports_of(path, modules):
    """{module: first line} of the package's modules that the file at `path` imports, at module
    level or inside functions. `from . import x` names module x when there is one, else the
    package (__init__); `from gmem.x import y` and `import gmem.x` count as `from .x import y`."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = {}

    def add(target, node):
        found.setdefault(target, node.lineno)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level > 1:
                continue  # above the package: not one of its modules
            if node.level == 1:
                parts = node.module.split(".") if node.module else []
            elif node.module and node.module.split(".")[0] == PACKAGE:
                parts = node.module.split(".")[1:]
            else:
                continue
            if parts:
                add(parts[0] if parts[0] in modules else "__init__", node)
            else:  # from . import a, b (or from gmem import a, b): modules, or the package's names
                for alias in node.names:
                    add(alias.name if alias.name in modules else "__init__", node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == PACKAGE:
                    add(parts[1] if len(parts) > 1 and parts[1] in modules else "__init__", node)
    return found


def import_graph(folder):
    """{module: {imported module: line}}, without a module's imports of itself."""
    modules = module_names(folder)
    graph = {}
    for name in sorted(modules):
        edges = imports_of(os.path.join(folder, name + ".py"), modules)
        edges.pop(name, None)
        graph[name] = edges
    return graph


def find_cycle(graph):
    """A list of modules [a, b, ..., a] that import each other in a circle, or None."""
    state = {}  # module -> "open" while on the path, "done" after
    path = []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def describe(graph, cycle):
    return " -> ".join("%s.py (line %d)" % (a, graph[a][b]) for a, b in zip(cycle, cycle[1:])) + \
        " -> " + cycle[-1] + ".py"


class ImportLayersTest(unittest.TestCase):
    def test_the_graph_has_the_package(self):
        graph = import_graph(package_dir())
        for name in ("__init__", "observe", "_holders", "_summary", "distributed"):
            self.assertIn(name, graph)
        self.assertIn("observe", graph["__init__"])
        self.assertIn("observe", graph["_holders"])

    def test_no_import_cycle(self):
        graph = import_graph(package_dir())
        cycle = find_cycle(graph)
        self.assertIsNone(cycle, "gmem's modules import each other in a circle: %s"
                          % (describe(graph, cycle) if cycle else ""))

    def test_the_checker_finds_a_cycle(self):
        # The check itself: a lazy import inside a function closes the circle as well.
        graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
        self.assertEqual(find_cycle(graph), ["a", "b", "c", "a"])
        self.assertIsNone(find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 2}}))
        source = "def f():\n    from . import observe\n    from .errors import X\n"
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "probe.py")
            with open(path, "w", encoding="utf-8") as f:
                f.write(source)
            self.assertEqual(imports_of(path, {"observe", "errors"}), {"observe": 2, "errors": 3})

    def test_the_core_imports_nothing_above_it(self):
        # observe is what the reports and features build on: it hears from them through the
        # hooks they register, never by importing them.
        graph = import_graph(package_dir())
        below = {"_lib", "errors", "memory", "_format"}
        self.assertEqual(set(graph["observe"]) - below, set(),
                         "gmem.observe imports modules above it")


if __name__ == "__main__":
    unittest.main()
