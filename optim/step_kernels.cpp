// The CPU instantiation of the step kernels: Thrust's C++ back end over fixed chunks
// that LibTorch's intra-op pool runs in parallel (a CPU-offloaded step of a billion
// parameters is memory-bound work for every core). The CUDA build compiles the same
// bodies (step_kernels_impl.h) with the CUDA back end.
#define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_CPP
#include <thrust/execution_policy.h>

#include "optim/step_kernels_impl.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <string>
#include <vector>

#include "flatshard/errors.h"

namespace flatshard::optim::kernels {
namespace {

const detail::Kernels<decltype(thrust::host)> host{thrust::host};

// Chunk boundaries depend on the element count alone, never on the number of threads,
// so results (the sum of squares too) are the same at any thread count.
constexpr std::int64_t kChunk = std::int64_t{1} << 16;

template <typename F>
void for_chunks(std::int64_t numel, const F& f) {
  const std::int64_t chunks = (numel + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, 1, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t c = first; c < last; ++c) f(c, c * kChunk, std::min(kChunk, numel - c * kChunk));
  });
}

}  // namespace

void sgd_step(float* param, const float* grad, float* momentum_buf, std::int64_t numel, const SgdHyper& h) {
  for_chunks(numel, [&](std::int64_t, std::int64_t b, std::int64_t n) {
    host.sgd_step(param + b, grad + b, momentum_buf ? momentum_buf + b : nullptr, n, h);
  });
}

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
               const AdamHyper& h) {
  for_chunks(numel, [&](std::int64_t, std::int64_t b, std::int64_t n) {
    host.adam_step(param + b, grad + b, exp_avg + b, exp_avg_sq + b, n, h);
  });
}

double sum_of_squares(const float* x, std::int64_t numel) {
  if (numel <= kChunk) return host.sum_of_squares(x, numel);
  std::vector<double> partial(static_cast<std::size_t>((numel + kChunk - 1) / kChunk));
  for_chunks(numel, [&](std::int64_t c, std::int64_t b, std::int64_t n) {
    partial[static_cast<std::size_t>(c)] = host.sum_of_squares(x + b, n);
  });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

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
