#!/usr/bin/env bash
# `pip install` of the repository as a PyTorch user would do it, offline: into a fresh virtual
# environment, with --no-build-isolation --no-index (the build backend is Debian's setuptools, no
# package index is reached). Then, from an unrelated folder with no PYTHONPATH or GMEM_LIBRARY,
# uses what was installed: the package and its libgmem.so, python -m gmem.run, the gmem command.
# Prints one "ok: NAME" or "FAILED: NAME" line per check (scripts/test counts them); the exit
# status is nonzero when one failed.
#   GMEM_PACKAGE_PYTHON  the Python to install for (default: Debian's /usr/bin/python3, whose
#                        setuptools and wheel are python3-setuptools and python3-wheel; a pyenv
#                        or conda python3 first on PATH may lack wheel)
#   CMAKE_BUILD_PARALLEL_LEVEL  build jobs for setup.py's CMake build (its default: all CPUs)
# The CMake build lands in build-pip/ (setup.py) and is kept, so a rerun recompiles only changes.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${GMEM_PACKAGE_PYTHON:-}"
if [ -z "$python" ]; then
  python=/usr/bin/python3
  [ -x "$python" ] || python=python3
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
venv="$tmp/venv"
elsewhere="$tmp/elsewhere"  # the user's folder: nothing of the repository in it
mkdir -p "$elsewhere"
failures=0

result() {  # result NAME STATUS
  if [ "$2" -eq 0 ]; then echo "ok: $1"; else echo "FAILED: $1"; failures=$((failures + 1)); fi
}

# Runs the venv's python (or another of its programs) in $elsewhere, with nothing from the caller's
# environment that could find the repository's package or library instead of the installed ones.
in_venv() {
  (cd "$elsewhere" && env -u PYTHONPATH -u GMEM_LIBRARY PYTHONNOUSERSITE=1 GMEM_DEVICE=sim "$@")
}

# 1. The install. Everything it writes in the source tree must go to build-pip/ (ignored), not to
# build/ (the CMake build that README and scripts/test use) nor python/ (gmem.egg-info, say).
stamp="$tmp/stamp"
touch "$stamp"
sleep 1  # mtimes of one-second resolution
before="$(cd "$root" && git status --porcelain 2>/dev/null)"
echo "installing $root with $python ($("$python" --version 2>&1))"
start=$SECONDS
if "$python" -m venv --system-site-packages "$venv" >"$tmp/venv.log" 2>&1 &&
   "$venv/bin/python" -m pip install -v --no-build-isolation --no-index --no-cache-dir "$root" \
     >"$tmp/pip.log" 2>&1; then
  echo "installed in $((SECONDS - start)) s"
  result "pip install --no-build-isolation --no-index" 0
else
  cat "$tmp/venv.log"
  tail -n 60 "$tmp/pip.log" 2>/dev/null
  echo "(no venv? Debian: sudo apt-get install python3-venv python3-pip python3-setuptools python3-wheel)"
  result "pip install --no-build-isolation --no-index" 1
  exit 1  # nothing else can be checked
fi
touched="$(cd "$root" && find build python -newer "$stamp" -not -path '*/__pycache__*' 2>/dev/null)"
after="$(cd "$root" && git status --porcelain 2>/dev/null)"
if [ -n "$touched" ] || [ "$before" != "$after" ]; then
  echo "the install wrote in the source tree:"
  echo "$touched"
  diff <(echo "$before") <(echo "$after")
  result "source tree untouched (build/, python/, git status)" 1
else
  result "source tree untouched (build/, python/, git status)" 0
fi

# 2. import gmem: the installed package with the library inside it, on the simulated device.
in_venv "$venv/bin/python" - "$venv" <<'EOF'
import os, sys
from importlib import metadata
import gmem
package = os.path.dirname(os.path.realpath(gmem.__file__))
assert package.startswith(os.path.realpath(sys.argv[1])), "gmem imported from %s" % package
assert gmem.library_path() == os.path.join(package, "libgmem.so"), gmem.library_path()
from gmem import _shim
assert os.path.isfile(os.path.join(package, "_torch_shim.cpp")), "the torch shim source is missing"
assert os.path.isfile(os.path.join(package, "_torch_allocator.cpp")), "the allocator source is missing"
headers = sorted(os.listdir(os.path.join(package, "_torch_allocator")))  # its private headers
for header in ("convert.hpp", "engines.hpp", "history.hpp", "pools.hpp"):
    assert header in headers, "the allocator header _torch_allocator/%s is missing" % header
keyed = [os.path.realpath(path) for path in _shim.allocator_sources()[1:]]  # the cache key's
assert keyed == [os.path.join(package, "_torch_allocator", h) for h in headers
                 if h.endswith(".hpp")], (keyed, headers)
