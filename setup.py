"""`pip install .`: builds libgmem.so and the gmem CLI with CMake, then installs the Python
package python/gmem with both inside it (gmem/libgmem.so, gmem/bin/gmem), so that `import gmem`
and `python -m gmem.run` work from anywhere without GMEM_LIBRARY or PYTHONPATH.

Metadata lives in pyproject.toml; this file only adds the CMake step. Environment:
  CMAKE_ARGS, GMEM_CMAKE_ARGS   extra arguments for CMake's configure step (in that order)
  CMAKE_BUILD_PARALLEL_LEVEL    build jobs (default: the number of CPUs)
  CMAKE_GENERATOR               CMake's own variable; else Ninja when installed
The CUDA backend is built when CMake finds the CUDA toolkit, as in any CMake build of gmem
(-DGMEM_WITH_CUDA=ON in GMEM_CMAKE_ARGS makes a missing toolkit an error).

gmem's PyTorch allocator (python/gmem/_torch_allocator.cpp) is compiled here too when torch can
be imported (so `pip install --no-build-isolation .`, which sees the environment's torch), against
that torch, with the function and flags of a compile at first use (gmem._shim), into the package:
then first use needs no compiler. Without torch, or when that compile fails (no CUDA headers, say),
the install still succeeds, says why, and gmem.torch compiles the allocator at first use.
  GMEM_BUILD_TORCH_ALLOCATOR   0: do not; 1: fail the install when it cannot be built; else: try

Everything setuptools writes goes under build-pip/ (the CMake build in
build-pip/temp.*/cmake, kept between installs so that a reinstall only recompiles what
changed), never under build/, the CMake build directory that README and scripts/test use.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import types

import setuptools
from setuptools import Distribution, setup
from setuptools.command.build_py import build_py
from setuptools.errors import SetupError

try:
    import setuptools.command.bdist_wheel  # noqa: F401  (setuptools >= 70.1 makes wheels itself)
except ImportError:
    try:
        import wheel  # noqa: F401  (older setuptools need the wheel package for bdist_wheel)
    except ImportError:
        # pip shows this when the build fails with "invalid command 'bdist_wheel'".
        print("gmem: this setuptools (%s) needs the wheel package to build a wheel; install it "
              "(Debian: python3-wheel) or use a Python that has it" % setuptools.__version__,
              file=sys.stderr)

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_BASE = "build-pip"
# The C API headers that go into the package (gmem/include/gmem/).
C_HEADERS = ("gmem.h", "gmem_observe.h")
# Target, the file it produces in the CMake build directory, where it goes in the package.
OUTPUTS = (
    ("gmem_shared", "libgmem.so", "libgmem.so"),
    ("gmem_cli", "gmem", os.path.join("bin", "gmem")),
)
INSTALL_HINT = "Debian: sudo apt-get install cmake ninja-build g++ zlib1g-dev"


def version():
    """The version in CMakeLists.txt's project(), so that the two cannot disagree."""
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        match = re.search(r"project\(\s*gmem\s+VERSION\s+([0-9.]+)", f.read())
    if not match:
        raise SetupError("no project(gmem VERSION x.y.z) in CMakeLists.txt")
    return match.group(1)


def run(cmd, what):
    print("gmem:", " ".join(shlex.quote(part) for part in cmd), flush=True)
    try:
        subprocess.run(cmd, check=True)
    except subprocess.CalledProcessError as e:
        raise SetupError("gmem: %s failed (exit status %d; CMake's output is above). %s"
                         % (what, e.returncode, INSTALL_HINT)) from None


