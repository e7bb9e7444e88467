#pragma once

#include <algorithm>
#include <map>

namespace flatshard::testing {

inline const char* to_string(OptKind k) {
  switch (k) {
    case OptKind::SGD: return "SGD";
    case OptKind::Adam: return "Adam";
    case OptKind::AdamW: return "AdamW";
  }
  return "?";
}

// The same hyper-parameters for both sides: momentum, Nesterov and weight decay for
// SGD; weight decay for Adam (L2) and AdamW (decoupled).
inline std::unique_ptr<torch::optim::Optimizer> reference_optimizer(OptKind k, std::vector<at::Tensor> params) {
  switch (k) {
    case OptKind::SGD:
      return std::make_unique<torch::optim::SGD>(
          params, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01));
    case OptKind::Adam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3).weight_decay(0.01));
    case OptKind::AdamW:
      return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  }
  return nullptr;
}

inline const char* to_string(ReplicatedMode m) {
  switch (m) {
    case ReplicatedMode::DDP: return "DDP";
    case ReplicatedMode::ZeroWithDDP: return "ZeRO-1+DDP";
    case ReplicatedMode::ZeroWithDDPScatter: return "ZeRO-1+DDP reduce-scatter";
    case ReplicatedMode::ZeroStandalone: return "ZeRO-1 alone";
  }
  return "?";
}

inline OptimizerOptions zero_optimizer_options(OptKind k) {
  switch (k) {
    case OptKind::SGD: return optim::SGDOptions{0.05, 0.9, 0, 0.01, true};
    case OptKind::Adam: return optim::AdamOptions{1e-3, 0.9, 0.999, 1e-8, 0.01};
    case OptKind::AdamW: return optim::AdamWOptions{1e-3, 0.9, 0.999, 1e-8, 0.1};
  }
  return optim::SGDOptions{};
}

struct ShardedOptimizer {
  std::unique_ptr<optim::ShardOptimizer> opt;
  void step() { opt->step(); }
  void zero_grad() { opt->zero_grad(); }
};

inline ShardedOptimizer sharded_optimizer(OptKind k, std::vector<at::Tensor> shards) {
  switch (k) {
    case OptKind::SGD:
      return {std::make_unique<optim::SGD>(shards, optim::SGDOptions{0.05, 0.9, 0, 0.01, true})};
    case OptKind::Adam:
      return {std::make_unique<optim::Adam>(shards, optim::AdamOptions{1e-3, 0.9, 0.999, 1e-8, 0.01})};
    case OptKind::AdamW:
      return {std::make_unique<optim::Adam>(shards, optim::AdamWOptions{1e-3, 0.9, 0.999, 1e-8, 0.1})};
  }
  return {};
}

