// The step kernels' bodies, written once over a Thrust execution policy: the CPU build
// instantiates them with thrust::host (step_kernels.cpp), the CUDA build with the CUDA
// back end on a stream (cuda/step_kernels.cu). Include after choosing the back end.
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

  template <bool kDecay, bool kMomentum, bool kFirst, bool kNesterov>
  void sgd(float* param, const float* grad, float* buf, std::int64_t numel, const SgdHyper& h) const {
    run(numel, SgdFunctor<kDecay, kMomentum, kFirst, kNesterov>{param, grad, buf, h.lr, h.momentum,
                                                                h.dampening, h.weight_decay});
  }

  template <bool kDecay>
  void sgd_with_decay(float* param, const float* grad, float* buf, std::int64_t numel,
                      const SgdHyper& h) const {
    if (h.momentum == 0.0f) return sgd<kDecay, false, false, false>(param, grad, buf, numel, h);
    if (h.first_step) {
      return h.nesterov ? sgd<kDecay, true, true, true>(param, grad, buf, numel, h)
                        : sgd<kDecay, true, true, false>(param, grad, buf, numel, h);
    }
    return h.nesterov ? sgd<kDecay, true, false, true>(param, grad, buf, numel, h)
                      : sgd<kDecay, true, false, false>(param, grad, buf, numel, h);
  }

  void sgd_step(float* param, const float* grad, float* momentum_buf, std::int64_t numel,
                const SgdHyper& h) const {
    if (h.weight_decay != 0.0f) {
      sgd_with_decay<true>(param, grad, momentum_buf, numel, h);
    } else {
      sgd_with_decay<false>(param, grad, momentum_buf, numel, h);
    }
  }

  void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
                 const AdamHyper& h) const {
    if (h.weight_decay == 0.0f) {
      run(numel, make_adam<0>(param, grad, exp_avg, exp_avg_sq, h));
    } else if (h.decoupled_weight_decay) {
      run(numel, make_adam<2>(param, grad, exp_avg, exp_avg_sq, h));
    } else {
      run(numel, make_adam<1>(param, grad, exp_avg, exp_avg_sq, h));
    }
  }

  double sum_of_squares(const float* x, std::int64_t numel) const {
    return thrust::transform_reduce(policy, x, x + numel, Square{}, 0.0, thrust::plus<double>());
  }
};

}  // namespace flatshard::optim::kernels::detail