def cmake_build(build_dir):
    """Configures and builds only the library and the CLI in build_dir; returns build_dir."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise SetupError("gmem: building libgmem.so needs CMake >= 3.20 and a C++20 compiler, and "
                         "cmake is not on PATH. " + INSTALL_HINT)
    configure = [cmake, "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                 "-DGMEM_BUILD_TESTS=OFF", "-DGMEM_BUILD_BENCH=OFF", "-DGMEM_BUILD_FUZZ=OFF"]
    # An existing build directory keeps its generator; CMAKE_GENERATOR is CMake's own choice.
    if (not os.path.exists(os.path.join(build_dir, "CMakeCache.txt"))
            and not os.environ.get("CMAKE_GENERATOR") and shutil.which("ninja")):
        configure += ["-G", "Ninja"]
    # The user's arguments come last, so that they override ours (-DCMAKE_BUILD_TYPE=Debug, say).
    for var in ("CMAKE_ARGS", "GMEM_CMAKE_ARGS"):
        configure += shlex.split(os.environ.get(var, ""))
    run(configure, "configuring libgmem with CMake")
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
    targets = [target for target, _, _ in OUTPUTS]
    run([cmake, "--build", build_dir, "--target", *targets, "--parallel", jobs],
        "building libgmem with CMake")
    return build_dir


def build_torch_allocator(package_dir, build_dir):
    """Compiles gmem's PyTorch allocator into package_dir for the torch of this environment and
    records the outcome (gmem/torch_allocator.json: which torch, or why not), which gmem.torch and
    `python -m gmem.doctor` read."""
    # This source tree's gmem._shim (and the _lib and errors it imports) without gmem/__init__.py,
    # which imports the whole package: only the compile function is needed here.
    package = types.ModuleType("gmem")
    package.__path__ = [os.path.join(ROOT, "python", "gmem")]
    sys.modules["gmem"] = package
    from gmem import _shim

    choice = os.environ.get("GMEM_BUILD_TORCH_ALLOCATOR", "")
    reason = None
    if choice == "0":
        reason = "GMEM_BUILD_TORCH_ALLOCATOR=0"
    else:
        try:
            import torch
        except ImportError as e:
            reason = "torch could not be imported when gmem was installed (%s)" % e
        else:
            print("gmem: compiling gmem's PyTorch allocator against torch %s (%s)"
                  % (torch.__version__, os.path.dirname(torch.__file__)), flush=True)
            try:
                path = _shim.build_allocator_into(torch, package_dir,
                                                  os.path.join(build_dir, "libgmem.so"),
                                                  os.path.join(ROOT, "include"))
            except _shim.ShimUnavailable as e:
                reason = "compiling it against torch %s failed: %s" % (torch.__version__, e)
            else:
                print("gmem: built %s for torch %s: gmem.torch uses it with no compile at first use"
                      % (os.path.basename(path), torch.__version__), flush=True)
                return
    if choice == "1":
        raise SetupError("gmem: GMEM_BUILD_TORCH_ALLOCATOR=1, but gmem's PyTorch allocator was "
                         "not built: %s" % reason)
    _shim.write_prebuilt_record(package_dir, {"built": False, "reason": reason})
    print("gmem: gmem's PyTorch allocator was not built at install time (%s); gmem.torch.enable() "
          "will compile it at first use (needs a C++ compiler, torch's and CUDA's headers), else "
          "fall back to CUDAPluggableAllocator. Reinstall with torch present to build it now."
          % reason, flush=True)


class BuildPy(build_py):
    """build_py, plus libgmem.so and the CLI from CMake copied into the built package."""

    def run(self):
        editable = getattr(self, "editable_mode", False)
        if not editable:
            # setuptools never empties build_lib: a file since removed from python/gmem would
            # otherwise stay in every later wheel. (The CMake build is elsewhere, in build_temp.)
            shutil.rmtree(os.path.join(self.build_lib, "gmem"), ignore_errors=True)
        super().run()
        if editable:
            # `pip install -e .` imports python/gmem in place, and gmem/_lib.py then finds
            # build/libgmem.so in the repository: build that with CMake (README's first command).
            print("gmem: editable install: libgmem.so is not built here; gmem uses "
                  "build/libgmem.so from the repository (cmake -S . -B build && cmake --build build)")
            return
        build_temp = self.get_finalized_command("build").build_temp
        build_dir = cmake_build(os.path.abspath(os.path.join(build_temp, "cmake")))
        for _, built, dest in OUTPUTS:
            target = os.path.join(self.build_lib, "gmem", dest)
            self.mkpath(os.path.dirname(target))
            self.copy_file(os.path.join(build_dir, built), target)  # keeps the executable bit
        # The C API's headers: gmem/_torch_allocator.cpp is compiled against them at first use
        # (gmem._shim.gmem_include_dir looks in gmem/include).
        for header in C_HEADERS:
            target = os.path.join(self.build_lib, "gmem", "include", "gmem", header)
            self.mkpath(os.path.dirname(target))
            self.copy_file(os.path.join(ROOT, "include", "gmem", header), target)
        build_torch_allocator(os.path.join(self.build_lib, "gmem"), build_dir)


class BinaryDistribution(Distribution):
    """The wheel holds a native library: tag it for this platform and Python, not as pure."""

    def has_ext_modules(self):
        return True


os.makedirs(os.path.join(ROOT, BUILD_BASE), exist_ok=True)  # egg_info wants egg_base to exist
# egg_info adds the files of an existing SOURCES.txt to the package's: a file that leaves the
# package data (or MANIFEST.in) would stay in every later wheel. Start from the sources alone.
shutil.rmtree(os.path.join(ROOT, BUILD_BASE, "gmem.egg-info"), ignore_errors=True)
setup(
    version=version(),
    distclass=BinaryDistribution,
    cmdclass={"build_py": BuildPy},
    # Out of build/ (CMake's) and out of python/ (no gmem.egg-info in the source tree).
    options={"build": {"build_base": BUILD_BASE}, "egg_info": {"egg_base": BUILD_BASE}},
)
