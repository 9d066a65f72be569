"""gmem.torch without PyTorch: a stand-in `torch` module records what enable() does with the
pluggable-allocator API (the calls and hooks torch 2.11 offers), and the statistics patched into
torch.cuda are checked against gmem over the simulated device. The real thing runs on the GPU
(test_torch_gpu.py)."""

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import types
import unittest
import warnings
from unittest import mock

from support import MiB, run_python

import gmem
import gmem.torch
from gmem import _lib, _shim


class FakeNativeAllocator:
    """torch._C._cuda_CUDAAllocator: records the hook addresses it is given."""

    def __init__(self):
        self.hooks = {}

    def __getattr__(self, name):
        if name.startswith("set_") and name.endswith("_fn"):
            return lambda address: self.hooks.__setitem__(name, address)
        raise AttributeError(name)


class FakePluggableAllocator:
    def __init__(self, path, alloc_fn_name, free_fn_name):
        self.args = (path, alloc_fn_name, free_fn_name)
        self.native = FakeNativeAllocator()

    def allocator(self):
        return self.native


def fake_torch(torch_dir="/nonexistent/torch", initialized=False, swap_error=None):
    """A `torch` with just what gmem.torch touches; native statistics answer "native"."""
    torch = types.ModuleType("torch")
    torch.__file__ = os.path.join(torch_dir, "__init__.py")
    torch.__version__ = "0.0+fake"
    torch._C = types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True)
    cuda = types.ModuleType("torch.cuda")
    memory = types.ModuleType("torch.cuda.memory")
    memory.CUDAPluggableAllocator = FakePluggableAllocator
    torch.swapped = []

    def change_current_allocator(allocator):
        if swap_error:
            raise RuntimeError(swap_error)
        torch.swapped.append(allocator)

    memory.change_current_allocator = change_current_allocator
    for name in gmem.torch.PATCHED:
        for module in (cuda, memory):
            setattr(module, name, lambda *args, **kwargs: "native")
    cuda.memory_reserved = memory.memory_reserved = lambda device=None: 123
    cuda.is_initialized = lambda: initialized
    cuda.memory = memory
    torch.cuda = cuda
    return torch


class Remover:
    """A hook handle: remove() takes `hook` out of `hooks`."""

    def __init__(self, hooks, hook):
        self.hooks, self.hook = hooks, hook

    def remove(self):
        self.hooks.remove(self.hook)


class TorchFakeTestCase(unittest.TestCase):
    def install(self, torch, full=False):
        """Puts `torch` in sys.modules; full=False asks for the pluggable route
        (GMEM_TORCH_ALLOCATOR=0), True leaves the choice to enable()."""
        env = mock.patch.dict(os.environ)
        env.start()
        self.addCleanup(env.stop)
        if full:
            os.environ.pop("GMEM_TORCH_ALLOCATOR", None)
        else:
            os.environ["GMEM_TORCH_ALLOCATOR"] = "0"
        modules = {"torch": torch}
        if torch is not None:
            modules.update({"torch.cuda": torch.cuda, "torch.cuda.memory": torch.cuda.memory})
        patcher = mock.patch.dict(sys.modules, modules)
        patcher.start()
        self.addCleanup(patcher.stop)
        return torch

    def tearDown(self):
        gmem.torch._reset_for_tests()
        gmem.set_memory_limit(0)
        gmem.empty_cache()


