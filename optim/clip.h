// Global gradient-norm clipping, torch's rule: scale by max_norm / (norm + 1e-6) when
// that is below 1.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

namespace flatshard {
class Communicator;
}

namespace flatshard::optim {

// `grads` (any floating dtype; undefined ones are skipped) are scaled in place. The p-th
// powers (squares for norm_type 2) are summed in fp64, or the largest magnitude taken
// for norm_type infinity; with `comm`, that is combined across ranks first, for gradients
// that partition the parameters across ranks (shards, owned slices). Returns the norm
// before clipping. A collective when `comm` is given. norm_type must be > 0 (callers check).
double clip_by_global_norm(const std::vector<at::Tensor>& grads, double max_norm, Communicator* comm,
                           double norm_type = 2.0);

// The ranks whose `grads` hold a NaN or Inf (empty when none): every rank learns every
// rank's answer. A collective.
std::vector<int> nonfinite_ranks(const std::vector<at::Tensor>& grads, Communicator& comm);

// Applies the policy to the result of nonfinite_ranks: returns true when the caller
// should drop this step's gradients; throws NonFiniteGradError for Raise.
bool handle_nonfinite(const std::vector<int>& ranks, int policy, std::int64_t backward, int rank,
                      int world_size, const char* who);

}  // namespace flatshard::optim
