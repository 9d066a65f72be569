# `cmake --install` and the CMake package: find_package(gmem) gives
#   gmem::gmem       the C++ engine and the simulated device (static)
#   gmem::gmem_observe  tracking, scopes, summaries, OOM reports, snapshots, leak detection and
#                    the trace readers (static; gmem_tracking, gmem_analysis and gmem_trace)
#   gmem::gmem_cuda  CudaDevice and CudaSegmentDevice (static; when built with CUDA)
#   gmem::gmem_c     libgmem.so, the C API
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(GMEM_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/gmem)
set_target_properties(gmem_core PROPERTIES EXPORT_NAME gmem)
set_target_properties(gmem_shared PROPERTIES EXPORT_NAME gmem_c)
set_target_properties(gmem_tracking PROPERTIES EXPORT_NAME gmem_observe)
set(GMEM_INSTALL_TARGETS gmem_core gmem_trace gmem_analysis gmem_tracking gmem_shared)
if(GMEM_CUDA)
  set_target_properties(gmem_cuda PROPERTIES EXPORT_NAME gmem_cuda)
  list(APPEND GMEM_INSTALL_TARGETS gmem_cuda)
endif()

install(TARGETS ${GMEM_INSTALL_TARGETS} EXPORT gmemTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/gmem DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT gmemTargets NAMESPACE gmem:: DESTINATION ${GMEM_INSTALL_CMAKEDIR})

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/gmemConfig.cmake.in
  ${PROJECT_BINARY_DIR}/gmemConfig.cmake INSTALL_DESTINATION ${GMEM_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/gmemConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/gmemConfig.cmake ${PROJECT_BINARY_DIR}/gmemConfigVersion.cmake
  DESTINATION ${GMEM_INSTALL_CMAKEDIR})
