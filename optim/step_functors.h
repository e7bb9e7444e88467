// Per-element optimizer updates, shared by the CPU and CUDA instantiations.
#pragma once

#include <cmath>
#include <cstdint>

#include <thrust/detail/config.h>

#include "optim/step_kernels.h"

// Each CPU instruction set's build of these functors (step_kernels_isa.cpp) names its own
// inline namespace, so that the linker never merges one build's inline code into another's.
#ifndef FLATSHARD_KERNEL_ISA
#define FLATSHARD_KERNEL_ISA portable
#endif

namespace flatshard::optim::kernels {
inline namespace FLATSHARD_KERNEL_ISA {

// torch::optim::SGD, per element:
//   d = g + wd * p;  buf = first ? d : momentum * buf + (1 - dampening) * d
//   d = nesterov ? d + momentum * buf : buf;  p -= lr * d
// The mode flags are template parameters so that each instantiation's loop has no
// branches and vectorizes.
template <bool kDecay, bool kMomentum, bool kFirst, bool kNesterov>
struct SgdFunctor {
  float* __restrict__ param;
  const float* __restrict__ grad;
  float* __restrict__ buf;
  float lr, momentum, dampening, weight_decay;

  __host__ __device__ void operator()(std::int64_t i) const {
    float d = grad[i];
    if (kDecay) d = d + weight_decay * param[i];
    if (kMomentum) {
      const float b = kFirst ? d : momentum * buf[i] + (1.0f - dampening) * d;
      buf[i] = b;
      d = kNesterov ? d + momentum * b : b;
    }
    param[i] = param[i] - lr * d;
  }
};

// torch::optim::Adam / AdamW, per element, in torch's operation order:
//   AdamW: p *= 1 - lr * wd;  Adam: g += wd * p
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// kDecay: 0 none, 1 L2 (Adam), 2 decoupled (AdamW).
template <int kDecay>
struct AdamFunctor {
  float* __restrict__ param;
  const float* __restrict__ grad;
  float* __restrict__ m;
  float* __restrict__ v;
  float beta1, beta2, eps;
  float one_minus_beta1, one_minus_beta2;  // 1 - beta in double, then rounded (not 1 - (float)beta)
  float decay;                             // L2: weight_decay; decoupled: 1 - lr * weight_decay
  float step_size;                         // lr / (1 - beta1^step)
  float bc2_sqrt;                          // sqrt(1 - beta2^step)

  __host__ __device__ void operator()(std::int64_t i) const {
    float p = param[i];
    float g = grad[i];
    if (kDecay == 2) p = p * decay;
    if (kDecay == 1) g = g + decay * p;
    const float mi = beta1 * m[i] + one_minus_beta1 * g;
    const float vi = beta2 * v[i] + one_minus_beta2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) / bc2_sqrt + eps;
    param[i] = p - step_size * (mi / denom);
  }
};

// Note [Adam's factors]
// torch's Adam computes each scalar factor in double (1 - beta2, 1 - beta2^step,
// lr / (1 - beta1^step), 1 - lr * weight_decay) and rounds it to float only as a tensor
// operation takes it. Rounding beta2 first (1 - 0.999f is 9.99987e-4, against 1 - 0.999's
// 1.0000000475e-3 as a float) would weigh every squared gradient 1.3e-5 less than torch
// does, a bias in every update rather than a rounding.
template <int kDecay>
AdamFunctor<kDecay> make_adam(float* param, const float* grad, float* m, float* v, const AdamHyper& h) {
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  const double decay = kDecay == 2 ? 1.0 - h.lr * h.weight_decay : h.weight_decay;
  return AdamFunctor<kDecay>{param,
                             grad,
                             m,
                             v,
                             static_cast<float>(h.beta1),
                             static_cast<float>(h.beta2),
                             static_cast<float>(h.eps),
                             static_cast<float>(1.0 - h.beta1),
                             static_cast<float>(1.0 - h.beta2),
                             static_cast<float>(decay),
                             static_cast<float>(h.lr / bc1),
                             static_cast<float>(std::sqrt(bc2))};
}

// The step over `numel` elements for h's modes: run(numel, functor) with the functor
// instantiated for them (each back end's run loops over the elements).
template <bool kDecay, bool kMomentum, bool kFirst, bool kNesterov, typename Run>
void sgd_with(const Run& run, float* param, const float* grad, float* buf, std::int64_t numel,
              const SgdHyper& h) {
  run(numel, SgdFunctor<kDecay, kMomentum, kFirst, kNesterov>{param, grad, buf, h.lr, h.momentum, h.dampening,
                                                              h.weight_decay});
}

template <bool kDecay, typename Run>
void sgd_with_decay(const Run& run, float* param, const float* grad, float* buf, std::int64_t numel,
                    const SgdHyper& h) {
  if (h.momentum == 0.0f) return sgd_with<kDecay, false, false, false>(run, param, grad, buf, numel, h);
  if (h.first_step) {
    return h.nesterov ? sgd_with<kDecay, true, true, true>(run, param, grad, buf, numel, h)
                      : sgd_with<kDecay, true, true, false>(run, param, grad, buf, numel, h);
  }
  return h.nesterov ? sgd_with<kDecay, true, false, true>(run, param, grad, buf, numel, h)
                    : sgd_with<kDecay, true, false, false>(run, param, grad, buf, numel, h);
}

template <typename Run>
void sgd_modes(const Run& run, float* param, const float* grad, float* buf, std::int64_t numel,
               const SgdHyper& h) {
  if (h.weight_decay != 0.0f) {
    sgd_with_decay<true>(run, param, grad, buf, numel, h);
  } else {
    sgd_with_decay<false>(run, param, grad, buf, numel, h);
  }
}

template <typename Run>
void adam_modes(const Run& run, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                std::int64_t numel, const AdamHyper& h) {
  if (h.weight_decay == 0.0f) {
    run(numel, make_adam<0>(param, grad, exp_avg, exp_avg_sq, h));
  } else if (h.decoupled_weight_decay) {
    run(numel, make_adam<2>(param, grad, exp_avg, exp_avg_sq, h));
  } else {
    run(numel, make_adam<1>(param, grad, exp_avg, exp_avg_sq, h));
  }
}

struct Square {
  __host__ __device__ double operator()(float x) const { return static_cast<double>(x) * x; }
};

}  // namespace FLATSHARD_KERNEL_ISA
}  // namespace flatshard::optim::kernels
