// The CPU step kernels: a shard is cut into fixed chunks that LibTorch's intra-op pool
// runs in parallel (a CPU-offloaded step of a billion parameters is memory-bound work for
// every core), each chunk by the widest build of the chunk kernels this CPU runs
// (step_kernels_cpu.h). The CUDA build compiles the same functors with Thrust's CUDA back
// end (step_kernels_impl.h, cuda/step_kernels.cu).
#include "optim/step_kernels_cpu.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "flatshard/errors.h"

namespace flatshard::optim::kernels {
namespace cpu {

std::vector<const ChunkKernels*> runnable() {
  std::vector<const ChunkKernels*> out{&portable()};
#if defined(FLATSHARD_X86_KERNELS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) out.push_back(&avx2());
  if (__builtin_cpu_supports("avx512f")) out.push_back(&avx512());
#endif
  return out;
}

const ChunkKernels& pick(const char* isa) {
  const auto builds = runnable();
  if (isa == nullptr || *isa == '\0') return *builds.back();
  std::string names;
  for (const ChunkKernels* k : builds) {
    if (k->isa == std::string(isa)) return *k;
    names += names.empty() ? k->isa : std::string(", ") + k->isa;
  }
  throw InvalidArgument(fmt::format(
      "flatshard: FLATSHARD_CPU_KERNELS={} is not a build of the CPU step kernels this CPU runs ({}); "
      "name one of those, or unset it for the widest",
      isa, names));
}

const ChunkKernels& chosen() {
  static const ChunkKernels& kernels = pick(std::getenv("FLATSHARD_CPU_KERNELS"));
  return kernels;
}

}  // namespace cpu

namespace {

// Chunk boundaries depend on the element count alone, never on the number of threads,
// so results (the sum of squares too) are the same at any thread count.
constexpr std::int64_t kChunk = std::int64_t{1} << 14;

template <typename F>
void for_chunks(std::int64_t numel, const F& f) {
  const std::int64_t chunks = (numel + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, 1, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t c = first; c < last; ++c) f(c, c * kChunk, std::min(kChunk, numel - c * kChunk));
  });
}

}  // namespace

// A bf16 copy of a stepped chunk is written while the chunk is still in cache: 2 bytes of
// memory traffic per element on top of AdamW's 28, instead of a pass of its own.
void sgd_step(float* param, const float* grad, float* momentum_buf, std::int64_t numel, const SgdHyper& h,
              std::uint16_t* bf16_copy) {
  const auto& k = cpu::chosen();
  for_chunks(numel, [&](std::int64_t, std::int64_t b, std::int64_t n) {
    k.sgd_step(param + b, grad + b, momentum_buf ? momentum_buf + b : nullptr, n, h);
    if (bf16_copy) k.to_bf16(param + b, bf16_copy + b, n);
  });
}

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
               const AdamHyper& h, std::uint16_t* bf16_copy) {
  const auto& k = cpu::chosen();
  for_chunks(numel, [&](std::int64_t, std::int64_t b, std::int64_t n) {
    k.adam_step(param + b, grad + b, exp_avg + b, exp_avg_sq + b, n, h);
    if (bf16_copy) k.to_bf16(param + b, bf16_copy + b, n);
  });
}

void to_bf16(const float* x, std::uint16_t* out, std::int64_t numel) {
  const auto& k = cpu::chosen();
  for_chunks(numel, [&](std::int64_t, std::int64_t b, std::int64_t n) { k.to_bf16(x + b, out + b, n); });
}

double sum_of_squares(const float* x, std::int64_t numel) {
  const auto& k = cpu::chosen();
  if (numel <= kChunk) return k.sum_of_squares(x, numel);
  std::vector<double> partial(static_cast<std::size_t>((numel + kChunk - 1) / kChunk));
  for_chunks(numel, [&](std::int64_t c, std::int64_t b, std::int64_t n) {
    partial[static_cast<std::size_t>(c)] = k.sum_of_squares(x + b, n);
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