class EnableTest(TorchFakeTestCase):
    def test_swaps_in_gmem_and_wires_the_hooks(self):
        torch = self.install(fake_torch())
        gmem.torch.enable(oom_shim=False, _allow_simulated=True)
        self.assertTrue(gmem.torch.is_enabled())
        self.assertEqual(len(torch.swapped), 1)
        allocator = torch.swapped[0]
        self.assertEqual(allocator.args, (gmem.library_path(), "gmem_torch_malloc", "gmem_torch_free"))
        self.assertEqual(allocator.native.hooks, {
            "set_reset_fn": _lib.address_of("gmem_torch_empty_cache"),
            "set_memory_fraction_fn": _lib.address_of("gmem_torch_memory_fraction"),
            "set_record_stream_fn": _lib.address_of("gmem_torch_record_stream"),
        })
        gmem.torch.enable(oom_shim=False, _allow_simulated=True)
        self.assertEqual(len(torch.swapped), 1, "enable() twice swaps once")

    def install_with_optimizer_hooks(self):
        """A fake torch whose torch.optim.optimizer registers global step post-hooks into the
        list returned."""
        torch = fake_torch()
        hooks = []

        def register(hook):  # torch.optim.optimizer.register_optimizer_step_post_hook
            hooks.append(hook)
            return Remover(hooks, hook)

        optim = types.ModuleType("torch.optim")
        optim.optimizer = types.ModuleType("torch.optim.optimizer")
        optim.optimizer.register_optimizer_step_post_hook = register
        torch.optim = optim
        self.install(torch)
        modules = mock.patch.dict(sys.modules, {"torch.optim": optim,
                                                "torch.optim.optimizer": optim.optimizer})
        modules.start()
        self.addCleanup(modules.stop)
        return hooks

    def test_plan_steps_marks_a_step_after_every_optimizer_step(self):
        hooks = self.install_with_optimizer_hooks()
        gmem.torch.enable(oom_shim=False, _allow_simulated=True, plan_steps=True)
        gmem.torch.enable(oom_shim=False, _allow_simulated=True, plan_steps=True)
        self.assertEqual(len(hooks), 1, "one global hook, however often enable() runs")
        with mock.patch.object(gmem.memory, "mark_step") as mark_step:
            hooks[0](object(), (), {})  # what torch.optim runs after optimizer.step()
            hooks[0](object(), (), {})
        self.assertEqual(mark_step.call_count, 2)
        before = gmem.memory_stat("gmem.steps_marked")
        hooks[0](object(), (), {})  # the real one: a step mark on the (simulated) device engine
        self.assertEqual(gmem.memory_stat("gmem.steps_marked"), before + 1)
        gmem.torch._reset_for_tests()
        self.assertEqual(hooks, [], "the hook is removed with the rest")

    def test_steps_are_planned_unless_turned_off(self):
        hooks = self.install_with_optimizer_hooks()
        os.environ.pop("GMEM_PLAN_STEPS", None)
        gmem.torch.enable(oom_shim=False, _allow_simulated=True)
        self.assertEqual(len(hooks), 1, "a hook by default")
        self.assertEqual(self.marks_made_by(hooks[0]), 1)
        gmem.torch._reset_for_tests()
        os.environ["GMEM_PLAN_STEPS"] = "0"  # install() restores the environment afterwards
        gmem.torch.enable(oom_shim=False, _allow_simulated=True)
        self.assertEqual(self.marks_made_by(hooks[0]), 0, "GMEM_PLAN_STEPS=0 turns marks off")
        gmem.torch._reset_for_tests()
        gmem.torch.enable(oom_shim=False, _allow_simulated=True, plan_steps=True)
        self.assertEqual(self.marks_made_by(hooks[0]), 1,
                         "plan_steps=True asks for them whatever the environment says")
        gmem.torch._reset_for_tests()
        os.environ.pop("GMEM_PLAN_STEPS", None)
        gmem.torch.enable(oom_shim=False, _allow_simulated=True, plan_steps=False)
        self.assertEqual(self.marks_made_by(hooks[0]), 0, "plan_steps=False turns marks off")

    def marks_made_by(self, hook):
        """Step marks one optimizer step's hook makes."""
        with mock.patch.object(gmem.memory, "mark_step") as mark_step:
            hook(object(), (), {})
        return mark_step.call_count

    def test_the_optimizer_hook_publishes_this_rank_under_a_process_group(self):
        # With marks off too: the row is what another rank's out-of-memory report reads.
        hooks = self.install_with_optimizer_hooks()
        gmem.torch.enable(oom_shim=False, _allow_simulated=True, plan_steps=False)
        with mock.patch.object(gmem.distributed, "publish_now_and_then") as publish:
            hooks[0](object(), (), {})
            hooks[0](object(), (), {})
        self.assertEqual(publish.call_count, 2)

    def test_statistics_are_answered_by_gmem(self):
        torch = self.install(fake_torch())
        gmem.torch.enable(oom_shim=False, _allow_simulated=True)
        ptr = gmem.malloc(5 * MiB + 3)
        try:
            for module in (torch.cuda, torch.cuda.memory):
                self.assertEqual(module.memory_allocated(), gmem.memory_allocated())
                self.assertEqual(module.memory_allocated(0), gmem.memory_allocated())
                self.assertEqual(module.memory_reserved(), gmem.memory_reserved())
                self.assertEqual(module.max_memory_allocated(), gmem.max_memory_allocated())
                self.assertEqual(module.max_memory_reserved(), gmem.max_memory_reserved())
                self.assertEqual(module.memory_stats(), gmem.memory_stats())
                nested = module.memory_stats_as_nested_dict()
                self.assertEqual(nested["allocated_bytes"]["all"]["current"], gmem.memory_allocated())
                self.assertEqual(nested["gmem"]["memory_limit"], gmem.memory_limit())
                self.assertIn("gmem memory summary", module.memory_summary())
            self.assertGreaterEqual(torch.cuda.memory_allocated(), 5 * MiB + 512)
        finally:
            gmem.free(ptr)
        torch.cuda.reset_peak_memory_stats()
        self.assertEqual(torch.cuda.max_memory_allocated(), gmem.memory_allocated())
        torch.cuda.empty_cache()
        self.assertEqual(gmem.memory_reserved(), 0)

    def test_patches_are_undone_for_tests(self):
        torch = self.install(fake_torch())
        gmem.torch.enable(oom_shim=False, _allow_simulated=True)
        gmem.torch._reset_for_tests()
        self.assertEqual(torch.cuda.memory_allocated(), "native")
        self.assertEqual(torch.cuda.memory.memory_stats(), "native")


