# The CUDA backend: gmem_cuda (CudaDevice, CudaSegmentDevice). It links no CUDA library: the
# driver is opened with dlopen at first use (src/device/cuda_driver.cpp), so everything built on
# it also loads on machines without a GPU driver. Only the toolkit's headers are needed here.
add_library(gmem_cuda STATIC
  ${PROJECT_SOURCE_DIR}/src/device/cuda_driver.cpp
  ${PROJECT_SOURCE_DIR}/src/device/cuda_device.cpp
  ${PROJECT_SOURCE_DIR}/src/device/cuda_segment_device.cpp
  ${PROJECT_SOURCE_DIR}/src/device/cuda_copy.cpp
)
# gmem_copy_async's kernel (src/device/copy_kernel.cu) as PTX for compute capability 7.5 and up,
# JIT-compiled by the driver when first loaded; without nvcc, copies go through cuMemcpyDtoDAsync.
if(CUDAToolkit_NVCC_EXECUTABLE)
  set(gmem_ptx ${PROJECT_BINARY_DIR}/generated/copy_kernel.ptx)
  set(gmem_ptx_cpp ${PROJECT_BINARY_DIR}/generated/copy_kernel_ptx.cpp)
  add_custom_command(OUTPUT ${gmem_ptx}
    COMMAND ${CUDAToolkit_NVCC_EXECUTABLE} -ptx -arch=compute_75 -O3 -o ${gmem_ptx}
            ${PROJECT_SOURCE_DIR}/src/device/copy_kernel.cu
    DEPENDS ${PROJECT_SOURCE_DIR}/src/device/copy_kernel.cu
    COMMENT "gmem: the copy kernel's PTX" VERBATIM)
  add_custom_command(OUTPUT ${gmem_ptx_cpp}
    COMMAND ${CMAKE_COMMAND} -DPTX=${gmem_ptx} -DOUT=${gmem_ptx_cpp}
            -P ${PROJECT_SOURCE_DIR}/cmake/embed_ptx.cmake
    DEPENDS ${gmem_ptx} ${PROJECT_SOURCE_DIR}/cmake/embed_ptx.cmake VERBATIM)
  target_sources(gmem_cuda PRIVATE ${gmem_ptx_cpp})
  target_compile_definitions(gmem_cuda PRIVATE GMEM_COPY_KERNEL_PTX=1)
endif()
target_include_directories(gmem_cuda PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_include_directories(gmem_cuda SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
target_compile_options(gmem_cuda PRIVATE ${GMEM_WARNINGS})
target_link_libraries(gmem_cuda PUBLIC gmem_core PRIVATE ${CMAKE_DL_LIBS})
