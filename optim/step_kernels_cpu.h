// The CPU step kernels over one chunk of a shard, built once per x86-64 vector width
// (step_kernels_isa.cpp, compiled with each width's flags) and chosen at run time by what
// the CPU runs: the step over a billion offloaded parameters is per-element arithmetic
// that the width speeds up as much as memory allows. Every build computes the same bits:
// the same operations in the same order, without contracting a multiply and an add into
// one rounding (-ffp-contract=off), and sums accumulated left to right in double.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "optim/step_kernels.h"

namespace flatshard::optim::kernels::cpu {

struct ChunkKernels {
  const char* isa;  // "portable" (the compiler's baseline), "avx2", "avx512"
  void (*sgd_step)(float* param, const float* grad, float* momentum_buf, std::int64_t numel,
                   const SgdHyper& h);
  void (*adam_step)(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
                    const AdamHyper& h);
  double (*sum_of_squares)(const float* x, std::int64_t numel);
  void (*to_bf16)(const float* x, std::uint16_t* out, std::int64_t numel);
  // The CPU rings' sums (src/tcp/ring.cpp): out[i] = a[i] + b[i], divided by `divisor`
  // when it is not 1; fp32, and bf16 bits as c10::BFloat16 computes them (widened, added,
  // rounded; divided by the divisor rounded to bf16, rounded again). `out` may be `a` or `b`.
  void (*add_f32)(float* out, const float* a, const float* b, std::int64_t numel, int divisor);
  void (*add_bf16)(std::uint16_t* out, const std::uint16_t* a, const std::uint16_t* b, std::int64_t numel,
                   int divisor);
};

// Every build this CPU can run, narrowest first.
std::vector<const ChunkKernels*> runnable();
// The runnable build named `isa`; null or empty: the widest. InvalidArgument for a name
// that is not one.
const ChunkKernels& pick(const char* isa);
// The build the step kernels use: pick(the environment variable FLATSHARD_CPU_KERNELS).
const ChunkKernels& chosen();

// Each build's table (step_kernels_isa.cpp; avx2 and avx512 on x86-64 only).
const ChunkKernels& portable();
const ChunkKernels& avx2();
const ChunkKernels& avx512();

}  // namespace flatshard::optim::kernels::cpu
