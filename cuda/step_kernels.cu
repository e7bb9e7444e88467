// The CUDA instantiation of the step kernels: the bodies of step_kernels_impl.h on
// Thrust's CUDA back end, on the caller's stream, without host synchronisation.
#include <cuda_runtime.h>
#include <thrust/execution_policy.h>
#include <thrust/system/cuda/execution_policy.h>

#include "cuda/scratch.h"
#include "optim/step_kernels_impl.h"

namespace flatshard::optim::kernels::cuda {
namespace {

auto on(void* stream) {
  return detail::Kernels<decltype(thrust::cuda::par_nosync.on(cudaStream_t{}))>{
      thrust::cuda::par_nosync.on(static_cast<cudaStream_t>(stream))};
}

ScratchFunctions scratch_functions;

// Thrust's temporary storage (a reduction's partial sums) from the functions registered,
// LibTorch's caching allocator: without them Thrust calls cudaMalloc and cudaFree, which
// reach past the allocator (failing when it holds the device's memory) and wait for the
// whole device.
struct Scratch {
  using value_type = char;
  void* stream;
  char* allocate(std::ptrdiff_t bytes) {
    return static_cast<char*>(scratch_functions.allocate(static_cast<std::size_t>(bytes), stream));
  }
  void deallocate(char* p, std::size_t) { scratch_functions.release(p); }
};

}  // namespace

void set_scratch_functions(const ScratchFunctions& functions) { scratch_functions = functions; }

void sgd_step(float* param, const float* grad, float* momentum_buf, std::int64_t numel, const SgdHyper& h,
              void* stream) {
  on(stream).sgd_step(param, grad, momentum_buf, numel, h);
}

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
               const AdamHyper& h, void* stream) {
  on(stream).adam_step(param, grad, exp_avg, exp_avg_sq, numel, h);
}

double sum_of_squares(const float* x, std::int64_t numel, void* stream) {
  // A reduction returns its value to the host: this one synchronises with the stream, so its
  // scratch is free to go when it returns.
  const auto s = static_cast<cudaStream_t>(stream);
  if (scratch_functions.allocate) {
    Scratch scratch{stream};
    return detail::Kernels<decltype(thrust::cuda::par(scratch).on(s))>{thrust::cuda::par(scratch).on(s)}
        .sum_of_squares(x, numel);
  }
  return detail::Kernels<decltype(thrust::cuda::par.on(s))>{thrust::cuda::par.on(s)}.sum_of_squares(x, numel);
}

}  // namespace flatshard::optim::kernels::cuda
