// Per-element optimizer updates, shared by the CPU and CUDA instantiations.
#pragma once

#include <cmath>
#include <cstdint>

#include <thrust/detail/config.h>

#include "optim/step_kernels.h"

namespace flatshard::optim::kernels {

// torch::optim::SGD, per element:
//   d = g + wd * p;  buf = first ? d : momentum * buf + (1 - dampening) * d
//   d = nesterov ? d + momentum * buf : buf;  p -= lr * d
struct SgdFunctor {
  float* param;
  const float* grad;
  float* buf;
  SgdHyper h;

  __host__ __device__ void operator()(std::int64_t i) const {
    float d = grad[i];
    if (h.weight_decay != 0.0f) d = d + h.weight_decay * param[i];
    if (h.momentum != 0.0f) {
      float b = h.first_step ? d : h.momentum * buf[i] + (1.0f - h.dampening) * d;
      buf[i] = b;
      d = h.nesterov ? d + h.momentum * b : b;
    }
    param[i] = param[i] - h.lr * d;
  }
};

// torch::optim::Adam / AdamW, per element, in torch's operation order:
//   AdamW: p *= 1 - lr * wd;  Adam: g += wd * p
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
struct AdamFunctor {
  float* param;
  const float* grad;
  float* m;
  float* v;
  AdamHyper h;
  float step_size;        // lr / (1 - beta1^step)
  float bc2_sqrt;         // sqrt(1 - beta2^step)

  static AdamFunctor make(float* param, const float* grad, float* m, float* v, const AdamHyper& h) {
    const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(h.step));
    const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(h.step));
    return AdamFunctor{param, grad, m, v, h, static_cast<float>(h.lr / bc1), static_cast<float>(std::sqrt(bc2))};
  }

  __host__ __device__ void operator()(std::int64_t i) const {
    float p = param[i];
    float g = grad[i];
    if (h.weight_decay != 0.0f) {
      if (h.decoupled_weight_decay) {
        p = p * (1.0f - h.lr * h.weight_decay);
      } else {
        g = g + h.weight_decay * p;
      }
    }
    const float mi = h.beta1 * m[i] + (1.0f - h.beta1) * g;
    const float vi = h.beta2 * v[i] + (1.0f - h.beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) / bc2_sqrt + h.eps;
    param[i] = p - step_size * (mi / denom);
  }
};

struct Square {
  __host__ __device__ double operator()(float x) const { return static_cast<double>(x) * x; }
};

}  // namespace flatshard::optim::kernels
