"""gmem's PyTorch allocator built at install time, and `python -m gmem.doctor`.

With a stand-in torch (no torch here): the install's build is taken only when the record says it
was built for the running torch; the route doctor reports (pluggable, compile at first use, built
at install) follows from what is there; load_allocator loads the install's library without
compiling; doctor on this machine says there is no GPU, and without torch which route is none."""

import ctypes
import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest
from unittest import mock

from support import REPO, run_python

from gmem import _shim
from test_torch_fake import fake_torch


def torch_with_headers(tmp, version="2.11.0+fake"):
    """A stand-in torch whose C++ headers exist (an empty c10/util/Exception.h)."""
    os.makedirs(os.path.join(tmp, "torch", "include", "c10", "util"))
    open(os.path.join(tmp, "torch", "include", "c10", "util", "Exception.h"), "w").close()
    torch = fake_torch(os.path.join(tmp, "torch"))
    torch.__version__ = version
    return torch


def has_torch():
    return run_python(["-c", "import torch"]).returncode == 0


def has_driver():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


class PrebuiltTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="gmem-prebuilt-test-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.torch = torch_with_headers(self.tmp)
        self.package = os.path.join(self.tmp, "package")
        os.makedirs(self.package)

    def write(self, record, library=True):
        _shim.write_prebuilt_record(self.package, record)
        if library:
            open(os.path.join(self.package, _shim.PREBUILT_ALLOCATOR), "w").close()

    def test_taken_only_for_the_torch_it_was_built_for(self):
        self.write(dict(_shim.torch_fingerprint(self.torch), built=True))
        path, why = _shim.prebuilt_allocator(self.torch, self.package)
        self.assertEqual(path, os.path.join(self.package, _shim.PREBUILT_ALLOCATOR))
        self.assertIn("built at install time against torch 2.11.0+fake", why)
        self.torch.__version__ = "2.12.0+fake"  # torch upgraded since the install
        path, why = _shim.prebuilt_allocator(self.torch, self.package)
        self.assertIsNone(path)
        self.assertIn("built at install time for torch 2.11.0+fake", why)
        self.assertIn("but this is torch 2.12.0+fake", why)

    def test_not_built_says_why(self):
        self.write({"built": False, "reason": "torch could not be imported when gmem was installed"},
                   library=False)
        path, why = _shim.prebuilt_allocator(self.torch, self.package)
        self.assertIsNone(path)
        self.assertIn("torch could not be imported when gmem was installed", why)
        self.assertIn("no torch_allocator.json", _shim.prebuilt_allocator(self.torch, self.tmp)[1])

    def test_routes(self):
        with mock.patch.object(_shim, "PACKAGE_DIR", self.package):
            with mock.patch.dict(os.environ, {"GMEM_TORCH_ALLOCATOR": "0"}):
                self.assertEqual(_shim.allocator_route(self.torch)[0], "pluggable")
            with mock.patch.dict(os.environ, {"GMEM_TORCH_ALLOCATOR": ""}):
                # No CUDA headers: not prebuilt, and no compile possible.
                with mock.patch.object(_shim, "cuda_include_dir", return_value=None):
                    route, why = _shim.allocator_route(self.torch)
                self.assertEqual(route, "pluggable")
                self.assertIn("cuda_runtime_api.h", why)
                self.assertIn("not prebuilt", why)
                # Everything a compile needs: compiled at first use.
                with mock.patch.object(_shim, "cuda_include_dir", return_value=self.tmp), \
                        mock.patch.object(_shim, "_compiler", return_value="c++"):
                    route, why = _shim.allocator_route(self.torch)
                    self.assertEqual(route, "full (compile at first use)", why)
                    self.assertIn(_shim.cache_dir(), why)
                    # Built at install for this torch: that one.
                    self.write(dict(_shim.torch_fingerprint(self.torch), built=True))
                    route, why = _shim.allocator_route(self.torch)
                    self.assertEqual(route, "full (built at install)", why)

    @unittest.skipIf(shutil.which("cc") is None, "no C compiler")
    def test_load_allocator_takes_the_install_build_without_compiling(self):
        source = os.path.join(self.tmp, "stub.c")
        with open(source, "w") as f:
            f.write("int gmem_torch_allocator_install(char* e, unsigned long n) { return 7; }\n"
                    "int gmem_torch_allocator_active(void) { return 0; }\n")
        library = os.path.join(self.package, _shim.PREBUILT_ALLOCATOR)
        subprocess.run(["cc", "-shared", "-fPIC", source, "-o", library], check=True)
        self.write(dict(_shim.torch_fingerprint(self.torch), built=True), library=False)
        with mock.patch.object(_shim, "PACKAGE_DIR", self.package), \
                mock.patch.dict(os.environ, {"GMEM_TORCH_ALLOCATOR": ""}), \
                mock.patch.object(_shim, "build_allocator", side_effect=AssertionError("compiled")):
            loaded = _shim.load_allocator(self.torch)
        self.assertEqual(loaded.path, library)
        self.assertEqual(loaded.gmem_torch_allocator_install(None, 0), 7)

    def test_cache_key_covers_the_allocator_headers(self):
        # One translation unit: _torch_allocator.cpp includes its private headers relative to
        # itself. Every one of them (and nothing missing) makes the key; a changed header rebuilds.
        sources = _shim.allocator_sources()
        self.assertEqual(sources[0], _shim.ALLOCATOR_SOURCE)
        included = set()
        for path in sources:
            with open(path) as f:
                for name in re.findall(r'^#include "(_torch_allocator/[^"]+|[^"/]+\.hpp)"', f.read(),
                                       re.M):
                    included.add(os.path.normpath(os.path.join(os.path.dirname(path), name)))
        self.assertTrue(included, "no private header included")
        self.assertEqual(included, set(sources[1:]))
        copy = os.path.join(self.tmp, "src")
        shutil.copy(_shim.ALLOCATOR_SOURCE, copy + ".cpp")
        shutil.copytree(_shim.ALLOCATOR_HEADERS, copy)
        with mock.patch.object(_shim, "ALLOCATOR_SOURCE", copy + ".cpp"), \
                mock.patch.object(_shim, "ALLOCATOR_HEADERS", copy):
            key = lambda: _shim._cached_path("a", _shim.allocator_sources(), "t", [], "c++")
            before = key()
            with open(os.path.join(copy, "pools.hpp"), "a") as f:
                f.write("// changed\n")
            self.assertNotEqual(key(), before)

    def test_install_build_without_headers_raises(self):
        torch = fake_torch("/nonexistent/torch")
        with self.assertRaises(_shim.ShimUnavailable) as caught:
            _shim.build_allocator_into(torch, self.package, "/nonexistent/libgmem.so",
                                       os.path.join(REPO, "include"))
        self.assertIn("torch's C++ headers are not installed", str(caught.exception))
        self.assertFalse(os.path.exists(os.path.join(self.package, _shim.PREBUILT_RECORD)))