template <typename Holder>
TrainResult train_and_compare(const World& world, const std::function<Holder()>& make,
                              const std::function<Batch(int)>& batch,
                              const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss,
                              const TrainSpec& spec) {
  const int n = world.world_size();
  const int rank = world.rank();
  TrainResult result;

  Holder reference = make();
  auto ref_opt = reference_optimizer(spec.optimizer, reference->parameters());

  Holder model = make();
  FullyShardOptions options;
  options.strategy = spec.strategy;
  options.prefetch = spec.prefetch;
  options.mixed_precision.param = spec.param_dtype;
  options.mixed_precision.reduce = spec.reduce_dtype;
  options.comm.timeout = std::chrono::seconds(60);
  options.comm.name = "test";
  FullyShard<Holder> fsdp(model, world, options);
  auto opt = sharded_optimizer(spec.optimizer, fsdp.shards());
  auto loss_sum = at::zeros({1}, at::kDouble);

  for (int step = 0; step < spec.steps; ++step) {
    if (spec.before_step) spec.before_step(step, *reference, *model);
    const Batch b = batch(step);
    const std::int64_t rows = b.input.size(0);
    // Reference: the whole batch, micro-batch by micro-batch, mean loss overall.
    ref_opt->zero_grad();
    const std::int64_t micro_rows = rows / spec.micro_batches;
    double ref_loss = 0;
    for (int m = 0; m < spec.micro_batches; ++m) {
      auto l = loss(reference->forward(b.input.narrow(0, m * micro_rows, micro_rows)),
                    b.target.narrow(0, m * micro_rows, micro_rows)) /
               spec.micro_batches;
      l.backward();
      ref_loss += l.template item<double>();
    }
    if (spec.clip > 0) torch::nn::utils::clip_grad_norm_(reference->parameters(), spec.clip);
    ref_opt->step();

    // Sharded: this rank's rows of each micro-batch.
    const std::int64_t local = micro_rows / n;
    double my_loss = 0;
    for (int m = 0; m < spec.micro_batches; ++m) {
      auto x = b.input.narrow(0, m * micro_rows + rank * local, local);
      auto y = b.target.narrow(0, m * micro_rows + rank * local, local);
      auto run = [&] {
        auto out = fsdp.forward(x);
        auto l = loss(out.to(at::kFloat), y) / spec.micro_batches;
        l.backward();
        my_loss += l.template item<double>();
      };
      if (m + 1 < spec.micro_batches) {
        auto guard = fsdp.no_sync();
        run();
      } else {
        run();
      }
    }
    if (spec.clip > 0) result.max_grad_norm = std::max(result.max_grad_norm, fsdp.clip_grad_norm(spec.clip));
    opt.step();
    opt.zero_grad();

    loss_sum.fill_(my_loss);
    fsdp.comm().all_reduce(loss_sum, ReduceOp::Avg).wait();
    const double rel = std::abs(loss_sum.template item<double>() - ref_loss) / std::max(std::abs(ref_loss), 1e-12);
    result.max_rel_loss_diff = std::max(result.max_rel_loss_diff, rel);
  }

  result.peak_gathered_units = fsdp.peak_gathered_units();
  result.peak_unsharded_param_bytes = fsdp.memory().peak_unsharded_param_bytes;
  result.largest_unit_bytes = fsdp.largest_unit_bytes();
  result.root_unit_bytes = fsdp.root_unit_bytes();
  {
    auto full = fsdp.summon_full_params();
    auto ref_params = reference->named_parameters();
    double delta_sq = 0, ref_sq = 0;
    for (const auto& item : model->named_parameters()) {
      const auto& want = ref_params[item.key()];
      const auto delta = item.value().to(at::kFloat) - want;
      const double delta_norm = delta.norm().template item<double>();
      const double want_norm = want.norm().template item<double>();
      delta_sq += delta_norm * delta_norm;
      ref_sq += want_norm * want_norm;
      const double rel = delta_norm / std::max(want_norm, 1e-12);
      if (rel >= result.max_rel_weight_diff) {
        result.max_rel_weight_diff = rel;
        result.worst_param = item.key();
      }
      const double scale = std::max(want.abs().max().template item<double>(), 1e-12);
      result.max_elementwise_diff =
          std::max(result.max_elementwise_diff, delta.abs().max().template item<double>() / scale);
    }
    result.global_rel_weight_diff = std::sqrt(delta_sq / std::max(ref_sq, 1e-24));
  }
  return result;
}

// Compares the trained weights of `model` with `reference`.
template <typename Holder>
void compare_weights(Holder& model, Holder& reference, TrainResult& result) {
  auto ref_params = reference->named_parameters();
  double delta_sq = 0, ref_sq = 0;
  for (const auto& item : model->named_parameters()) {
    const auto& want = ref_params[item.key()];
    const auto delta = item.value().to(at::kFloat) - want;
    const double delta_norm = delta.norm().template item<double>();
    const double want_norm = want.norm().template item<double>();
    delta_sq += delta_norm * delta_norm;
    ref_sq += want_norm * want_norm;
    const double rel = delta_norm / std::max(want_norm, 1e-12);
    if (rel >= result.max_rel_weight_diff) {
      result.max_rel_weight_diff = rel;
      result.worst_param = item.key();
    }
    const double scale = std::max(want.abs().max().template item<double>(), 1e-12);
    result.max_elementwise_diff =
        std::max(result.max_elementwise_diff, delta.abs().max().template item<double>() / scale);
  }
  result.global_rel_weight_diff = std::sqrt(delta_sq / std::max(ref_sq, 1e-24));
}

