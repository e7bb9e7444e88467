#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <map>
#include <stdexcept>

namespace flatshard::testing {

inline const char* to_string(OptKind k) {
  switch (k) {
    case OptKind::SGD: return "SGD";
    case OptKind::PlainSGD: return "plain SGD";
    case OptKind::Adam: return "Adam";
    case OptKind::AdamW: return "AdamW";
  }
  return "?";
}

// The same hyper-parameters for both sides: momentum, Nesterov and weight decay for
// SGD; weight decay for Adam (L2) and AdamW (decoupled). With groups (TrainSpec::
// param_groups): biases, norms and embeddings without weight decay, and the parameters
// named "head" or "fc2" (the last layers) at twice the learning rate.
inline bool is_head(const std::string& name) {
  return name.find("head") != std::string::npos || name.find("fc2") != std::string::npos;
}

inline std::unique_ptr<torch::optim::Optimizer> reference_optimizer(OptKind k, torch::nn::Module& model,
                                                                    bool groups) {
  std::vector<at::Tensor> rest, no_decay, head;
  for (const auto& item : model.named_parameters()) {
    const auto shape = item.value().sizes().vec();
    if (!groups) {
      rest.push_back(item.value());
    } else if (optim::biases_norms_embeddings()(item.key(), shape)) {
      no_decay.push_back(item.value());
    } else if (is_head(item.key())) {
      head.push_back(item.value());
    } else {
      rest.push_back(item.value());
    }
  }
  auto make = [&](auto defaults, auto set_decay, auto set_lr) {
    using Options = decltype(defaults);
    std::vector<torch::optim::OptimizerParamGroup> out;
    out.emplace_back(rest, std::make_unique<Options>(defaults));
    if (groups) {
      auto nd = defaults;
      set_decay(nd);
      out.emplace_back(no_decay, std::make_unique<Options>(nd));
      auto h = defaults;
      set_lr(h);
      out.emplace_back(head, std::make_unique<Options>(h));
    }
    return out;
  };
  switch (k) {
    case OptKind::SGD:
      return std::make_unique<torch::optim::SGD>(
          make(
              torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01),
              [](auto& o) { o.weight_decay(0); }, [](auto& o) { o.lr(0.1); }),
          torch::optim::SGDOptions(0.05));
    case OptKind::PlainSGD:
      return std::make_unique<torch::optim::SGD>(
          make(
              torch::optim::SGDOptions(0.1), [](auto&) {}, [](auto& o) { o.lr(0.2); }),
          torch::optim::SGDOptions(0.1));
    case OptKind::Adam:
      return std::make_unique<torch::optim::Adam>(
          make(
              torch::optim::AdamOptions(1e-3).weight_decay(0.01), [](auto& o) { o.weight_decay(0); },
              [](auto& o) { o.lr(2e-3); }),
          torch::optim::AdamOptions(1e-3));
    case OptKind::AdamW:
      return std::make_unique<torch::optim::AdamW>(
          make(
              torch::optim::AdamWOptions(1e-3).weight_decay(0.1), [](auto& o) { o.weight_decay(0); },
              [](auto& o) { o.lr(2e-3); }),
          torch::optim::AdamWOptions(1e-3));
  }
  return nullptr;
}

struct ShardedOptimizer {
  std::unique_ptr<optim::ShardOptimizer> opt;
  void step() { opt->step(); }
  void zero_grad() { opt->zero_grad(); }
};

inline ShardedOptimizer sharded_optimizer(OptKind k, FullyShardBase& fsdp, bool groups) {
  const optim::ParamFilter head([](const std::string& n, const std::vector<std::int64_t>& shape) {
    return is_head(n) && !optim::biases_norms_embeddings()(n, shape);
  });
  auto grouped = [&](auto defaults, double head_lr) {
    using Options = decltype(defaults);
    std::vector<optim::ParamGroup<Options>> out;
    if (!groups) return out;
    auto nd = defaults;
    nd.weight_decay = 0;
    out.push_back({"no_decay", optim::biases_norms_embeddings(), nd});
    auto h = defaults;
    h.lr = head_lr;
    out.push_back({"head", head, h});
    return out;
  };
  switch (k) {
    case OptKind::SGD: {
      const optim::SGDOptions o{0.05, 0.9, 0, 0.01, true};
      return {std::make_unique<optim::SGD>(fsdp, o, grouped(o, 0.1))};
    }
    case OptKind::PlainSGD: {
      const optim::SGDOptions o{0.1};
      return {std::make_unique<optim::SGD>(fsdp, o, grouped(o, 0.2))};
    }
    case OptKind::Adam: {
      const optim::AdamOptions o{1e-3, 0.9, 0.999, 1e-8, 0.01};
      return {std::make_unique<optim::Adam>(fsdp, o, grouped(o, 2e-3))};
    }
    case OptKind::AdamW: {
      const optim::AdamWOptions o{1e-3, 0.9, 0.999, 1e-8, 0.1};
      return {std::make_unique<optim::AdamW>(fsdp, o, grouped(o, 2e-3))};
    }
  }
  return {};
}

