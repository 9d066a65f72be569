"""gmem.__version__: the package's version (the CMake project's). A leaf, so that gmem.doctor
reads it without importing the package's __init__, which sits above every module."""

__version__ = "0.1.0"
