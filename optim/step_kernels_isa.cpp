// One build of the CPU step kernels over a chunk: compiled once per instruction set
// (CMakeLists.txt: FLATSHARD_KERNEL_ISA names it, with that set's -m flags), each in its
// own inline namespace (step_functors.h). Plain loops over the functors, which GCC
// vectorizes at -O3; no Thrust here, whose non-template code the builds would share.
#include <cstring>

#include "optim/step_functors.h"
#include "optim/step_kernels_cpu.h"

namespace flatshard::optim::kernels::cpu {
namespace {

// The loop over the elements; GCC vectorizes it with the functor inlined.
const auto loop = [](std::int64_t numel, const auto& f) {
  for (std::int64_t i = 0; i < numel; ++i) f(i);
};

void sgd_step(float* param, const float* grad, float* momentum_buf, std::int64_t numel, const SgdHyper& h) {
  sgd_modes(loop, param, grad, momentum_buf, numel, h);
}

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
               const AdamHyper& h) {
  adam_modes(loop, param, grad, exp_avg, exp_avg_sq, numel, h);
}

double sum_of_squares(const float* x, std::int64_t numel) {
  double total = 0;  // left to right: the same sum in every build
  for (std::int64_t i = 0; i < numel; ++i) total += Square{}(x[i]);
  return total;
}

// fp32 to bf16 bits, to nearest with ties to even: adding 0x7FFF and the lowest kept bit
// carries into the kept bits exactly when the dropped half rounds up (c10::BFloat16's
// rounding). Plain integer arithmetic, which GCC vectorizes.
void to_bf16(const float* x, std::uint16_t* out, std::int64_t numel) {
  for (std::int64_t i = 0; i < numel; ++i) {
    std::uint32_t u;
    std::memcpy(&u, &x[i], sizeof u);
    const std::uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    out[i] = x[i] != x[i] ? std::uint16_t{0x7FC0} : static_cast<std::uint16_t>(rounded);
  }
}

}  // namespace

#define FLATSHARD_STRINGIFY_(x) #x
#define FLATSHARD_STRINGIFY(x) FLATSHARD_STRINGIFY_(x)

const ChunkKernels& FLATSHARD_KERNEL_ISA() {
  static const ChunkKernels table{FLATSHARD_STRINGIFY(FLATSHARD_KERNEL_ISA), &sgd_step, &adam_step,
                                  &sum_of_squares, &to_bf16};
  return table;
}

}  // namespace flatshard::optim::kernels::cpu
