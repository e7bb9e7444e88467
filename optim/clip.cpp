#include "optim/clip.h"

#include <fmt/ranges.h>

#include "flatshard/errors.h"
#include "flatshard/fully_shard.h"
#include "src/logging.h"

#include <ATen/ATen.h>

#include <cmath>

#include "flatshard/communicator.h"
#include "optim/step_kernels.h"

namespace flatshard::optim {

double clip_by_global_norm(const std::vector<at::Tensor>& grads, double max_norm, Communicator* comm,
                           double norm_type) {
  const bool largest = std::isinf(norm_type);
  double local = 0;  // the sum of |g|^p, or the largest |g|
  for (const auto& g : grads) {
    if (!g.defined() || g.numel() == 0) continue;
    if (largest) {
      const double most = g.abs().max().item<double>();
      if (std::isnan(most) || most > local) local = most;  // a NaN stays
    } else if (norm_type == 2.0) {
      const auto f = g.scalar_type() == at::kFloat && g.is_contiguous() ? g : g.to(at::kFloat).contiguous();
      local += f.is_cuda() ? kernels::cuda_kernels("clip_grad_norm")
                                 .sum_of_squares(f.data_ptr<float>(), f.numel(), nullptr)
                           : kernels::sum_of_squares(f.data_ptr<float>(), f.numel());
    } else {  // torch's order: each tensor's norm, then the norm of those
      local += std::pow(at::linalg_vector_norm(g, norm_type, std::nullopt, false, at::kDouble).item<double>(),
                        norm_type);
    }
  }
  if (comm != nullptr && largest) {
    const auto options = at::TensorOptions().dtype(at::kDouble).device(comm->device());
    auto all = at::empty({comm->world_size()}, options);
    comm->all_gather(all, at::full({1}, local, options)).wait();
    local = all.max().item<double>();  // NaN if any rank's is
  } else if (comm != nullptr) {
    auto total = at::full({1}, local, at::TensorOptions().dtype(at::kDouble).device(comm->device()));
    comm->all_reduce(total, ReduceOp::Sum).wait();
    local = total.item<double>();
  }
  const double norm = largest            ? local
                      : norm_type == 2.0 ? std::sqrt(local)
                                         : std::pow(local, 1.0 / norm_type);
  const double coef = max_norm / (norm + 1e-6);
  // As torch's clip_grad_norm_ (it multiplies by min(coef, 1)): a NaN norm makes every
  // gradient NaN, so that no step takes a partly clipped update for a whole one.
  if (coef < 1.0 || std::isnan(coef)) {
    at::NoGradGuard no_grad;
    for (auto g : grads) {
      if (g.defined()) g.mul_(coef);
    }
  }
  return norm;
}

std::vector<int> nonfinite_ranks(const std::vector<at::Tensor>& grads, Communicator& comm) {
  bool finite = true;
  for (const auto& g : grads) {
    if (g.defined() && g.numel() > 0 && !at::isfinite(g).all().item<bool>()) finite = false;
  }
  const auto options = at::TensorOptions().dtype(at::kInt).device(comm.device());
  auto flags = at::empty({comm.world_size()}, options);
  comm.all_gather(flags, at::full({1}, finite ? 0 : 1, options)).wait();
  std::vector<int> out;
  for (int r = 0; r < comm.world_size(); ++r) {
    if (flags[r].item<int>() != 0) out.push_back(r);
  }
  return out;
}

bool handle_nonfinite(const std::vector<int>& ranks, int policy, std::int64_t backward, int rank,
                      int world_size, const char* who) {
  if (ranks.empty()) return false;
  const auto message =
      fmt::format("flatshard::{} (rank {}/{}): gradients of backward #{} hold NaN or Inf on rank(s) {}{}",
                  who, rank, world_size, backward, fmt::join(ranks, ", "),
                  policy == static_cast<int>(NonFiniteGrads::Skip) ? ": the step is skipped" : "");
  if (policy == static_cast<int>(NonFiniteGrads::Raise)) {
    throw NonFiniteGradError(ranks, backward,
                             message +
                                 ". Lower the learning rate, clip gradients, or check the data of that step; "
                                 "NonFiniteGrads::Skip skips such steps instead");
  }
  log::at(log::Level::Warn, "{}", message);
  return true;
}

}  // namespace flatshard::optim
