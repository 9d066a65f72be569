"""The `gmem` command that `pip install .` puts on PATH: runs the CLI binary (gmem replay,
summary, leaks...) that the install built into the package as gmem/bin/gmem, or, in an editable
install, the repository's build/gmem. `gmem doctor` is python -m gmem.doctor."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
CANDIDATES = (os.path.join(_HERE, "bin", "gmem"),
              os.path.join(os.path.dirname(os.path.dirname(_HERE)), "build", "gmem"))


def main():
    if sys.argv[1:2] == ["doctor"]:  # Python's half: the driver, torch, the allocator route
        from gmem import doctor
        return doctor.main(sys.argv[2:])
    for binary in CANDIDATES:
        if os.path.isfile(binary) and os.access(binary, os.X_OK):
            # Replaces this process: the exit status and signals are the binary's own.
            os.execv(binary, ["gmem"] + sys.argv[1:])
    sys.stderr.write("gmem: the command-line tool is not in this installation (looked at %s); "
                     "`pip install .` from the repository builds it into the package, CMake builds "
                     "it as build/gmem\n" % ", ".join(CANDIDATES))
    return 127


if __name__ == "__main__":
    sys.exit(main())
