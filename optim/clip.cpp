#include "optim/clip.h"

#include <ATen/ATen.h>

#include <cmath>

#include "flatshard/communicator.h"
#include "optim/step_kernels.h"

namespace flatshard::optim {

double clip_by_global_norm(const std::vector<at::Tensor>& grads, double max_norm, Communicator* comm) {
  double local = 0;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    const auto f = g.scalar_type() == at::kFloat && g.is_contiguous() ? g : g.to(at::kFloat).contiguous();
    local += kernels::sum_of_squares(f.data_ptr<float>(), f.numel());
  }
  if (comm != nullptr) {
    auto total = at::full({1}, local, at::kDouble);
    comm->all_reduce(total, ReduceOp::Sum).wait();
    local = total.item<double>();
  }
  const double norm = std::sqrt(local);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    at::NoGradGuard no_grad;
    for (auto g : grads) {
      if (g.defined()) g.mul_(coef);
    }
  }
  return norm;
}

}  // namespace flatshard::optim
