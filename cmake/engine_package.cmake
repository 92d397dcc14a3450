# The engine packages' CMake (integration/vllm, integration/sglang; scikit-build-core runs their
# CMakeLists.txt as the top-level project): libdpbalance.so from the project's own CMake,
# installed with the Python adapter into the package folder PKG (the wheel's component of the
# same name). Only the plugin is built: no tests, tools or benchmarks. Call it from
# integration/<engine>/CMakeLists.txt, with this file included from the checkout's cmake/.
function(dpb_engine_package PKG)
  set(DPB_BUILD_TESTS OFF CACHE BOOL "" FORCE)
  set(DPB_BUILD_BENCHMARKS OFF CACHE BOOL "" FORCE)
  set(DPB_BUILD_TOOLS OFF CACHE BOOL "" FORCE)
  set(DPB_WITH_NCCL "AUTO" CACHE STRING "")
  get_filename_component(root "${CMAKE_CURRENT_SOURCE_DIR}/../.." ABSOLUTE)
  add_subdirectory("${root}" dpbalance EXCLUDE_FROM_ALL)
  install(TARGETS dpbalance_plugin LIBRARY DESTINATION ${PKG} COMPONENT ${PKG})
  install(FILES "${root}/integration/adapters/python/dpbalance_plugin.py"
          DESTINATION ${PKG} COMPONENT ${PKG})
endfunction()
