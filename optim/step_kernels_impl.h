// The CUDA step kernels' bodies over a Thrust execution policy: the functors of
// step_functors.h (which the CPU's builds run in plain loops, step_kernels_isa.cpp) on the
// CUDA back end on a stream (cuda/step_kernels.cu). Include after choosing the back end.
#pragma once

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform_reduce.h>

#include "optim/step_functors.h"
#include "optim/step_kernels.h"

namespace flatshard::optim::kernels::detail {

template <typename Policy>
struct Kernels {
  Policy policy;

  template <typename F>
  void run(std::int64_t numel, const F& f) const {
    thrust::for_each_n(policy, thrust::counting_iterator<std::int64_t>(0), numel, f);
  }

  void sgd_step(float* param, const float* grad, float* momentum_buf, std::int64_t numel,
                const SgdHyper& h) const {
    sgd_modes([this](std::int64_t n, const auto& f) { run(n, f); }, param, grad, momentum_buf, numel, h);
  }

  void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
                 const AdamHyper& h) const {
    adam_modes([this](std::int64_t n, const auto& f) { run(n, f); }, param, grad, exp_avg, exp_avg_sq, numel,
               h);
  }

  double sum_of_squares(const float* x, std::int64_t numel) const {
    return thrust::transform_reduce(policy, x, x + numel, Square{}, 0.0, thrust::plus<double>());
  }
};

}  // namespace flatshard::optim::kernels::detail
