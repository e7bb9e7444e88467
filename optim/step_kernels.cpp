// The CPU instantiation of the step kernels: Thrust's C++ back end. The CUDA build
// compiles the same bodies (step_kernels_impl.h) with the CUDA back end.
#define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_CPP
#include <thrust/execution_policy.h>

#include "optim/step_kernels_impl.h"

#include <atomic>
#include <string>

#include "flatshard/errors.h"

namespace flatshard::optim::kernels {
namespace {

const detail::Kernels<decltype(thrust::host)> host{thrust::host};

}  // namespace

void sgd_step(float* param, const float* grad, float* momentum_buf, std::int64_t numel, const SgdHyper& h) {
  host.sgd_step(param, grad, momentum_buf, numel, h);
}

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
               const AdamHyper& h) {
  host.adam_step(param, grad, exp_avg, exp_avg_sq, numel, h);
}

double sum_of_squares(const float* x, std::int64_t numel) { return host.sum_of_squares(x, numel); }

namespace {
std::atomic<const DeviceKernels*> registered{nullptr};
}  // namespace

void register_cuda_kernels(const DeviceKernels& kernels) { registered.store(&kernels); }

const DeviceKernels& cuda_kernels(const char* who) {
  const DeviceKernels* k = registered.load();
  if (k == nullptr) {
    throw InvalidArgument(std::string("flatshard::") + who +
                          ": CUDA tensors need the CUDA kernels; link flatshard::cuda (built where the CUDA "
                          "toolkit is found)");
  }
  return *k;
}

}  // namespace flatshard::optim::kernels