class FakeAllocatorLibrary:
    """What _shim.load_allocator returns: gmem_torch_allocator_install answers `reason`."""

    def __init__(self, reason=None):
        self.reason = reason
        self.installs = 0

    def gmem_torch_allocator_install(self, error, size):
        self.installs += 1
        if self.reason is None:
            return 0
        error.value = self.reason.encode()[: size - 1]
        return 1


class FullAllocatorTest(TorchFakeTestCase):
    def test_installs_gmem_allocator_and_patches_nothing(self):
        torch = self.install(fake_torch(), full=True)
        library = FakeAllocatorLibrary()
        with mock.patch.object(_shim, "load_allocator", return_value=library):
            gmem.torch.enable(_allow_simulated=True)
            gmem.torch.enable(_allow_simulated=True)
        self.assertEqual(library.installs, 1, "enable() twice installs once")
        self.assertEqual(gmem.torch.mode(), "full")
        self.assertEqual(torch.swapped, [], "no pluggable allocator")
        self.assertEqual(torch.cuda.memory_allocated(), "native", "PyTorch's own functions stay")
        self.assertIsNone(gmem.torch.entry_points())

    def test_already_initialized_allocator_is_too_late(self):
        self.install(fake_torch(), full=True)
        library = FakeAllocatorLibrary("Can't swap an already initialized allocator")
        with mock.patch.object(_shim, "load_allocator", return_value=library):
            with self.assertRaises(gmem.GmemError) as caught:
                gmem.torch.enable(_allow_simulated=True)
        self.assertIn("must run before the first CUDA allocation", str(caught.exception))
        self.assertIn("already initialized allocator", str(caught.exception))
        self.assertFalse(gmem.torch.is_enabled())

    def test_other_refusal_is_reported_as_such(self):
        self.install(fake_torch(), full=True)
        library = FakeAllocatorLibrary("something else")
        with mock.patch.object(_shim, "load_allocator", return_value=library):
            with self.assertRaises(gmem.GmemError) as caught:
                gmem.torch.enable(_allow_simulated=True)
        self.assertIn("PyTorch refused gmem's allocator: something else", str(caught.exception))

    def test_unbuildable_allocator_falls_back_to_pluggable_and_says_so_once(self):
        torch = self.install(fake_torch("/nonexistent/torch"), full=True)
        with mock.patch.dict(gmem.torch._state, {"fallback_warned": False}):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                gmem.torch.enable(oom_shim=False, _allow_simulated=True)
                gmem.torch._reset_for_tests()
                gmem.torch.enable(oom_shim=False, _allow_simulated=True)
            self.assertEqual(gmem.torch.mode(), "pluggable")
        fallback = [w for w in caught if "CUDAPluggableAllocator fallback" in str(w.message)]
        self.assertEqual(len(fallback), 1, [str(w.message) for w in caught])
        self.assertIn("torch's C++ headers are not installed", str(fallback[0].message))
        self.assertEqual(fallback[0].filename, __file__, "the warning points at the caller")
        self.assertEqual(len(torch.swapped), 2)
        self.assertEqual(torch.cuda.memory_allocated(), gmem.memory_allocated(), "patched")

    def test_allocator_needs_cuda_headers(self):
        tmp = tempfile.mkdtemp(prefix="gmem-alloc-test-")
        self.addCleanup(shutil.rmtree, tmp, True)
        os.makedirs(os.path.join(tmp, "torch", "include", "c10", "util"))
        open(os.path.join(tmp, "torch", "include", "c10", "util", "Exception.h"), "w").close()
        torch = fake_torch(os.path.join(tmp, "torch"))
        with mock.patch.object(_shim, "cuda_include_dir", return_value=None):
            with self.assertRaises(_shim.ShimUnavailable) as caught:
                _shim.build_allocator(torch)
        self.assertIn("cuda_runtime_api.h", str(caught.exception))
        with mock.patch.object(_shim, "cuda_include_dir", return_value=tmp), \
                mock.patch.object(_shim, "gmem_include_dir", return_value=None):
            with self.assertRaises(_shim.ShimUnavailable) as caught:
                _shim.build_allocator(torch)
        self.assertIn("GMEM_INCLUDE_DIR", str(caught.exception))

    def test_allocator_can_be_declined(self):
        with mock.patch.dict(os.environ, {"GMEM_TORCH_ALLOCATOR": "0"}):
            with self.assertRaises(_shim.ShimUnavailable):
                _shim.load_allocator(fake_torch())

    def test_gmem_headers_are_found_in_the_repository(self):
        self.assertTrue(os.path.isfile(os.path.join(_shim.gmem_include_dir(), "gmem", "gmem.h")))


