// Optimizer step kernels over flat fp32 shards, written once with Thrust: the CPU build
// runs them on Thrust's C++ back end, the CUDA build on the device. Formulas and
// operation order follow torch::optim's, so sharded training matches unsharded
// training to rounding.
#pragma once

#include <cstdint>

namespace flatshard::optim::kernels {

struct SgdHyper {
  float lr = 0;
  float momentum = 0;
  float dampening = 0;
  float weight_decay = 0;
  bool nesterov = false;
  bool first_step = true;  // the momentum buffer starts as a copy of the first update
};

// param -= lr * update, where update follows torch::optim::SGD.
// `momentum_buf` may be null when momentum == 0. `bf16_copy` (may be null): also writes
// each updated parameter rounded to bf16 there (as to_bf16 does).
void sgd_step(float* param, const float* grad, float* momentum_buf, std::int64_t numel, const SgdHyper& h,
              std::uint16_t* bf16_copy = nullptr);

// The hyperparameters as given (double, as torch's options hold them): make_adam rounds the
// factors to float where torch's tensor operations do (Note [Adam's factors]).
struct AdamHyper {
  double lr = 0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  bool decoupled_weight_decay = false;  // AdamW
  std::int64_t step = 1;                // 1 on the first step
};

// torch::optim::Adam (L2 weight decay) or AdamW (decoupled), without amsgrad.
// `bf16_copy` as for sgd_step.
void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
               const AdamHyper& h, std::uint16_t* bf16_copy = nullptr);

// Sum of squares of `numel` values of x, accumulated in double.
double sum_of_squares(const float* x, std::int64_t numel);

// x rounded to bf16, its bits in `out`: to nearest, ties to even, as c10::BFloat16 rounds
// on the host (a NaN becomes bf16's quiet NaN).
void to_bf16(const float* x, std::uint16_t* out, std::int64_t numel);

// The same kernels on CUDA device pointers (built when the CUDA toolkit is found;
// cuda/step_kernels.cu), issued on `stream` (a cudaStream_t; null: the calling thread's
// current stream) without waiting for them: the caller orders later work on that
// stream. sum_of_squares copies its result to the host and so waits for the stream.
namespace cuda {
void sgd_step(float* param, const float* grad, float* momentum_buf, std::int64_t numel, const SgdHyper& h,
              void* stream);
void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
               const AdamHyper& h, void* stream);
double sum_of_squares(const float* x, std::int64_t numel, void* stream);
}  // namespace cuda

// The CUDA kernels as the optimizers and clipping reach them: flatshard::cuda registers
// them when it is linked, so the core library needs no CUDA.
struct DeviceKernels {
  void (*sgd_step)(float* param, const float* grad, float* momentum_buf, std::int64_t numel,
                   const SgdHyper& h, void* stream) = nullptr;
  void (*adam_step)(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
                    const AdamHyper& h, void* stream) = nullptr;
  double (*sum_of_squares)(const float* x, std::int64_t numel, void* stream) = nullptr;
};
void register_cuda_kernels(const DeviceKernels& kernels);
// The registered CUDA kernels; throws InvalidArgument naming `who` when none are.
const DeviceKernels& cuda_kernels(const char* who);

}  // namespace flatshard::optim::kernels
