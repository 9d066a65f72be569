"""The package's public surface: `from gmem import *` gives every public function, and
python/README.md documents every public function and class of every module, with its signature
and a one-line description."""

import importlib
import inspect
import os
import re
import unittest

from support import REPO

import gmem

# Public names of gmem.memory that are helpers for the package's own modules (gmem.observe,
# gmem.torch): documented in python/README.md under gmem.memory, not exported by `import *`.
MEMORY_HELPERS = {"device_index", "stream_handle"}

# The modules python/README.md documents, with the prefix their functions are called with there.
DOCUMENTED = (
    ("gmem.memory", "gmem."),
    ("gmem.observe", "gmem."),
    ("gmem._summary", "gmem."),
    ("gmem._format", "gmem."),
    ("gmem._holders", "gmem."),
    ("gmem._holder_results", "gmem."),
    ("gmem._processes", "gmem."),
    ("gmem.fit", "gmem."),
    ("gmem._fit_run", "gmem."),
    ("gmem.levers", "gmem."),
    ("gmem.find_batch", "gmem."),
    ("gmem.errors", "gmem."),
    ("gmem.torch", "gmem.torch."),
    ("gmem.distributed", "gmem.distributed."),
    ("gmem.run", "gmem.run."),
)


def defined_in(module):
    """Public functions and classes defined in `module` (not imported into it), by name."""
    return {name: obj for name, obj in vars(module).items()
            if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
            and obj.__module__ == module.__name__}


def signature(obj):
    """A function's parameters as python/README.md writes them: (a, b=1, c="x"), without private
    (_underscored) parameters."""
    params = [p for name, p in inspect.signature(obj).parameters.items() if not name.startswith("_")]
    return str(inspect.Signature(params)).replace("'", '"')


class StarImportTest(unittest.TestCase):
    def test_every_name_in_all_exists(self):
        self.assertEqual(len(gmem.__all__), len(set(gmem.__all__)), "a name twice in __all__")
        for name in gmem.__all__:
            self.assertTrue(hasattr(gmem, name), "gmem.__all__ names %s, which gmem lacks" % name)
        names = {}
        exec("from gmem import *", names)
        self.assertEqual(set(names) - {"__builtins__"}, set(gmem.__all__))

    def test_public_functions_of_observe_memory_and_errors_are_exported(self):
        for module_name in ("gmem.observe", "gmem.memory", "gmem.errors", "gmem._summary",
                            "gmem._format"):
            module = importlib.import_module(module_name)
            for name, obj in defined_in(module).items():
                if module_name == "gmem.memory" and name in MEMORY_HELPERS:
                    continue
                if module_name == "gmem.errors" and not inspect.isclass(obj):
                    continue  # error_for_status: how gmem._lib raises, not for users
                self.assertIn(name, gmem.__all__, "%s.%s is not in gmem.__all__" % (module_name, name))
                self.assertIs(getattr(gmem, name), obj)

    def test_observability_by_star_import(self):
        names = {}
        exec("from gmem import *", names)
        for name in ("enable_tracking", "disable_tracking", "is_tracking", "step", "annotate",
                     "scope", "set_frames", "snapshot", "dump_snapshot", "last_oom_report",
                     "leaks", "Leaks", "top_sites", "track_modules", "memory_summary"):
            self.assertIn(name, names)


class VersionTest(unittest.TestCase):
    def test_version_is_the_cmake_projects(self):
        # The one `gmem --version` prints (tests/CMakeLists.txt checks that side).
        with open(os.path.join(REPO, "CMakeLists.txt"), encoding="utf-8") as f:
            version = re.search(r"project\(gmem VERSION ([0-9.]+)", f.read()).group(1)
        self.assertEqual(gmem.__version__, version)


class ReadmeTest(unittest.TestCase):
    """Each public function and class appears in python/README.md as `prefix.name(signature)` (a
    class without its own __init__: `prefix.Name`) in a table row with a description."""

    @classmethod
    def setUpClass(cls):
        with open(os.path.join(REPO, "python", "README.md"), encoding="utf-8") as f:
            cls.readme = f.read()
        cls.rows = [line for line in cls.readme.splitlines() if line.startswith("| `")]

    def row_for(self, text, is_class):
        """The cells of the table row whose first cell names `text` (a class: `text` or
        `text(...)`), or None."""
        for row in self.rows:
            cells = [c.strip() for c in row.strip().strip("|").split("|")]
            if "`%s`" % text in cells[0] or (is_class and "`%s(" % text in cells[0]):
                return cells
        return None

    def test_every_public_function_and_class_is_documented(self):
        missing = []
        for module_name, prefix in DOCUMENTED:
            module = importlib.import_module(module_name)
            for name, obj in defined_in(module).items():
                if module_name == "gmem.errors" and not inspect.isclass(obj):
                    continue
                if module_name == "gmem.memory" and name in MEMORY_HELPERS:
                    prefix_here = "gmem.memory."
                else:
                    prefix_here = prefix
                is_class = inspect.isclass(obj)
                text = prefix_here + name + ("" if is_class else signature(obj))
                cells = self.row_for(text, is_class)
                if cells is None:
                    missing.append(text)
                elif len(cells) < 2 or len(cells[1]) < 10:
                    missing.append(text + " (no description)")
        self.assertEqual(missing, [], "python/README.md lacks these (as `name(signature)` in a "
                                      "table row with a description)")

    def test_leaks_members_are_documented(self):
        for member in ("as_dicts()", "as_dict()", ".cause", ".evidence", ".steps", ".text",
                       ".findings"):
            self.assertTrue(member in self.readme, "python/README.md does not mention Leaks' " + member)

    def test_documented_names_exist(self):
        # No row for a function that is gone: each `gmem.name...` a row's first cell names resolves.
        for row in self.rows:
            for dotted in re.findall(r"`(gmem(?:\.[A-Za-z_]+)*)", row.split("|")[1]):
                parts = dotted.split(".")
                for i in range(len(parts), 0, -1):
                    try:
                        obj = importlib.import_module(".".join(parts[:i]))
                        break
                    except ImportError:
                        continue
                for part in parts[i:]:
                    self.assertTrue(hasattr(obj, part), "python/README.md documents %s" % dotted)
                    obj = getattr(obj, part)

if __name__ == "__main__":
    unittest.main()