class DoctorTest(unittest.TestCase):
    def doctor(self, **env):
        result = run_python(["-m", "gmem.doctor"], **env)
        self.assertEqual(result.returncode, 0, result.stderr)
        rows = {}
        for line in result.stdout.splitlines()[1:]:
            topic, _, text = line.partition("  ")
            rows[topic.strip()] = text.strip()
        return result.stdout, rows

    def test_every_topic_and_a_verdict(self):
        text, rows = self.doctor()
        for topic in ("gmem", "libgmem", "driver", "torch", "allocator", "environment", "verdict"):
            self.assertIn(topic, rows, text)
        self.assertIn("GMEM_DEVICE=sim", rows["environment"])  # support.py sets it

    @unittest.skipIf(has_driver(), "an NVIDIA driver is installed here")
    def test_no_gpu_is_said_clearly(self):
        text, rows = self.doctor()
        self.assertIn("no NVIDIA driver", rows["driver"], text)
        self.assertTrue(rows["verdict"].startswith("no GPU here"), text)
        self.assertFalse(any(topic.startswith("device ") for topic in rows), text)

    @unittest.skipIf(has_torch(), "torch is installed here")
    def test_without_torch(self):
        text, rows = self.doctor()
        self.assertIn("not installed", rows["torch"], text)
        self.assertIn("pip install torch", rows["torch"], text)
        self.assertTrue(rows["allocator"].startswith("none without torch"), text)

    def test_route_with_a_torch(self):
        # A stand-in torch module in the child: doctor names a route and why.
        code = ("import sys, types, os\n"
                "sys.path.insert(0, 'tests/python')\n"
                "from test_torch_fake import fake_torch\n"
                "sys.modules['torch'] = fake_torch('/nonexistent/torch')\n"
                "from gmem import doctor\n"
                "rows = dict(doctor.findings())\n"
                "print(rows['torch']); print(rows['allocator']); print(rows['verdict'])\n")
        result = run_python(["-c", code])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("0.0+fake at /nonexistent/torch", result.stdout)
        self.assertIn("pluggable: the full allocator is not prebuilt", result.stdout)
        self.assertIn("torch's C++ headers are not installed", result.stdout)

    def test_help(self):
        result = run_python(["-m", "gmem.doctor", "--help"])
        self.assertEqual(result.returncode, 0)
        self.assertIn("python -m gmem.doctor", result.stdout)
        self.assertEqual(run_python(["-m", "gmem.doctor", "--bogus"]).returncode, 2)


if __name__ == "__main__":
    unittest.main()