class RefusalTest(TorchFakeTestCase):
    def test_too_late_once_cuda_is_initialised(self):
        torch = self.install(fake_torch(initialized=True))
        with self.assertRaises(gmem.GmemError) as caught:
            gmem.torch.enable(oom_shim=False, _allow_simulated=True)
        message = str(caught.exception)
        self.assertTrue(message.startswith(
            "gmem.torch.enable() must run before the first CUDA allocation"), message)
        self.assertIn("123 B", message, "what PyTorch's allocator already holds")
        self.assertIn("python -m gmem.run", message)
        self.assertEqual(torch.swapped, [])
        self.assertFalse(gmem.torch.is_enabled())
        self.assertEqual(torch.cuda.memory_allocated(), "native")

    def test_torch_refusing_the_swap(self):
        self.install(fake_torch(swap_error="Can't swap an already initialized allocator"))
        with self.assertRaises(gmem.GmemError) as caught:
            gmem.torch.enable(oom_shim=False, _allow_simulated=True)
        self.assertIn("must run before the first CUDA allocation", str(caught.exception))
        self.assertIn("Can't swap an already initialized allocator", str(caught.exception))
        self.assertFalse(gmem.torch.is_enabled())

    def test_simulated_device_is_refused(self):
        self.install(fake_torch())
        with self.assertRaises(gmem.GmemError) as caught:
            gmem.torch.enable(oom_shim=False)
        self.assertIn("GMEM_DEVICE=sim", str(caught.exception))

    def test_without_pytorch(self):
        self.install(None)  # `import torch` raises ImportError
        with self.assertRaises(gmem.GmemError) as caught:
            gmem.torch.enable()
        self.assertIn("needs PyTorch", str(caught.exception))


