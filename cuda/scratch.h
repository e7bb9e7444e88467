// Where the CUDA step kernels' scratch comes from (cuda/step_kernels.cu): flatshard::cuda
// registers LibTorch's caching allocator (cuda/register.cpp); unset, Thrust's own cudaMalloc.
#pragma once

#include <cstddef>

namespace flatshard::optim::kernels::cuda {

struct ScratchFunctions {
  void* (*allocate)(std::size_t bytes, void* stream) = nullptr;  // on `stream` (a cudaStream_t)
  void (*release)(void* ptr) = nullptr;
};
void set_scratch_functions(const ScratchFunctions& functions);

}  // namespace flatshard::optim::kernels::cuda
