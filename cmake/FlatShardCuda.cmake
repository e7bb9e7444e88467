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
# A toolkit without one of the CUDA path's dependencies: an error under ON; under AUTO
# the CUDA path is skipped with a warning that names what is missing.
macro(flatshard_cuda_unavailable what)
  if(FLATSHARD_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "FLATSHARD_WITH_CUDA=ON but ${what} was not found; install it or "
                        "configure with -DFLATSHARD_WITH_CUDA=OFF")
  endif()
  message(WARNING "FlatShard CUDA path skipped: ${what} was not found")
  set(FLATSHARD_HAVE_CUDA OFF)
endmacro()

if(FLATSHARD_HAVE_CUDA)
  # H100 and H200 (sm_90) unless the caller chooses.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  # NCCL: the one the torch wheel brings (nvidia-nccl, whose directory holds only
  # libnccl.so.2), which LibTorch loads: a process has one libnccl.so.2, so building
  # against another (the toolkit's, a system package's) could compile against one version
  # and run another. Else the toolkit's. The header is taken from beside the library.
  get_filename_component(_flatshard_pip_nccl "${TORCH_INSTALL_PREFIX}/../nvidia/nccl" ABSOLUTE)
  find_library(FLATSHARD_NCCL_LIBRARY NAMES nccl libnccl.so.2 PATHS "${_flatshard_pip_nccl}/lib"
               NO_DEFAULT_PATH)
  find_library(FLATSHARD_NCCL_LIBRARY NAMES nccl libnccl.so.2
               HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib)
  if(FLATSHARD_NCCL_LIBRARY)
    get_filename_component(_flatshard_nccl_dir "${FLATSHARD_NCCL_LIBRARY}" DIRECTORY)
    find_path(FLATSHARD_NCCL_INCLUDE nccl.h NO_DEFAULT_PATH
              HINTS "${_flatshard_nccl_dir}/../include" ${CUDAToolkit_INCLUDE_DIRS})
    if(NOT FLATSHARD_NCCL_INCLUDE)
      find_path(FLATSHARD_NCCL_INCLUDE nccl.h HINTS "${_flatshard_pip_nccl}/include")
    endif()
  endif()
  # Thrust and CUB (CCCL) for the step kernels.
  find_path(FLATSHARD_THRUST_INCLUDE thrust/version.h
            HINTS ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES cccl)
  # The CUDA caching allocator's statistics come from the pinned torch's c10_cuda.
  find_library(FLATSHARD_C10_CUDA_LIBRARY c10_cuda HINTS "${TORCH_INSTALL_PREFIX}/lib")
  # CUDA tensors need LibTorch's CUDA kernels loaded: link torch_cuda even though no
  # symbol of it is referenced.
  find_library(FLATSHARD_TORCH_CUDA_LIBRARY torch_cuda HINTS "${TORCH_INSTALL_PREFIX}/lib")
  if(NOT FLATSHARD_NCCL_LIBRARY)
    flatshard_cuda_unavailable("NCCL (libnccl)")
  elseif(NOT FLATSHARD_NCCL_INCLUDE)
    flatshard_cuda_unavailable("NCCL's header nccl.h")
  elseif(NOT FLATSHARD_THRUST_INCLUDE)
    flatshard_cuda_unavailable("Thrust (the toolkit's CCCL headers)")
  elseif(NOT FLATSHARD_C10_CUDA_LIBRARY OR NOT FLATSHARD_TORCH_CUDA_LIBRARY)
    flatshard_cuda_unavailable("a CUDA build of LibTorch (c10_cuda, torch_cuda)")
  else()
    message(STATUS "FlatShard NCCL: ${FLATSHARD_NCCL_LIBRARY}")
  endif()
endif()
message(STATUS "FlatShard CUDA path: ${FLATSHARD_HAVE_CUDA}")

if(FLATSHARD_HAVE_CUDA)
  # flatshard::cuda: the step kernels on the CUDA back end, NCCL on CUDA streams with a
  # watchdog, CUDA memory figures. Built (and so kept compiling) wherever a toolkit is.
  # The kernels see only FlatShard's kernel headers and CUDA's Thrust (no LibTorch).
  add_library(flatshard_cuda_kernels OBJECT cuda/step_kernels.cu)
  target_include_directories(flatshard_cuda_kernels PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_compile_options(flatshard_cuda_kernels PRIVATE --expt-relaxed-constexpr)
  # The functors' own inline namespace (step_functors.h), apart from the CPU builds'.
  target_compile_definitions(flatshard_cuda_kernels PRIVATE FLATSHARD_KERNEL_ISA=device)
  add_library(flatshard_cuda cuda/device.cpp cuda/nccl_transport.cpp cuda/host_staged_transport.cpp
              cuda/register.cpp $<TARGET_OBJECTS:flatshard_cuda_kernels>)
  add_library(flatshard::cuda ALIAS flatshard_cuda)
  target_include_directories(flatshard_cuda PRIVATE ${CMAKE_CURRENT_SOURCE_DIR} ${FLATSHARD_NCCL_INCLUDE})
  target_link_libraries(flatshard_cuda
    PUBLIC flatshard "-Wl,--no-as-needed" ${FLATSHARD_TORCH_CUDA_LIBRARY} "-Wl,--as-needed"
    PRIVATE CUDA::cudart ${FLATSHARD_NCCL_LIBRARY} ${FLATSHARD_C10_CUDA_LIBRARY}
            $<BUILD_INTERFACE:fmt::fmt-header-only>)
  target_compile_definitions(flatshard_cuda PRIVATE FMT_HEADER_ONLY=1)
  # Linking flatshard::cuda registers the CUDA transports and kernels (static
  # initialisers in cuda/register.cpp): keep that object in a static link.
  target_link_options(flatshard_cuda INTERFACE "LINKER:--undefined=flatshard_cuda_link_anchor")
  set_target_properties(flatshard_cuda PROPERTIES CUDA_SEPARABLE_COMPILATION OFF EXPORT_NAME cuda)
endif()

if(FLATSHARD_HAVE_CUDA AND FLATSHARD_BUILD_TESTS)
  # GPU tests: built everywhere, registered with ctest only with FLATSHARD_GPU_TESTS=ON
  # (scripts/gpu.sh on a GPU machine).
  option(FLATSHARD_GPU_TESTS "Register the GPU tests with ctest" OFF)
  find_package(GTest REQUIRED)
  add_executable(flatshard_cuda_tests tests/cuda/test_cuda.cpp)
  target_include_directories(flatshard_cuda_tests PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(flatshard_cuda_tests PRIVATE flatshard_cuda flatshard_test_support CUDA::cudart GTest::gtest_main)
  if(FLATSHARD_GPU_TESTS)
    include(GoogleTest)
    gtest_discover_tests(flatshard_cuda_tests DISCOVERY_TIMEOUT 120 PROPERTIES TIMEOUT 300 LABELS gpu)
  endif()
endif()

if(FLATSHARD_HAVE_CUDA)
  # A >= 1B-parameter GPT on one GPU under full shard (bf16): tokens/s, MFU, peak memory;
  # scripts/gpu.sh runs it beside PyTorch FSDP2 (bench/peer_fsdp2_gpu.py). Needs no
  # Google Benchmark, so that the GPU machine builds it with the benchmarks off.
  add_executable(bench_gpt_gpu bench/bench_gpt_gpu.cpp)
  target_include_directories(bench_gpt_gpu PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(bench_gpt_gpu PRIVATE flatshard_cuda CUDA::cudart ${FLATSHARD_C10_CUDA_LIBRARY})
endif()
