"""The package's public surface: `from gmem import *` gives every public function."""

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
        for module_name in ("gmem.observe", "gmem.memory", "gmem.errors", "gmem._summary"):
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


if __name__ == "__main__":
    unittest.main()
