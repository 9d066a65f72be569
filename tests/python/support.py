"""Shared set-up of the Python tests: the package on the path, the simulated device.

The tests run without a GPU: GMEM_DEVICE=sim gives gmem a simulated 80 GiB device (the engine
reads it when first used, so it is set here, before any test touches the library). The library
is found like gmem finds it (GMEM_LIBRARY, else build/libgmem.so).
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON_DIR = os.path.join(REPO, "python")
if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)

os.environ["GMEM_DEVICE"] = "sim"

MiB = 1 << 20
GiB = 1 << 30


def round_up(n, multiple=512):
    return (n + multiple - 1) // multiple * multiple


def child_env(**overrides):
    """Environment for a child Python: finds this package; None values remove a variable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = PYTHON_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def assert_child_ok(test, code, **env_overrides):
    """Runs `python3 -c CODE` (its own process: a fresh engine) and fails `test` unless it exits
    with 0 after printing "ok"; returns the CompletedProcess."""
    result = run_python(["-c", code], **env_overrides)
    test.assertEqual(result.returncode, 0, result.stdout + result.stderr)
    test.assertIn("ok", result.stdout)
    return result


def run_python(args, timeout=120, **env_overrides):
    """Runs `python3 ARGS` and returns the CompletedProcess (text output, both streams)."""
    return subprocess.run([sys.executable] + list(args), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True, timeout=timeout,
                          env=child_env(**env_overrides), cwd=REPO)
