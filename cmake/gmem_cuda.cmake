# The CUDA backend: gmem_cuda (CudaDevice, CudaSegmentDevice). It links no CUDA library: the
# driver is opened with dlopen at first use (src/device/cuda_driver.cpp), so everything built on
# it also loads on machines without a GPU driver. Only the toolkit's headers are needed here.
add_library(gmem_cuda STATIC
  ${PROJECT_SOURCE_DIR}/src/device/cuda_driver.cpp
  ${PROJECT_SOURCE_DIR}/src/device/cuda_device.cpp
  ${PROJECT_SOURCE_DIR}/src/device/cuda_segment_device.cpp
)
target_include_directories(gmem_cuda PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_include_directories(gmem_cuda SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
target_compile_options(gmem_cuda PRIVATE ${GMEM_WARNINGS})
target_link_libraries(gmem_cuda PUBLIC gmem_core PRIVATE ${CMAKE_DL_LIBS})
