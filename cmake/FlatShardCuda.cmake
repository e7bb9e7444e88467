# The CUDA path is built whenever a toolkit is present (AUTO), so it cannot rot on
# machines without a GPU; ON makes a missing toolkit an error, OFF skips it.
set(FLATSHARD_HAVE_CUDA OFF)
if(NOT FLATSHARD_WITH_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(FLATSHARD_HAVE_CUDA ON)
  elseif(FLATSHARD_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "FLATSHARD_WITH_CUDA=ON but no CUDA compiler was found; "
                        "install the CUDA toolkit or configure with -DFLATSHARD_WITH_CUDA=OFF")
  endif()
endif()
message(STATUS "FlatShard CUDA path: ${FLATSHARD_HAVE_CUDA}")
