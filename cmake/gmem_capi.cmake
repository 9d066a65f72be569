# libgmem.so (target gmem_shared): the C API of include/gmem/gmem.h, for C programs, ctypes and
# torch's CUDAPluggableAllocator. It carries the engine inside and exports only gmem_* symbols.
add_library(gmem_shared SHARED
  ${PROJECT_SOURCE_DIR}/src/capi/gmem_c.cpp
  ${PROJECT_SOURCE_DIR}/src/capi/engine_c.cpp
  ${PROJECT_SOURCE_DIR}/src/capi/observe_c.cpp
  ${PROJECT_SOURCE_DIR}/src/capi/registry.cpp
  ${PROJECT_SOURCE_DIR}/src/capi/device_context.cpp)
set_target_properties(gmem_shared PROPERTIES
  OUTPUT_NAME gmem
  LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}
  LINK_DEPENDS ${PROJECT_SOURCE_DIR}/src/capi/gmem.map)
target_include_directories(gmem_shared
  PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:include>
  PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_compile_options(gmem_shared PRIVATE ${GMEM_WARNINGS})
target_link_libraries(gmem_shared PRIVATE gmem_core gmem_analysis)  # analysis: memory_summary
target_link_libraries(gmem_shared PRIVATE gmem_tracking)  # gmem_observe.h: tracker, snapshots, OOM reports
# --as-needed: the summary pulls no trace reader, so libz (gmem_analysis's) is not needed.
target_link_options(gmem_shared PRIVATE -Wl,--as-needed
                    -Wl,--version-script=${PROJECT_SOURCE_DIR}/src/capi/gmem.map)
if(NOT GMEM_SANITIZE)
  target_link_options(gmem_shared PRIVATE -Wl,--no-undefined)  # a missing symbol fails the link
endif()
if(GMEM_CUDA)
  target_compile_definitions(gmem_shared PRIVATE GMEM_HAVE_CUDA)
  target_link_libraries(gmem_shared PRIVATE gmem_cuda)
endif()