class ShimTest(TorchFakeTestCase):
    """The OOM shim, built against a stand-in of c10's exception header and library."""

    STUB_HEADER = """#pragma once
#include <cstdint>
#include <exception>
#include <string>
namespace c10 {
struct SourceLocation { const char* function; const char* file; std::uint32_t line; };
class Error : public std::exception {
 public:
  Error(SourceLocation location, std::string msg);
  const char* what() const noexcept override { return msg_.c_str(); }
 private:
  std::string msg_;
};
class OutOfMemoryError : public Error { using Error::Error; };
}  // namespace c10
#define C10_THROW_ERROR(err_type, msg) \\
  throw ::c10::err_type({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg)
"""
    STUB_SOURCE = """#include <c10/util/Exception.h>
c10::Error::Error(SourceLocation, std::string msg) : msg_(std::move(msg)) {}
"""

    @classmethod
    def setUpClass(cls):
        cls.cxx = shutil.which("c++") or shutil.which("g++")
        if cls.cxx is None:
            raise unittest.SkipTest("no C++ compiler")
        cls.tmp = tempfile.mkdtemp(prefix="gmem-shim-test-")
        cls.torch_dir = os.path.join(cls.tmp, "torch")
        os.makedirs(os.path.join(cls.torch_dir, "include", "c10", "util"))
        os.makedirs(os.path.join(cls.torch_dir, "lib"))
        with open(os.path.join(cls.torch_dir, "include", "c10", "util", "Exception.h"), "w") as f:
            f.write(cls.STUB_HEADER)
        source = os.path.join(cls.tmp, "c10.cpp")
        with open(source, "w") as f:
            f.write(cls.STUB_SOURCE)
        subprocess.check_call([cls.cxx, "-std=c++17", "-shared", "-fPIC", "-I",
                               os.path.join(cls.torch_dir, "include"), source, "-o",
                               os.path.join(cls.torch_dir, "lib", "libc10.so")])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        patcher = mock.patch.dict(os.environ, {"GMEM_CACHE_DIR": os.path.join(self.tmp, "cache")})
        patcher.start()
        self.addCleanup(patcher.stop)
        os.environ.pop("GMEM_TORCH_SHIM", None)

    def test_enable_builds_the_shim_and_allocates_through_it(self):
        torch = self.install(fake_torch(self.torch_dir))
        gmem.torch.enable(_allow_simulated=True)
        path, alloc_name, free_name = torch.swapped[0].args
        self.assertEqual((alloc_name, free_name), ("gmem_torch_shim_malloc", "gmem_torch_shim_free"))
        self.assertTrue(path.startswith(os.path.join(self.tmp, "cache")), path)
        self.assertEqual(_shim.build(torch), path, "the second build comes from the cache")

        shim = ctypes.CDLL(path)
        alloc = shim.gmem_torch_shim_malloc
        alloc.restype = ctypes.c_void_p
        alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        release = shim.gmem_torch_shim_free
        release.restype = None
        release.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        base = gmem.memory_allocated()
        ptr = alloc(3 * MiB, -1, None)
        self.assertTrue(ptr)
        self.assertEqual(gmem.memory_allocated() - base, 3 * MiB)
        release(ptr, 3 * MiB, 0, None)
        self.assertEqual(gmem.memory_allocated(), base)
        self.assertIsNone(alloc(0, -1, None), "empty tensors get no memory")

    def test_out_of_memory_is_thrown_as_c10_out_of_memory_error(self):
        # ctypes cannot catch a C++ exception: the child dies in std::terminate, which names the
        # exception's type and message.
        torch = fake_torch(self.torch_dir)
        path = _shim.build(torch)
        code = ("import ctypes, resource, gmem\n"
                "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from the abort\n"
                "from gmem import _shim\n"
                "_shim.load(None)\n"
                "gmem.set_memory_limit(64 << 20)\n"
                "shim = ctypes.CDLL(%r)\n"
                "alloc = shim.gmem_torch_shim_malloc\n"
                "alloc.restype = ctypes.c_void_p\n"
                "alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
                "alloc(128 << 20, -1, None)\n" % path)
        result = run_python(["-c", code], GMEM_TORCH_SHIM=path)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("c10::OutOfMemoryError", result.stderr)
        self.assertIn("tried to allocate 128.00 MiB", result.stderr)

    def test_missing_headers_fall_back_with_a_warning(self):
        torch = self.install(fake_torch("/nonexistent/torch"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gmem.torch.enable(_allow_simulated=True)
        self.assertTrue(any("without the torch shim" in str(w.message) for w in caught))
        self.assertEqual(torch.swapped[0].args[1:], ("gmem_torch_malloc", "gmem_torch_free"))


class RunTest(unittest.TestCase):
    def test_runs_a_script_as_main_with_its_arguments(self):
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "train.py")
            with open(script, "w") as f:
                f.write("import sys, os\n"
                        "assert __name__ == '__main__'\n"
                        "assert sys.path[0] == os.path.dirname(os.path.abspath(__file__))\n"
                        "print('ARGS', sys.argv[1:])\n"
                        "sys.exit(3)\n")
            result = run_python(["-m", "gmem.run", script, "a", "--b"], GMEM="0")
        self.assertEqual(result.returncode, 3, result.stderr)
        self.assertIn("ARGS ['a', '--b']", result.stdout)

    def test_enables_gmem_first(self):
        # Here torch is missing (or the device simulated): enable() fails before the script runs.
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "train.py")
            with open(script, "w") as f:
                f.write("print('SCRIPT RAN')\n")
            result = run_python(["-m", "gmem.run", script])
        self.assertNotEqual(result.returncode, 0)
        # One line saying why (no torch, or GMEM_DEVICE=sim), not a traceback.
        self.assertRegex(result.stderr, r"^gmem\.run: (PyTorch cannot be imported|gmem\.torch\.enable\(\) needs)")
        self.assertNotIn("Traceback", result.stderr)
        self.assertNotIn("SCRIPT RAN", result.stdout)

    def test_usage_errors(self):
        self.assertEqual(run_python(["-m", "gmem.run"]).returncode, 2)
        result = run_python(["-m", "gmem.run", "/nonexistent/train.py"])
        self.assertEqual(result.returncode, 2)
        self.assertIn("no such script", result.stderr)


if __name__ == "__main__":
    unittest.main()
