# gmem_gpu_tests: GoogleTest programs that need a real GPU (gpu/). They build wherever the CUDA
# toolkit is, and run on a GPU machine: build/gmem_gpu_tests. Default architecture sm_90 (H100);
# pass -DCMAKE_CUDA_ARCHITECTURES=... for other GPUs.
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(STATUS "gmem: no CUDA compiler, gmem_gpu_tests not built")
  return()
endif()
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 90)
endif()
enable_language(CUDA)
# gmem's headers are C++20; older CMake (3.25) does not know nvcc's flag for it.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)

find_package(GTest REQUIRED)
add_executable(gmem_gpu_tests
  ${PROJECT_SOURCE_DIR}/gpu/gpu_tests.cu
  ${PROJECT_SOURCE_DIR}/gpu/gpu_kernels.cu
  ${PROJECT_SOURCE_DIR}/gpu/gpu_capi_tests.cpp)
set_target_properties(gmem_gpu_tests PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR})
target_include_directories(gmem_gpu_tests PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(gmem_gpu_tests PRIVATE gmem_cuda gmem_shared CUDA::cudart GTest::gtest GTest::gtest_main)