template <typename Holder>
TrainResult train_replicated_and_compare(const World& world, const std::function<Holder()>& make,
                                         const std::function<Batch(int)>& batch,
                                         const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss,
                                         const TrainSpec& spec, const ReplicatedSpec& replicated) {
  const int n = world.world_size();
  const int rank = world.rank();
  TrainResult result;
  Holder reference = make();
  auto ref_opt = reference_optimizer(spec.optimizer, reference->parameters());

  Holder model = make();
  DDPOptions options;
  options.find_unused_parameters = replicated.find_unused_parameters;
  options.first_bucket_bytes = replicated.first_bucket_bytes;
  options.bucket_bytes = replicated.bucket_bytes;
  options.mixed_precision.param = spec.param_dtype;
  options.mixed_precision.reduce = spec.reduce_dtype;
  options.comm.timeout = std::chrono::seconds(60);
  std::unique_ptr<DistributedDataParallel<Holder>> ddp;
  std::unique_ptr<torch::optim::Optimizer> torch_opt;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  ZeroOptions zero_options;
  zero_options.first_bucket_bytes = replicated.first_bucket_bytes;
  zero_options.bucket_bytes = replicated.bucket_bytes;
  zero_options.comm.timeout = std::chrono::seconds(60);
  zero_options.reduce_scatter = replicated.mode == ReplicatedMode::ZeroWithDDPScatter;
  if (replicated.mode == ReplicatedMode::ZeroStandalone) {
    zero = std::make_unique<ZeroRedundancyOptimizer>(model.ptr(), world, zero_optimizer_options(spec.optimizer),
                                                     zero_options);
  } else {
    ddp = std::make_unique<DistributedDataParallel<Holder>>(model, world, options);
    if (replicated.mode == ReplicatedMode::DDP) {
      torch_opt = reference_optimizer(spec.optimizer, ddp->optimizer_params());
    } else {
      zero = std::make_unique<ZeroRedundancyOptimizer>(*ddp, zero_optimizer_options(spec.optimizer), zero_options);
    }
  }
  auto forward = [&](const at::Tensor& x) { return ddp ? ddp->forward(x) : model->forward(x); };
  std::unique_ptr<Communicator> own_comm;
  if (!ddp) own_comm = Communicator::create(world, {});
  Communicator& comm = ddp ? ddp->comm() : *own_comm;
  auto loss_sum = at::zeros({1}, at::kDouble);

  for (int step = 0; step < spec.steps; ++step) {
    if (spec.before_step) spec.before_step(step, *reference, *model);
    const Batch b = batch(step);
    const std::int64_t rows = b.input.size(0);
    ref_opt->zero_grad();
    const std::int64_t micro_rows = rows / spec.micro_batches;
    double ref_loss = 0;
    for (int m = 0; m < spec.micro_batches; ++m) {
      auto l = loss(reference->forward(b.input.narrow(0, m * micro_rows, micro_rows)),
                    b.target.narrow(0, m * micro_rows, micro_rows)) /
               spec.micro_batches;
      l.backward();
      ref_loss += l.template item<double>();
    }
    if (replicated.find_unused_parameters && zero) {
      // ZeRO steps whole bucket slices: a parameter no rank used gets a zero gradient.
      for (auto& p : reference->parameters()) {
        if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      }
    }
    if (spec.clip > 0) torch::nn::utils::clip_grad_norm_(reference->parameters(), spec.clip);
    ref_opt->step();

    const std::int64_t local = micro_rows / n;
    double my_loss = 0;
    for (int m = 0; m < spec.micro_batches; ++m) {
      auto x = b.input.narrow(0, m * micro_rows + rank * local, local);
      auto y = b.target.narrow(0, m * micro_rows + rank * local, local);
      auto run = [&] {
        auto l = loss(forward(x).to(at::kFloat), y) / spec.micro_batches;
        l.backward();
        my_loss += l.template item<double>();
      };
      if (m + 1 < spec.micro_batches && ddp) {
        auto guard = ddp->no_sync();
        run();
      } else {
        run();
      }
    }
    if (zero) {
      if (spec.clip > 0) {
        if (replicated.mode == ReplicatedMode::ZeroStandalone) {
          throw std::runtime_error("clipping before ZeRO-alone's in-step reduction is not tested");
        }
        result.max_grad_norm = std::max(result.max_grad_norm, zero->clip_grad_norm(spec.clip));
      }
      zero->step();
      zero->zero_grad();
    } else {
      if (spec.clip > 0) result.max_grad_norm = std::max(result.max_grad_norm, ddp->clip_grad_norm(spec.clip));
      torch_opt->step();
      torch_opt->zero_grad();
    }
    loss_sum.fill_(my_loss);
    comm.all_reduce(loss_sum, ReduceOp::Avg).wait();
    const double rel = std::abs(loss_sum.template item<double>() - ref_loss) / std::max(std::abs(ref_loss), 1e-12);
    result.max_rel_loss_diff = std::max(result.max_rel_loss_diff, rel);
  }
  compare_weights(model, reference, result);
  return result;
}

}  // namespace flatshard::testing
