// What the compressing hooks of src/comm/hooks.cpp compute, in two forms: loops over host
// memory (one pass where tensor operations take several), and tensor operations that run
// wherever the tensors are (on a GPU, on its current stream). A hook takes the loops for
// host tensors and the operations for device tensors (form_for); the unit tests run both
// forms on the host and compare them.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace flatshard::hooks::kernels {

enum class Form { Loops, TensorOps };
inline Form form_for(const at::Tensor& t) { return t.is_cpu() ? Form::Loops : Form::TensorOps; }

// Note [8-bit chunks]: `x` (fp32, contiguous) as int8 codes, `chunk` to a scale.
// `codes`: ceil(numel / chunk) * chunk int8 (the last chunk's tail 0); `scales`: one fp32 a
// chunk. Written in place (both may be views of the all-gather's output).
void quantize(const at::Tensor& x, std::int64_t chunk, const at::Tensor& codes, const at::Tensor& scales,
              Form form);

// The average over `world` ranks of their dequantized chunks, rank 0's first on every rank:
// `all_codes` and `all_scales` hold every rank's `quantize` output, one after another.
// Writes `out` (fp32, its numel the bucket's).
void average_dequantized(const at::Tensor& all_codes, const at::Tensor& all_scales, int world,
                         std::int64_t chunk, const at::Tensor& out, Form form);

// The positions (int64, in no order) of the k values of `x` (fp32, contiguous) largest in
// magnitude; the two forms agree up to ties at the k-th magnitude.
at::Tensor largest_magnitudes(const at::Tensor& x, std::int64_t k, Form form);

// The average over `world` ranks of their k values each, placed at their positions (every
// rank's k positions distinct): `all_values` (fp32) and `all_index` (int32), rank after
// rank. Added rank 0's first on every rank, so every rank gets the same bits. Writes `out`
// (fp32, its numel the bucket's).
void average_scattered(const at::Tensor& all_values, const at::Tensor& all_index, int world,
                       const at::Tensor& out, Form form);

}  // namespace flatshard::hooks::kernels
