#include <ATen/ATen.h>
#include <fmt/format.h>

#include "flatshard/errors.h"
#include "flatshard/optim.h"
#include "optim/step_kernels.h"

namespace flatshard::optim {
namespace {

void check_shards(const std::vector<at::Tensor>& shards) {
  for (const auto& s : shards) {
    if (!s.defined() || s.scalar_type() != at::kFloat || !s.is_contiguous() ||
        !(s.device().is_cpu() || s.device().is_cuda())) {
      throw InvalidArgument(
          "flatshard::optim: shards must be contiguous fp32 CPU or CUDA tensors (FullyShard::shards())");
    }
    if (s.is_cuda()) kernels::cuda_kernels("optim");  // throws when flatshard::cuda is not linked
  }
}

}  // namespace

ShardOptimizer::ShardOptimizer(std::vector<at::Tensor> shards) : shards_(std::move(shards)) {
  check_shards(shards_);
}

void ShardOptimizer::step() {
  for (std::size_t i = 0; i < shards_.size(); ++i) step_shard(i);
}

void ShardOptimizer::zero_grad() {
  for (auto& s : shards_) s.mutable_grad().reset();
}

SGD::SGD(std::vector<at::Tensor> shards, const SGDOptions& options)
    : ShardOptimizer(std::move(shards)),
      options_(options),
      steps_(shards_.size(), 0),
      momentum_(shards_.size()) {
  if (options_.nesterov && (options_.momentum <= 0 || options_.dampening != 0)) {
    throw InvalidArgument("flatshard::optim::SGD: nesterov needs momentum > 0 and dampening == 0");
  }
}

void SGD::step_shard(std::size_t i) {
  const at::Tensor& grad = shards_[i].grad();
  if (!grad.defined()) return;
  kernels::SgdHyper h;
  h.lr = static_cast<float>(options_.lr);
  h.momentum = static_cast<float>(options_.momentum);
  h.dampening = static_cast<float>(options_.dampening);
  h.weight_decay = static_cast<float>(options_.weight_decay);
  h.nesterov = options_.nesterov;
  h.first_step = !momentum_[i].defined();
  ++steps_[i];
  if (options_.momentum != 0 && h.first_step) momentum_[i] = at::empty_like(shards_[i]);
  const auto g = grad.contiguous();
  float* momentum = momentum_[i].defined() ? momentum_[i].data_ptr<float>() : nullptr;
  if (shards_[i].is_cuda()) {
    kernels::cuda_kernels("optim::SGD")
        .sgd_step(shards_[i].data_ptr<float>(), g.data_ptr<float>(), momentum, shards_[i].numel(), h,
                  nullptr);
  } else {
    kernels::sgd_step(shards_[i].data_ptr<float>(), g.data_ptr<float>(), momentum, shards_[i].numel(), h);
  }
}

std::vector<std::pair<std::string, at::Tensor>> SGD::named_state(std::size_t i) const {
  if (options_.momentum == 0) return {};
  return {{"momentum_buffer", momentum_[i]}};
}

std::vector<std::string> SGD::state_names() const {
  if (options_.momentum == 0) return {};
  return {"momentum_buffer"};
}

at::Tensor SGD::mutable_state(std::size_t i, const std::string& name) {
  if (name != "momentum_buffer" || options_.momentum == 0) {
    throw InvalidArgument(fmt::format("flatshard::optim::SGD{}: has no state '{}'",
                                      options_.momentum == 0 ? " (without momentum)" : "", name));
  }
  if (!momentum_[i].defined()) momentum_[i] = at::zeros_like(shards_[i]);
  return momentum_[i];
}

std::int64_t SGD::state_bytes() const {
  std::int64_t b = 0;
  for (const auto& m : momentum_) b += m.defined() ? static_cast<std::int64_t>(m.nbytes()) : 0;
  return b;
}

Adam::Adam(std::vector<at::Tensor> shards, const AdamOptions& options)
    : ShardOptimizer(std::move(shards)),
      options_(options),
      decoupled_(false),
      exp_avg_(shards_.size()),
      exp_avg_sq_(shards_.size()),
      steps_(shards_.size(), 0) {}

Adam::Adam(std::vector<at::Tensor> shards, const AdamWOptions& options)
    : Adam(std::move(shards),
           AdamOptions{options.lr, options.beta1, options.beta2, options.eps, options.weight_decay}) {
  decoupled_ = true;
}

void Adam::step_shard(std::size_t i) {
  const at::Tensor& grad = shards_[i].grad();
  if (!grad.defined()) return;
  if (!exp_avg_[i].defined()) {
    exp_avg_[i] = at::zeros_like(shards_[i]);
    exp_avg_sq_[i] = at::zeros_like(shards_[i]);
  }
  kernels::AdamHyper h;
  h.lr = static_cast<float>(options_.lr);
  h.beta1 = static_cast<float>(options_.beta1);
  h.beta2 = static_cast<float>(options_.beta2);
  h.eps = static_cast<float>(options_.eps);
  h.weight_decay = static_cast<float>(options_.weight_decay);
  h.decoupled_weight_decay = decoupled_;
  h.step = ++steps_[i];
  const auto g = grad.contiguous();
  if (shards_[i].is_cuda()) {
    kernels::cuda_kernels("optim::Adam")
        .adam_step(shards_[i].data_ptr<float>(), g.data_ptr<float>(), exp_avg_[i].data_ptr<float>(),
                   exp_avg_sq_[i].data_ptr<float>(), shards_[i].numel(), h, nullptr);
  } else {
    kernels::adam_step(shards_[i].data_ptr<float>(), g.data_ptr<float>(), exp_avg_[i].data_ptr<float>(),
                       exp_avg_sq_[i].data_ptr<float>(), shards_[i].numel(), h);
  }
}

std::vector<std::pair<std::string, at::Tensor>> Adam::named_state(std::size_t i) const {
  return {{"exp_avg", exp_avg_[i]}, {"exp_avg_sq", exp_avg_sq_[i]}};
}

at::Tensor Adam::mutable_state(std::size_t i, const std::string& name) {
  if (name != "exp_avg" && name != "exp_avg_sq") {
    throw InvalidArgument(fmt::format("flatshard::optim::Adam: has no state '{}'", name));
  }
  if (!exp_avg_[i].defined()) {
    exp_avg_[i] = at::zeros_like(shards_[i]);
    exp_avg_sq_[i] = at::zeros_like(shards_[i]);
  }
  return name == "exp_avg" ? exp_avg_[i] : exp_avg_sq_[i];
}

std::int64_t Adam::state_bytes() const {
  std::int64_t b = 0;
  for (std::size_t i = 0; i < shards_.size(); ++i) {
    if (exp_avg_[i].defined()) b += static_cast<std::int64_t>(exp_avg_[i].nbytes() + exp_avg_sq_[i].nbytes());
  }
  return b;
}

}  // namespace flatshard::optim
