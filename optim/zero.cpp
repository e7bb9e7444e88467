#include "flatshard/zero.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "flatshard/errors.h"
#include "flatshard/shard.h"
#include "optim/clip.h"
#include "sharding/ddp_engine.h"

namespace flatshard {
namespace {

std::unique_ptr<optim::ShardOptimizer> make_optimizer(const OptimizerOptions& o,
                                                      std::vector<at::Tensor> shards) {
  if (const auto* sgd = std::get_if<optim::SGDOptions>(&o)) return std::make_unique<optim::SGD>(shards, *sgd);
  if (const auto* adam = std::get_if<optim::AdamOptions>(&o))
    return std::make_unique<optim::Adam>(shards, *adam);
  return std::make_unique<optim::Adam>(shards, std::get<optim::AdamWOptions>(o));
}

std::int64_t state_per_element_bytes(const OptimizerOptions& o) {
  if (const auto* sgd = std::get_if<optim::SGDOptions>(&o)) return sgd->momentum != 0 ? 4 : 0;
  return 8;
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(DDPBase& ddp, const OptimizerOptions& optimizer,
                                                 const ZeroOptions& options)
    : engine_(&ddp.engine()), optimizer_options_(optimizer), options_(options), standalone_(false) {
  engine_->set_reduce(options_.reduce_scatter ? GradReduce::ReduceScatter : GradReduce::AllReduce);
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::shared_ptr<torch::nn::Module> model, const World& world,
                                                 const OptimizerOptions& optimizer,
                                                 const ZeroOptions& options)
    : optimizer_options_(optimizer), options_(options), standalone_(true) {
  DDPOptions ddp;
  ddp.first_bucket_bytes = options.first_bucket_bytes;
  ddp.bucket_bytes = options.bucket_bytes;
  ddp.comm = options.comm;
  owned_engine_ =
      std::make_unique<sharding::DdpEngine>(std::move(model), world, ddp, /*reduce_in_backward=*/false);
  engine_ = owned_engine_.get();
  engine_->set_reduce(options_.reduce_scatter ? GradReduce::ReduceScatter : GradReduce::AllReduce);
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

// This rank's slice of every bucket, as leaf views the shard optimizer steps in place.
// Rebuilt when the bucket layout changes (after the first backward); state the
// optimizer already holds (loaded from a checkpoint, say) moves with its parameters.
void ZeroRedundancyOptimizer::ensure_slices() {
  if (optimizer_ && layout_version_ == engine_->layout_version()) return;
  std::vector<std::pair<std::string, at::Tensor>> carried;
  std::int64_t steps = 0;
  if (optimizer_ && optimizer_->state_bytes() > 0) {
    carried = state_by_parameter();
    for (std::size_t b = 0; b < slices_.size(); ++b) steps = std::max(steps, optimizer_->steps(b));
  }
  slices_.clear();
  places_.clear();
  bucket_numels_.clear();
  for (int b = 0; b < static_cast<int>(engine_->buckets().size()); ++b) {
    const auto range = engine_->slice(b);
    slices_.push_back(engine_->step_values(b).narrow(0, range.offset, range.numel).detach());
    bucket_numels_.push_back(engine_->buckets()[b].padded_numel);
  }
  for (const auto& p : engine_->params()) places_.emplace_back(p.bucket, p.offset);
  optimizer_ = make_optimizer(optimizer_options_, slices_);
  layout_version_ = engine_->layout_version();
  if (!carried.empty()) load_state_by_parameter(carried, steps);
}

namespace {

// Calls f(parameter index, first element in the parameter, first element in the
// slice, count) for every parameter overlapping bucket b's slice [begin, end).
template <typename F>
void for_each_overlap(const std::vector<std::pair<int, std::int64_t>>& places,
                      const std::vector<sharding::DdpParam>& params, int b, std::int64_t begin,
                      std::int64_t end, F&& f) {
  for (std::size_t i = 0; i < places.size(); ++i) {
    if (places[i].first != b) continue;
    const std::int64_t lo = std::max(begin, places[i].second);
    const std::int64_t hi = std::min(end, places[i].second + params[i].numel);
    if (lo < hi) f(i, lo - places[i].second, lo - begin, hi - lo);
  }
}

std::vector<std::int64_t> parameter_bases(const std::vector<sharding::DdpParam>& params) {
  std::vector<std::int64_t> base(params.size() + 1, 0);
  for (std::size_t i = 0; i < params.size(); ++i) base[i + 1] = base[i] + params[i].numel;
  return base;
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> ZeroRedundancyOptimizer::state_by_parameter() {
  const auto& params = engine_->params();
  const auto base = parameter_bases(params);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& name : optimizer_->state_names()) {
    auto full = at::zeros({base.back()}, at::TensorOptions().dtype(at::kFloat).device(engine_->device()));
    for (int b = 0; b < static_cast<int>(slices_.size()); ++b) {
      const auto range = shard_range(bucket_numels_[b], engine_->world_size(), engine_->rank());
      at::Tensor state;
      for (const auto& [n, t] : optimizer_->named_state(b))
        if (n == name) state = t;
      if (!state.defined()) continue;
      for_each_overlap(places_, params, b, range.offset, range.offset + range.numel,
                       [&](std::size_t i, std::int64_t in_param, std::int64_t in_slice, std::int64_t n) {
                         full.narrow(0, base[i] + in_param, n).copy_(state.narrow(0, in_slice, n));
                       });
    }
    engine_->comm().all_reduce(full, ReduceOp::Sum).wait();  // each element has one owner
    out.emplace_back(name, std::move(full));
  }
  return out;
}

void ZeroRedundancyOptimizer::load_state_by_parameter(
    const std::vector<std::pair<std::string, at::Tensor>>& state, std::int64_t steps) {
  const auto& params = engine_->params();
  const auto base = parameter_bases(params);
  for (int b = 0; b < static_cast<int>(slices_.size()); ++b) {
    const auto range = shard_range(bucket_numels_[b], engine_->world_size(), engine_->rank());
    for (const auto& [name, full] : state) {
      auto mine = optimizer_->mutable_state(b, name);
      for_each_overlap(places_, params, b, range.offset, range.offset + range.numel,
                       [&](std::size_t i, std::int64_t in_param, std::int64_t in_slice, std::int64_t n) {
                         mine.narrow(0, in_slice, n).copy_(full.narrow(0, base[i] + in_param, n));
                       });
    }
    optimizer_->set_steps(b, steps);
  }
}

// Without DDP the gradients are reduced here, once per step (clip_grad_norm may have
// done it already).
void ZeroRedundancyOptimizer::reduce_if_standalone() {
  if (!standalone_ || reduced_) return;
  engine_->adopt_grads();
  engine_->reduce_all_now();
  reduced_ = true;
}

void ZeroRedundancyOptimizer::step() {
  reduce_if_standalone();
  reduced_ = false;
  if (engine_->take_dropped()) return;  // NaN/Inf gradients, NonFiniteGrads::Skip
  ensure_slices();
  for (int b = 0; b < static_cast<int>(slices_.size()); ++b) {
    const auto range = engine_->slice(b);
    slices_[b].mutable_grad() = engine_->step_grads(b).narrow(0, range.offset, range.numel);
  }
  optimizer_->step();
  CollectiveOptions opts;
  opts.stream = StreamRole::AllGather;
  std::vector<Work> gathers;
  for (int b = 0; b < static_cast<int>(slices_.size()); ++b) {
    gathers.push_back(engine_->comm().all_gather(engine_->step_values(b), slices_[b], opts));
  }
  for (auto& w : gathers) w.wait();
}

void ZeroRedundancyOptimizer::zero_grad() {
  at::NoGradGuard no_grad;
  for (auto& b : engine_->buckets()) {
    b.grad.zero_();
    if (b.master_grad.defined()) b.master_grad.zero_();
  }
  engine_->adopt_grads();
}

double ZeroRedundancyOptimizer::clip_grad_norm(double max_norm) {
  reduce_if_standalone();
  std::vector<at::Tensor> owned;
  for (int b = 0; b < static_cast<int>(engine_->buckets().size()); ++b) {
    const auto range = engine_->slice(b);
    owned.push_back(engine_->step_grads(b).narrow(0, range.offset, range.numel));
  }
  return optim::clip_by_global_norm(owned, max_norm, &engine_->comm());
}

std::int64_t ZeroRedundancyOptimizer::state_bytes() const {
  return optimizer_ ? optimizer_->state_bytes() : 0;
}

std::int64_t ZeroRedundancyOptimizer::full_state_bytes() const {
  std::int64_t numel = 0;
  for (const auto& b : engine_->buckets()) numel += b.numel;
  return numel * state_per_element_bytes(optimizer_options_);
}

std::int64_t ZeroRedundancyOptimizer::largest_bucket_bytes() const {
  std::int64_t most = 0;
  for (const auto& b : engine_->buckets())
    most = std::max(most, b.numel * state_per_element_bytes(optimizer_options_));
  return most;
}

std::map<std::string, at::Tensor> ZeroRedundancyOptimizer::consolidated_state_dict(int to) {
  ensure_slices();
  std::map<std::string, at::Tensor> out;
  for (int b = 0; b < static_cast<int>(slices_.size()); ++b) {
    const auto& bucket = engine_->buckets()[b];
    for (const auto& [name, slice] : optimizer_->named_state(b)) {
      auto mine = slice.defined() ? slice : at::zeros({slices_[b].numel()}, slices_[b].options());
      auto full = at::empty({bucket.padded_numel}, mine.options());
      engine_->comm().all_gather(full, mine).wait();
      if (engine_->rank() != to) continue;
      for (int i : bucket.params) {
        const auto& p = engine_->params()[i];
        out[p.name + "." + name] = full.narrow(0, p.offset, p.numel).view(p.shape).cpu().clone();
      }
    }
  }
  std::int64_t steps = 0;
  for (std::size_t b = 0; b < slices_.size(); ++b) steps = std::max(steps, optimizer_->steps(b));
  if (engine_->rank() == to) out["step"] = at::full({}, steps, at::kLong);
  return out;
}

}  // namespace flatshard