inline void expect_no_sync_sends_no_reduction(const TrainResult& r, const TrainSpec& spec, int world_size) {
  int under_no_sync = 0;
  for (const auto& b : r.backwards) under_no_sync += b.no_sync_count;
  EXPECT_GT(under_no_sync, 0) << "no backward ran under no_sync";
  if (world_size == 1) return;
  for (std::size_t i = 0; i < r.backwards.size(); ++i) {
    const auto& b = r.backwards[i];
    const TrainSpec& t = i == 0 || !spec.resume_as ? spec : *spec.resume_as;
    if (b.no_sync_count == 0) continue;
    SCOPED_TRACE(::testing::Message() << to_string(t.strategy) << (i == 0 ? "" : ", resumed"));
    // The sharded strategies keep the unsharded gradients that no_sync accumulates; a
    // reduce-scatter would have freed them.
    if (t.strategy != Strategy::NoShard && t.strategy != Strategy::ShardOptimizerState)
      EXPECT_GT(b.no_sync_unsharded_grad_bytes, 0) << "no_sync left no unsharded gradient to accumulate into";
    if (t.strategy == Strategy::FullShard || t.strategy == Strategy::HybridShard) {
      EXPECT_LT(b.no_sync_bytes, b.synced_bytes)
          << "a backward under no_sync sent as much as a synced one: it reduced";
    } else {
      EXPECT_EQ(b.no_sync_bytes, 0) << "a backward under no_sync sent bytes";
    }
  }
}

// The larger of two differences, NaN if either is: a NaN difference (a weight or a loss
// that became NaN) must fail the comparison, where std::max would drop it.

inline double worse(double so_far, double x) {
  return std::isnan(so_far) || std::isnan(x) ? NAN : std::max(so_far, x);
}

// Compares the trained weights of `model` with `reference`.
template <typename Holder>
void compare_weights(Holder& model, Holder& reference, TrainResult& result) {
  auto ref_params = reference->named_parameters();
  double delta_sq = 0, ref_sq = 0;
  for (const auto& item : model->named_parameters()) {
    result.weights[item.key()] = item.value().detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    const auto& want = ref_params[item.key()];
    if (want.numel() == 0) {  // a zero-size parameter: nothing to compare but its shape
      if (item.value().sizes() != want.sizes()) result.max_rel_weight_diff = std::nan("");
      continue;
    }
    const auto delta = item.value().to(at::kFloat) - want;
    const double delta_norm = delta.norm().template item<double>();
    const double want_norm = want.norm().template item<double>();
    delta_sq += delta_norm * delta_norm;
    ref_sq += want_norm * want_norm;
    const double rel = delta_norm / std::max(want_norm, 1e-12);
    if (std::isnan(rel) || rel >= result.max_rel_weight_diff) {
      if (!std::isnan(result.max_rel_weight_diff)) result.worst_param = item.key();
      result.max_rel_weight_diff = worse(result.max_rel_weight_diff, rel);
    }
    const double scale = std::max(want.abs().max().template item<double>(), 1e-12);
    result.max_elementwise_diff =
        worse(result.max_elementwise_diff, delta.abs().max().template item<double>() / scale);
  }
  result.global_rel_weight_diff = std::sqrt(delta_sq / std::max(ref_sq, 1e-24));
}

