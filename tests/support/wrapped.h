// A model wrapped by FullyShard under one strategy, with optim::Adam (decoupled weight
// decay: AdamW) or optim::SGD over its shards, behind the calls the checkpoint,
// reliability and planner tests make:
//
//   flatshard::testing::Wrapped<GPT> run(model, world, flatshard::Strategy::FullShard);
//   auto loss = criterion(run.forward(x), y);
//   loss.backward();
//   run.step();                                   // optimizer step and zero_grad
//   run.save("ckpt", step);                       // sharded checkpoint
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "flatshard/flatshard.h"
#include "flatshard/plan.h"

namespace flatshard::testing {

struct WrappedOptions {
  optim::AdamWOptions adamw{1e-3, 0.9, 0.999, 1e-8, 0.1};
  std::optional<optim::SGDOptions> sgd;  // set: SGD instead of AdamW in every mode
  FullyShardOptions fully_shard;         // strategy is set from the constructor's
};

template <typename Holder>
class Wrapped {
 public:
  Wrapped(Holder model, const World& world, Strategy strategy, WrappedOptions o = {}) : model_(model) {
    o.fully_shard.strategy = strategy;
    fsdp_ = std::make_unique<FullyShard<Holder>>(model, world, o.fully_shard);
    if (o.sgd) {
      shard_opt_ = std::make_unique<optim::SGD>(*fsdp_, *o.sgd);
    } else {
      shard_opt_ = std::make_unique<optim::AdamW>(*fsdp_, o.adamw);
    }
  }

  at::Tensor forward(const at::Tensor& x) { return fsdp_->forward(x); }
  double clip_grad_norm(double max_norm) { return fsdp_->clip_grad_norm(max_norm); }

  // The optimizer's step, then zero_grad.
  void step() {
    shard_opt_->step();
    shard_opt_->zero_grad();
  }

  checkpoint::CheckpointInfo save(const std::string& root, std::int64_t step, int keep_last = 2) {
    checkpoint::SaveOptions o;
    o.step = step;
    o.keep_last = keep_last;
    return checkpoint::save_sharded(root, *fsdp_, shard_opt_.get(), o);
  }

  checkpoint::CheckpointInfo load(const std::string& path) {
    return checkpoint::load_sharded(path, *fsdp_, shard_opt_.get());
  }

  // Full parameters on rank `to` (every rank when -1). A collective.
  std::map<std::string, at::Tensor> params(int to = -1) {
    return checkpoint::full_state_dict(*fsdp_, *model_, to);
  }

  // AdamW's state by "<parameter>.<state>" plus "step", on rank 0. A collective.
  std::map<std::string, at::Tensor> adam_state() {
    return checkpoint::full_optimizer_state_dict(*fsdp_, *shard_opt_, 0);
  }

  Communicator& comm() { return fsdp_->comm(); }
  std::int64_t skipped_steps() const { return fsdp_->skipped_steps(); }
  Holder& model() { return model_; }
  FullyShard<Holder>& fully_shard() { return *fsdp_; }
  optim::ShardOptimizer* shard_optimizer() { return shard_opt_.get(); }

 private:
  Holder model_;
  std::unique_ptr<FullyShard<Holder>> fsdp_;
  std::unique_ptr<optim::ShardOptimizer> shard_opt_;
};

}  // namespace flatshard::testing
