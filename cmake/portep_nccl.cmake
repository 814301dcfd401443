# NCCL's device API for the NCCL device path (gpu_kernels/nccl/nccl_lsa.h): compiled where its headers are found,
# CUDA only. NCCL is never linked (its host functions are looked up at run time); the headers' version is the one
# release the build runs under. PORTEP_NCCL_INCLUDE: their folder (nccl.h, nccl_device.h); by default an installed
# nvidia-nccl-cu12 / -cu13 wheel's, as the Python that builds sees it.
set(PORTEP_NCCL_INCLUDE "" CACHE PATH "NCCL's include folder with nccl_device.h (default: an nvidia-nccl wheel's)")
option(PORTEP_NCCL_DEVICE "Build the NCCL device path where NCCL's device headers are found" ON)

function(portep_find_nccl_include out)
  set(dir "${PORTEP_NCCL_INCLUDE}")
  if(dir STREQUAL "")
    execute_process(COMMAND "${Python_EXECUTABLE}" -c
                            "import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], 'include'))"
                    OUTPUT_VARIABLE dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  if(NOT dir STREQUAL "" AND EXISTS "${dir}/nccl_device.h" AND EXISTS "${dir}/nccl.h")
    set(${out} "${dir}" PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

# Adds the device path (or its refusing stand-in) to the GPU kernels' library `target`; sets
# PORTEP_NCCL_DEVICE_REASON (empty: built) and PORTEP_NCCL_DEVICE_HEADERS for build_info.
function(portep_nccl_device target)
  set(reason "")
  set(include "")
  if(NOT PORTEP_NCCL_DEVICE)
    set(reason "disabled with PORTEP_NCCL_DEVICE=OFF")
  elseif(NOT PORTEP_GPU_RUNTIME STREQUAL "cuda")
    set(reason "a ${PORTEP_GPU_RUNTIME} build (NCCL's device API is CUDA's, RCCL's is another)")
  else()
    portep_find_nccl_include(include)
    if(include STREQUAL "")
      set(reason "NCCL's device headers (nccl_device.h) not found at build time (pip install nvidia-nccl-cu12 or \
-cu13, or -Ccmake.define.PORTEP_NCCL_INCLUDE=<folder>)")
    endif()
  endif()
  string(REPLACE ";" "," reason "${reason}")  # (a list separator would split the definition below)
  if(reason STREQUAL "")
    target_sources(${target} PRIVATE gpu_kernels/nccl/nccl_lsa.cu)
    set_source_files_properties(gpu_kernels/nccl/nccl_lsa.cu PROPERTIES INCLUDE_DIRECTORIES "${include}")
    message(STATUS "portep: NCCL device path ON (headers in ${include})")
  else()
    target_sources(${target} PRIVATE gpu_kernels/nccl/nccl_lsa_none.cpp)
    set_source_files_properties(gpu_kernels/nccl/nccl_lsa_none.cpp PROPERTIES LANGUAGE CXX COMPILE_DEFINITIONS
                                                                             "PORTEP_NCCL_DEVICE_REASON=\"${reason}\"")
    message(STATUS "portep: NCCL device path OFF: ${reason}")
  endif()
  set(PORTEP_NCCL_DEVICE_REASON "${reason}" PARENT_SCOPE)
endfunction()
