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

if(FLATSHARD_HAVE_CUDA)
  # H100 and H200 (sm_90) unless the caller chooses.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  find_library(FLATSHARD_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} REQUIRED)
  find_path(FLATSHARD_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} REQUIRED)
  # The CUDA caching allocator's statistics come from the pinned torch's c10_cuda.
  find_library(FLATSHARD_C10_CUDA_LIBRARY c10_cuda HINTS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED)
  # CUDA tensors need LibTorch's CUDA kernels loaded: link torch_cuda even though no
  # symbol of it is referenced.
  find_library(FLATSHARD_TORCH_CUDA_LIBRARY torch_cuda HINTS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED)

  # flatshard::cuda: the step kernels on the CUDA back end, NCCL on CUDA streams with a
  # watchdog, CUDA memory figures. Built (and so kept compiling) wherever a toolkit is.
  # The kernels see only FlatShard's kernel headers and CUDA's Thrust (no LibTorch).
  add_library(flatshard_cuda_kernels OBJECT cuda/step_kernels.cu)
  target_include_directories(flatshard_cuda_kernels PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_compile_options(flatshard_cuda_kernels PRIVATE --expt-relaxed-constexpr)
  add_library(flatshard_cuda cuda/nccl_communicator.cpp $<TARGET_OBJECTS:flatshard_cuda_kernels>)
  add_library(flatshard::cuda ALIAS flatshard_cuda)
  target_include_directories(flatshard_cuda PRIVATE ${CMAKE_CURRENT_SOURCE_DIR} ${FLATSHARD_NCCL_INCLUDE})
  target_link_libraries(flatshard_cuda
    PUBLIC flatshard "-Wl,--no-as-needed" ${FLATSHARD_TORCH_CUDA_LIBRARY} "-Wl,--as-needed"
    PRIVATE CUDA::cudart ${FLATSHARD_NCCL_LIBRARY} ${FLATSHARD_C10_CUDA_LIBRARY}
            $<BUILD_INTERFACE:fmt::fmt-header-only>)
  target_compile_definitions(flatshard_cuda PRIVATE FMT_HEADER_ONLY=1)
  set_target_properties(flatshard_cuda PROPERTIES CUDA_SEPARABLE_COMPILATION OFF EXPORT_NAME cuda)
endif()

if(FLATSHARD_HAVE_CUDA AND FLATSHARD_BUILD_TESTS)
  # GPU tests: built everywhere, registered with ctest only with FLATSHARD_GPU_TESTS=ON
  # (scripts/gpu.sh on a GPU machine).
  option(FLATSHARD_GPU_TESTS "Register the GPU tests with ctest" OFF)
  find_package(GTest REQUIRED)
  add_executable(flatshard_cuda_tests tests/cuda/test_cuda.cpp)
  target_include_directories(flatshard_cuda_tests PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(flatshard_cuda_tests PRIVATE flatshard_cuda CUDA::cudart GTest::gtest_main)
  if(FLATSHARD_GPU_TESTS)
    include(GoogleTest)
    gtest_discover_tests(flatshard_cuda_tests DISCOVERY_TIMEOUT 120 PROPERTIES TIMEOUT 300 LABELS gpu)
  endif()
endif()