// Expects a consolidated AdamW state ("<parameter>.exp_avg", ".exp_avg_sq", "step") to
// equal torch::optim::AdamW's own state for `reference` after `steps` steps. 1e-4
// relative: exp_avg_sq squares the gradients' rounding differences (1e-7..1e-6); a slice
// in the wrong place would be off by O(1).
template <typename Holder>
void expect_adamw_state_matches(const std::map<std::string, at::Tensor>& state, Holder& reference,
                                torch::optim::AdamW& ref_opt, std::int64_t steps) {
  EXPECT_EQ(state.at("step").template item<std::int64_t>(), steps);
  for (const auto& item : reference->named_parameters()) {
    const auto& ref_state = static_cast<const torch::optim::AdamWParamState&>(
        *ref_opt.state().at(item.value().unsafeGetTensorImpl()));
    for (auto [name, want] :
         {std::pair{"exp_avg", ref_state.exp_avg()}, std::pair{"exp_avg_sq", ref_state.exp_avg_sq()}}) {
      const auto& got = state.at(item.key() + "." + name);
      ASSERT_EQ(got.sizes(), want.sizes()) << item.key();
      EXPECT_LE((got - want).norm().template item<double>(), 1e-4 * want.norm().template item<double>())
          << item.key() << name;
    }
  }
}

// What differs between the distributed modes in a training step.
struct DistributedSide {
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::function<std::shared_ptr<void>()> no_sync;      // a guard for all but the last micro-batch
  std::function<double(double, double)> clip;          // clip to the bound in a norm; returns the norm
  std::function<void()> step;                          // optimizer step and zero_grad
  Communicator* comm = nullptr;                        // to average the ranks' losses
  std::function<std::uint64_t()> bytes_sent;           // what the wrapper's communicators sent
  std::function<std::int64_t()> unsharded_grad_bytes;  // MemoryStats::unsharded_grad_bytes
};

// Steps [first_step, end_step) of single-process training on the global batch (reference)
// and of distributed training on this rank's rows (side), recording loss differences.
template <typename Holder>
void run_steps(const World& world, Holder& reference, torch::optim::Optimizer& ref_opt, Holder& model,
               DistributedSide& side, const std::function<Batch(int)>& batch,
               const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss,
               const TrainSpec& spec, TrainResult& result, int first_step, int end_step) {
  const int n = world.world_size();
  const int rank = world.rank();
  auto loss_sum = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(side.comm->device()));
  std::deque<std::vector<at::Tensor>> delayed;  // spec.staleness: gradients waiting to be applied
  result.backwards.emplace_back();              // this wrapper's (TrainResult::backwards)
  for (int step = first_step; step < end_step; ++step) {
    if (spec.before_step) spec.before_step(step, *reference, *model);
    const Batch host = batch(step);
    const Batch b{host.input.to(spec.device), host.target.to(spec.device)};
    const std::int64_t micro_rows = b.input.size(0) / spec.micro_batches;
    // Reference: the whole batch, micro-batch by micro-batch, mean loss overall.
    ref_opt.zero_grad();
    double ref_loss = 0;
    for (int m = 0; m < spec.micro_batches; ++m) {
      auto l = loss(reference->forward(b.input.narrow(0, m * micro_rows, micro_rows)),
                    b.target.narrow(0, m * micro_rows, micro_rows)) /
               spec.micro_batches;
      l.backward();
      ref_loss += l.template item<double>();
    }
    bool ref_steps = true;
    if (spec.staleness > 0) {  // this step applies the gradients of `staleness` steps ago
      std::vector<at::Tensor> grads;
      for (auto& p : reference->parameters())
        grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
      delayed.push_back(std::move(grads));
      ref_steps = static_cast<int>(delayed.size()) > spec.staleness;
      if (ref_steps) {
        auto params = reference->parameters();
        for (std::size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = delayed.front()[i];
        delayed.pop_front();
      }
    }
    if (ref_steps) {
      if (spec.clip > 0)
        torch::nn::utils::clip_grad_norm_(reference->parameters(), spec.clip, spec.clip_norm_type);
      ref_opt.step();
    }

    // Distributed: this rank's rows of each micro-batch.
    if (micro_rows % n != 0) {
      throw std::invalid_argument("train_and_compare: a micro-batch of " + std::to_string(micro_rows) +
                                  " rows does not split over " + std::to_string(n) + " ranks");
    }
    const std::int64_t local = micro_rows / n;
    // What each backward sent, under no_sync or not (TrainResult::backwards).
    const auto counted_backward = [&](const at::Tensor& l, bool under_no_sync) {
      const std::uint64_t before = side.bytes_sent ? side.bytes_sent() : 0;
      l.backward();
      if (!side.bytes_sent) return;
      const auto sent = static_cast<std::int64_t>(side.bytes_sent() - before);
      auto& b = result.backwards.back();
      if (under_no_sync) {
        b.no_sync_count += 1;
        b.no_sync_bytes = std::max(b.no_sync_bytes, sent);
        const std::int64_t held = side.unsharded_grad_bytes();
        b.no_sync_unsharded_grad_bytes =
            b.no_sync_unsharded_grad_bytes < 0 ? held : std::min(b.no_sync_unsharded_grad_bytes, held);
      } else {
        b.synced_bytes = b.synced_bytes < 0 ? sent : std::min(b.synced_bytes, sent);
      }
    };
    double my_loss = 0;
    std::vector<at::Tensor> losses;
    for (int m = 0; m < spec.micro_batches; ++m) {
      const auto micro_loss = [&] {
        return loss(side.forward(b.input.narrow(0, m * micro_rows + rank * local, local)).to(at::kFloat),
                    b.target.narrow(0, m * micro_rows + rank * local, local)) /
               spec.micro_batches;
      };
      if (spec.forwards_first) {
        losses.push_back(micro_loss());
        continue;
      }
      std::shared_ptr<void> guard = m + 1 < spec.micro_batches && side.no_sync ? side.no_sync() : nullptr;
      auto l = micro_loss();
      counted_backward(l, guard != nullptr);
      my_loss += l.template item<double>();
    }
    for (std::size_t m = 0; m < losses.size(); ++m) {
      std::shared_ptr<void> guard = m + 1 < losses.size() && side.no_sync ? side.no_sync() : nullptr;
      counted_backward(losses[m], guard != nullptr);
      my_loss += losses[m].template item<double>();
    }
    if (spec.clip > 0)
      result.max_grad_norm = std::max(result.max_grad_norm, side.clip(spec.clip, spec.clip_norm_type));
    side.step();

    loss_sum.fill_(my_loss);
    side.comm->all_reduce(loss_sum, ReduceOp::Avg).wait();
    const double rel =
        std::abs(loss_sum.template item<double>() - ref_loss) / std::max(std::abs(ref_loss), 1e-12);
    result.max_rel_loss_diff = worse(result.max_rel_loss_diff, rel);
  }
}

