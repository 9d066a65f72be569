# Sourced by the GPU scripts of bench/torch: builds libgmem.so with CUDA into build-gpu/ (Release)
# and points GMEM_LIBRARY and PYTHONPATH at it. Run from the repository root.
gpu_build_args=(-S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DGMEM_WITH_CUDA=ON -DGMEM_BUILD_BENCH=OFF -DGMEM_BUILD_TESTS=OFF)
[ -f build-gpu/CMakeCache.txt ] || gpu_build_args+=(-G Ninja)
cmake "${gpu_build_args[@]}" >/dev/null && cmake --build build-gpu -j16 --target gmem_shared >/dev/null || { echo BUILD FAILED; exit 1; }
export GMEM_LIBRARY=$PWD/build-gpu/libgmem.so PYTHONPATH=$PWD/python
