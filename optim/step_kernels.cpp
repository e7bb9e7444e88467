// The CPU instantiation of the step kernels: Thrust's C++ back end. The CUDA build
// compiles the same functors (step_functors.h) with the CUDA back end.
#define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_CPP
#include <thrust/execution_policy.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform_reduce.h>

#include "optim/step_functors.h"
#include "optim/step_kernels.h"

namespace flatshard::optim::kernels {

void sgd_step(float* param, const float* grad, float* momentum_buf, std::int64_t numel, const SgdHyper& h) {
  thrust::for_each_n(thrust::host, thrust::counting_iterator<std::int64_t>(0), numel,
                     SgdFunctor{param, grad, momentum_buf, h});
}

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
               const AdamHyper& h) {
  thrust::for_each_n(thrust::host, thrust::counting_iterator<std::int64_t>(0), numel,
                     AdamFunctor::make(param, grad, exp_avg, exp_avg_sq, h));
}

double sum_of_squares(const float* x, std::int64_t numel) {
  return thrust::transform_reduce(thrust::host, x, x + numel, Square{}, 0.0, thrust::plus<double>());
}

}  // namespace flatshard::optim::kernels