// The distributed side of train_and_compare: the model, its wrapper and optimizer.
template <typename Holder>
struct ShardedSide {
  Holder model{nullptr};
  std::unique_ptr<FullyShard<Holder>> fsdp;
  ShardedOptimizer opt;
  DistributedSide side;
};

inline void freeze(torch::nn::Module& m, const TrainSpec& spec) {
  if (!spec.frozen) return;
  for (auto& item : m.named_parameters()) {
    if (spec.frozen(item.key())) item.value().requires_grad_(false);
  }
}

template <typename Holder>
std::unique_ptr<ShardedSide<Holder>> make_sharded_side(const World& world,
                                                       const std::function<Holder()>& make,
                                                       const TrainSpec& spec) {
  FullyShardOptions options;
  options.cpu_offload = spec.cpu_offload;
  options.strategy = spec.strategy;
  options.shard_group_size = spec.shard_group_size;
  options.first_bucket_bytes = spec.first_bucket_bytes;
  options.bucket_bytes = spec.bucket_bytes;
  options.find_unused_parameters = spec.find_unused_parameters;
  options.prefetch = spec.prefetch;
  options.mixed_precision.param = spec.param_dtype;
  options.mixed_precision.reduce = spec.reduce_dtype;
  options.mixed_precision.output = spec.output_dtype;
  options.comm.timeout = std::chrono::seconds(60);
  options.comm.name = "test";
  options.comm.transport = spec.transport;
  options.staleness = spec.staleness;
  auto s = std::make_unique<ShardedSide<Holder>>();
  if (spec.build_into_shards) {
    options.device = spec.device;
    BuildIntoShards build(world, options);
    s->model = make();
  } else {
    s->model = make();
    if (spec.build_on_host) {
      options.device = spec.device;
    } else {
      s->model->to(spec.device);
    }
  }
  freeze(*s->model, spec);
  if (spec.recompute) set_recompute(*s->model);
  s->fsdp = std::make_unique<FullyShard<Holder>>(s->model, world, options);
  FullyShard<Holder>& fsdp = *s->fsdp;
  s->opt = sharded_optimizer(spec.optimizer, fsdp, spec.param_groups);
  if (spec.step_in_backward) fsdp.step_in_backward(s->opt.opt.get());
  if (spec.hook) fsdp.register_comm_hook(spec.hook);

  DistributedSide& side = s->side;
  const std::optional<at::ScalarType> output_dtype = spec.output_dtype;
  side.forward = [&fsdp, output_dtype](const at::Tensor& x) {
    auto out = fsdp.forward(x);
    if (output_dtype) EXPECT_EQ(out.scalar_type(), *output_dtype) << "MixedPrecision::output";
    return out;
  };
  if (!spec.reduce_every_micro_batch)
    side.no_sync = [&fsdp] { return std::make_shared<typename FullyShardBase::NoSync>(fsdp); };
  side.clip = [&fsdp](double bound, double norm_type) { return fsdp.clip_grad_norm(bound, norm_type); };
  ShardedOptimizer* opt = &s->opt;
  side.step = [opt] {
    opt->step();
    opt->zero_grad();
  };
  side.comm = &fsdp.comm();
  side.bytes_sent = [&fsdp] { return fsdp.bytes_sent(); };
  side.unsharded_grad_bytes = [&fsdp] { return fsdp.memory().unsharded_grad_bytes; };
  return s;
}

