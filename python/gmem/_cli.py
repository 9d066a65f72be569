"""The `gmem` command that `pip install .` puts on PATH: runs the CLI binary (gmem replay,
summary, leaks...) that the install built and placed in the package, gmem/bin/gmem."""

import os
import sys

BINARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "gmem")


def main():
    if not os.access(BINARY, os.X_OK):
        sys.stderr.write("gmem: the command-line tool is not in this installation (no %s); it is "
                         "built by `pip install .` from the repository, or by CMake as build/gmem\n"
                         % BINARY)
        return 127
    os.execv(BINARY, ["gmem"] + sys.argv[1:])  # replaces this process: exit status and signals pass through


if __name__ == "__main__":
    sys.exit(main())