assert _shim.gmem_include_dir() == os.path.join(package, "include"), _shim.gmem_include_dir()
assert gmem.__version__ == metadata.version("gmem"), (gmem.__version__, metadata.version("gmem"))
p = gmem.malloc(3 << 20)
assert gmem.memory_allocated() == 3 << 20, gmem.memory_allocated()
gmem.free(p)
assert gmem.memory_stat("allocated_bytes.all.current") == 0
assert gmem.memory_stat("allocated_bytes.all.peak") == 3 << 20
print("gmem", gmem.__version__, "from", package)
EOF
result "import gmem: malloc, free, stats from the installed libgmem.so" $?

# 3. python -m gmem.run on a script of the user's folder: GMEM=0 runs it as python would (its
# arguments, its folder on sys.path); without it gmem.torch is enabled first, which here must
# refuse with its own message (no torch, or GMEM_DEVICE=sim), proving the run got that far.
cat >"$elsewhere/helper.py" <<'EOF'
GREETING = "helper imported"
EOF
cat >"$elsewhere/train.py" <<'EOF'
import sys
import gmem
import helper  # from the script's folder
gmem.free(gmem.malloc(1 << 20))
print(helper.GREETING, sys.argv[1:], gmem.max_memory_allocated())
EOF
out="$(in_venv env GMEM=0 "$venv/bin/python" -m gmem.run train.py --epochs 3 2>&1)"
echo "$out"
[ "$out" = "helper imported ['--epochs', '3'] 1048576" ]
result "python -m gmem.run train.py (GMEM=0)" $?
out="$(in_venv "$venv/bin/python" -m gmem.run train.py 2>&1)"
status=$?
echo "$out" | tail -n 1
# One line that says why (no torch here; or GMEM_DEVICE=sim where torch is), no traceback.
[ "$status" -ne 0 ] && [ "$(echo "$out" | wc -l)" -eq 1 ] &&
  echo "$out" | grep -Eq '^gmem\.run: (PyTorch cannot be imported|gmem\.torch\.enable\(\) needs)'
result "python -m gmem.run train.py enables gmem.torch first" $?

# 4. gmem's PyTorch allocator at install time: built against the venv's torch when it has one
# (gmem/torch_allocator.json names that torch, and doctor says the route is the install's build);
# without torch the install said so, recorded why, and doctor says none without torch. Either way
# `python -m gmem.doctor` and `gmem doctor` run and end with a verdict.
if in_venv "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  in_venv "$venv/bin/python" - <<'EOF'
import json, os, torch, gmem
package = os.path.dirname(gmem.__file__)
record = json.load(open(os.path.join(package, "torch_allocator.json")))
assert record["built"] and record["torch"] == torch.__version__, record
assert os.path.isfile(os.path.join(package, "libgmem_torch_allocator.so"))
EOF
  status=$?
  out="$(in_venv "$venv/bin/python" -m gmem.doctor 2>&1)"
  echo "$out"
  [ "$status" -eq 0 ] &&
    echo "$out" | grep -q '^allocator  *full (built at install): built at install time against torch'
  result "the PyTorch allocator built at install time against the venv's torch" $?
else
  in_venv "$venv/bin/python" - <<'EOF'
import json, os, gmem
package = os.path.dirname(gmem.__file__)
record = json.load(open(os.path.join(package, "torch_allocator.json")))
assert not record["built"] and "torch could not be imported" in record["reason"], record
assert not os.path.exists(os.path.join(package, "libgmem_torch_allocator.so"))
EOF
  status=$?
  out="$(in_venv "$venv/bin/python" -m gmem.doctor 2>&1)"
  echo "$out"
  [ "$status" -eq 0 ] && grep -q "gmem.torch.enable() will compile it at first use" "$tmp/pip.log" &&
    echo "$out" | grep -q '^allocator  *none without torch; at install: torch could not be imported'
  result "without torch the install succeeds and says the allocator is compiled at first use" $?
fi
out="$(in_venv "$venv/bin/gmem" doctor 2>&1)"
status=$?
echo "$out" | tail -n 1
[ "$status" -eq 0 ] && echo "$out" | grep -q '^verdict  '
result "python -m gmem.doctor, gmem doctor" $?

# 5. The gmem command: the CLI binary inside the package, at the project's version.
version="$(in_venv "$venv/bin/python" -c 'import gmem; print(gmem.__version__)')"
out="$(in_venv "$venv/bin/gmem" --version 2>&1)"
echo "$out"
[ "$out" = "gmem $version" ] &&
  in_venv "$venv/bin/gmem" replay "$root/tests/data/tiny_leak.trace.csv.gz" | grep -q '^tiny_leak '
result "gmem --version, gmem replay" $?

[ "$failures" -eq 0 ]
