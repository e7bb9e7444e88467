// The CUDA instantiation of the step kernels: the bodies of step_kernels_impl.h on
// Thrust's CUDA back end, on the caller's stream, without host synchronisation.
#include <cuda_runtime.h>
#include <thrust/execution_policy.h>
#include <thrust/system/cuda/execution_policy.h>

#include "optim/step_kernels_impl.h"

namespace flatshard::optim::kernels::cuda {
namespace {

auto on(void* stream) {
  return detail::Kernels<decltype(thrust::cuda::par_nosync.on(cudaStream_t{}))>{
      thrust::cuda::par_nosync.on(static_cast<cudaStream_t>(stream))};
}

}  // namespace

void sgd_step(float* param, const float* grad, float* momentum_buf, std::int64_t numel, const SgdHyper& h,
              void* stream) {
  on(stream).sgd_step(param, grad, momentum_buf, numel, h);
}

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
               const AdamHyper& h, void* stream) {
  on(stream).adam_step(param, grad, exp_avg, exp_avg_sq, numel, h);
}

double sum_of_squares(const float* x, std::int64_t numel, void* stream) {
  // A reduction returns its value to the host: this one synchronises with the stream.
  return detail::Kernels<decltype(thrust::cuda::par.on(cudaStream_t{}))>{
      thrust::cuda::par.on(static_cast<cudaStream_t>(stream))}
      .sum_of_squares(x, numel);
}

}  // namespace flatshard::optim::kernels::cuda
