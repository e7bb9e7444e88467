// One build of the CPU step kernels over a chunk: compiled once per instruction set
// (CMakeLists.txt: FLATSHARD_KERNEL_ISA names it, with that set's -m flags), each in its
// own inline namespace (step_functors.h). Plain loops over the functors, which GCC
// vectorizes at -O3; no Thrust here, whose non-template code the builds would share.
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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
inline std::uint16_t bf16_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const std::uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? std::uint16_t{0x7FC0} : static_cast<std::uint16_t>(rounded);
}

#if defined(__AVX512F__)
// Note [Streamed bf16 copies]
// The bf16 copies are written for the GPU's copy engine, not for this core: streaming
// (non-temporal) stores skip reading each destination line into the cache before it is
// overwritten, 2 of the 4 bytes per element that an ordinary store moves. The same
// arithmetic as bf16_bits, 16 elements at a time (AVX-512F: the mask compare, the masked
// move and the narrowing vpmovdw). The fence orders the streamed stores before whatever
// synchronisation follows, so that another thread or a device copy sees them.
void to_bf16(const float* x, std::uint16_t* out, std::int64_t numel) {
  std::int64_t i = 0;
  // Streaming stores of 32 bytes need 32-byte aligned addresses.
  while (i < numel && (reinterpret_cast<std::uintptr_t>(out + i) & 31u) != 0) {
    out[i] = bf16_bits(x[i]);
    ++i;
  }
  // The zero-masked forms with every lane selected: GCC 12 warns about the unmasked
  // forms' undefined pass-through operand.
  constexpr __mmask16 all = 0xFFFF;
  const __m512i round = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1),
                quiet_nan = _mm512_set1_epi32(0x7FC0);
  for (; i + 16 <= numel; i += 16) {
    const __m512 f = _mm512_loadu_ps(x + i);
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lowest_kept = _mm512_and_si512(_mm512_maskz_srli_epi32(all, u, 16), one);
    __m512i bits =
        _mm512_maskz_srli_epi32(all, _mm512_add_epi32(_mm512_add_epi32(u, round), lowest_kept), 16);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), quiet_nan);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), _mm512_maskz_cvtepi32_epi16(all, bits));
  }
  _mm_sfence();
  for (; i < numel; ++i) out[i] = bf16_bits(x[i]);
}
#else
void to_bf16(const float* x, std::uint16_t* out, std::int64_t numel) {
  for (std::int64_t i = 0; i < numel; ++i) out[i] = bf16_bits(x[i]);
}
#endif

inline float bf16_float(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

void add_f32(float* out, const float* a, const float* b, std::int64_t numel, int divisor) {
  if (divisor == 1) {
    for (std::int64_t i = 0; i < numel; ++i) out[i] = a[i] + b[i];
    return;
  }
  const auto n = static_cast<float>(divisor);
  for (std::int64_t i = 0; i < numel; ++i) out[i] = (a[i] + b[i]) / n;
}

void add_bf16(std::uint16_t* out, const std::uint16_t* a, const std::uint16_t* b, std::int64_t numel,
              int divisor) {
  if (divisor == 1) {
    for (std::int64_t i = 0; i < numel; ++i) out[i] = bf16_bits(bf16_float(a[i]) + bf16_float(b[i]));
    return;
  }
  const float n = bf16_float(bf16_bits(static_cast<float>(divisor)));
  for (std::int64_t i = 0; i < numel; ++i)
    out[i] = bf16_bits(bf16_float(bf16_bits(bf16_float(a[i]) + bf16_float(b[i]))) / n);
}

}  // namespace

#define FLATSHARD_STRINGIFY_(x) #x
#define FLATSHARD_STRINGIFY(x) FLATSHARD_STRINGIFY_(x)

const ChunkKernels& FLATSHARD_KERNEL_ISA() {
  static const ChunkKernels table{FLATSHARD_STRINGIFY(FLATSHARD_KERNEL_ISA),
                                  &sgd_step,
                                  &adam_step,
                                  &sum_of_squares,
                                  &to_bf16,
                                  &add_f32,
                                  &add_bf16};
  return table;
}

}  // namespace flatshard::optim::kernels::cpu
