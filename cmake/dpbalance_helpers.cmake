# Warnings and sanitizers for every dpbalance target.
function(dpb_target_defaults target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wno-missing-field-initializers)
  if(DPB_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=address,undefined -fno-omit-frame-pointer
                                             -fno-sanitize-recover=undefined)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
endfunction()

# Locates NCCL (headers + library) under CUDA_HOME, NCCL_HOME or the toolkit. Creates dpb::nccl.
function(dpb_find_nccl)
  set(DPB_HAVE_NCCL OFF PARENT_SCOPE)
  if(DPB_WITH_NCCL STREQUAL "OFF")
    return()
  endif()
  find_package(CUDAToolkit QUIET)
  find_path(NCCL_INCLUDE_DIR nccl.h
            HINTS $ENV{NCCL_HOME}/include ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2
               HINTS $ENV{NCCL_HOME}/lib ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
  if(CUDAToolkit_FOUND AND NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    add_library(dpb_nccl INTERFACE)
    target_include_directories(dpb_nccl INTERFACE ${NCCL_INCLUDE_DIR})
    target_link_libraries(dpb_nccl INTERFACE ${NCCL_LIBRARY} CUDA::cudart)
    add_library(dpb::nccl ALIAS dpb_nccl)
    # Exported so that static consumers of dpbalance::collectives link NCCL and the CUDA runtime.
    set_target_properties(dpb_nccl PROPERTIES EXPORT_NAME nccl)
    install(TARGETS dpb_nccl EXPORT dpbalanceTargets)
    set(DPB_HAVE_NCCL ON PARENT_SCOPE)
    message(STATUS "dpbalance: NCCL backend ON (${NCCL_LIBRARY})")
  elseif(DPB_WITH_NCCL STREQUAL "ON")
    message(FATAL_ERROR "DPB_WITH_NCCL=ON but CUDA toolkit or NCCL not found")
  else()
    message(STATUS "dpbalance: NCCL backend OFF (toolkit or NCCL not found)")
  endif()
endfunction()
