"""bench/torch/models, the benchmarks' workloads, checked without torch or a GPU: the package
imports without torch; its modules stay small; every factory reaches finish_training_step through
models.shared, where host_time.py replaces it; every factory of a module is `models.<name>`; and
step_frame finds the statement that ends each marked program's steps (the `--step-at` frame of a
trace captured from the package, bench/replay_traces.sh).

Standard library only:
    python3 -m unittest discover -s tests/python -k test_bench_models
"""
import ast
import importlib.util
import os
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "bench", "torch", "models")
MAX_LINES = 600


def load():
    """The package, imported under a name of its own (no sys.path entry left behind)."""
    name = "bench_torch_models"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(PACKAGE, "__init__.py"), submodule_search_locations=[PACKAGE])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def sources():
    """{file name: source} of the package's modules."""
    out = {}
    for name in sorted(os.listdir(PACKAGE)):
        if name.endswith(".py"):
            with open(os.path.join(PACKAGE, name), encoding="utf-8") as f:
                out[name] = f.read()
    return out


class BenchModelsTest(unittest.TestCase):
    def test_imports_without_torch(self):
        code = ("import sys; sys.path.insert(0, %r); import models; "
                "assert 'torch' not in sys.modules, 'models imports torch'; "
                "print(len([n for n in dir(models) if n.endswith('_step')]))"
                % os.path.join(ROOT, "bench", "torch"))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertGreater(int(r.stdout), 40)

    def test_modules_stay_small(self):
        for name, text in sources().items():
            self.assertLess(len(text.splitlines()), MAX_LINES, name)

    def test_finish_training_step_is_reached_through_shared(self):
        # host_time.py sets models.shared.finish_training_step: a module holding its own binding
        # (from .shared import finish_training_step) would keep calling the original.
        for name, text in sources().items():
            if name in ("shared.py", "__init__.py"):
                continue
            tree = ast.parse(text)
            imported = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                        and any(a.name == "finish_training_step" for a in n.names)]
            bare = [n.lineno for n in ast.walk(tree)
                    if isinstance(n, ast.Name) and n.id == "finish_training_step"]
            self.assertEqual((imported, bare), ([], []), name)
        init = ast.parse(sources()["__init__.py"])
        calls = [n.lineno for n in ast.walk(init) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", getattr(n.func, "attr", None)) == "finish_training_step"]
        self.assertEqual(calls, [])

    def test_every_factory_is_exported(self):
        models = load()
        for name in sources():
            if name == "__init__.py":
                continue
            module = sys.modules["bench_torch_models." + name[:-3]]
            for attr, value in vars(module).items():
                if callable(value) and getattr(value, "__module__", None) == module.__name__:
                    self.assertIs(getattr(models, attr, None), value, "%s.%s" % (name, attr))

    def test_step_frames_name_their_statements(self):
        models = load()
        self.assertIn("bert_mlm", models.STEP_ENDS)
        for program, (function, statement) in models.STEP_ENDS.items():
            frame = models.step_frame(program)
            file_name, line = frame.split(":")
            with open(os.path.join(PACKAGE, file_name), encoding="utf-8") as f:
                text = f.read().splitlines()[int(line) - 1]
            self.assertEqual(text.strip(), statement, program)
        self.assertEqual(models.step_frame("moe"), models.step_frame("fsdp2_varlen"))
        self.assertTrue(models.step_frame("moe").startswith("shared.py:"))


if __name__ == "__main__":
    unittest.main()