template <typename Holder>
TrainResult train_and_compare(const World& world, const std::function<Holder()>& make,
                              const std::function<Batch(int)>& batch,
                              const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss,
                              const TrainSpec& spec) {
  TrainResult result;
  Holder reference = make();
  reference->to(spec.device);
  freeze(*reference, spec);
  auto ref_opt = reference_optimizer(spec.optimizer, *reference, spec.param_groups);
  auto sharded = make_sharded_side<Holder>(world, make, spec);
  const int split = spec.resume_as ? spec.steps / 2 : spec.steps;
  run_steps(world, reference, *ref_opt, sharded->model, sharded->side, batch, loss, spec, result, 0, split);
  if (spec.resume_as) {
    // Every rank makes the same calls in the same order: the count names the same directory.
    static int resumes = 0;
    const char* port = std::getenv("MASTER_PORT");
    const std::string dir = "/tmp/flatshard-resume-as-" + std::string(port ? port : "0") + "-" +
                            std::to_string(world.world_size()) + "-" + std::to_string(resumes++);
    checkpoint::SaveOptions save;
    save.step = split;
    checkpoint::save_sharded(dir, *sharded->fsdp, sharded->opt.opt.get(), save);
    sharded.reset();
    sharded = make_sharded_side<Holder>(world, make, *spec.resume_as);
    const auto info = checkpoint::load_sharded(dir, *sharded->fsdp, sharded->opt.opt.get());
    EXPECT_EQ(info.step, split);
    run_steps(world, reference, *ref_opt, sharded->model, sharded->side, batch, loss, *spec.resume_as, result,
              split, spec.steps);
    sharded->fsdp->comm().barrier().wait();
    if (world.rank() == 0) std::filesystem::remove_all(dir);
  }
  FullyShard<Holder>& fsdp = *sharded->fsdp;
  result.peak_gathered_units = fsdp.peak_gathered_units();
  result.peak_unsharded_param_bytes = fsdp.memory().peak_unsharded_param_bytes;
  result.largest_unit_bytes = fsdp.largest_unit_bytes();
  result.root_unit_bytes = fsdp.root_unit_bytes();
  result.shard_device = fsdp.shards().front().device();
  result.shards_pinned = fsdp.shards().front().is_pinned();
  {
    const auto masters = checkpoint::full_master_state_dict(fsdp, -1);
    auto ref_params = reference->named_parameters();
    double delta_sq = 0, ref_sq = 0;
    for (const auto& [name, m] : masters) {
      const at::Tensor want = ref_params[name].detach().to(at::kCPU, at::kFloat);
      delta_sq += (m - want).pow(2).sum().template item<double>();
      ref_sq += want.pow(2).sum().template item<double>();
    }
    result.global_rel_master_diff =
        masters.empty() ? std::nan("") : std::sqrt(delta_sq / std::max(ref_sq, 1e-24));
  }
  auto full = fsdp.summon_full_params();
  compare_weights(sharded->model, reference, result);
  return result;
}

}  // namespace flatshard::testing
