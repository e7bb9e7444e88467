// A model trained under any of the four modes with AdamW, behind one interface: the
// examples, benchmarks and tests switch modes with one argument.
//
//   flatshard::examples::AnyMode<GPT> run(model, world, flatshard::plan::Mode::FullShard);
//   auto loss = criterion(run.forward(x), y);
//   loss.backward();
//   run.step();                                   // optimizer step and zero_grad
//   run.save("ckpt", step);                       // sharded checkpoint
//
// FullShard / Zero2: FullyShard (full shard / shard-grad-op) + optim::Adam over its shards.
// DDP: DistributedDataParallel + torch::optim::AdamW. Zero1: DDP + ZeroRedundancyOptimizer.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "flatshard/flatshard.h"
#include "flatshard/plan.h"

namespace flatshard::examples {

struct AnyModeOptions {
  optim::AdamWOptions adamw{1e-3, 0.9, 0.999, 1e-8, 0.1};
  std::optional<optim::SGDOptions> sgd;  // set: SGD instead of AdamW in every mode
  FullyShardOptions fully_shard;         // strategy is set from the mode
  DDPOptions ddp;                        // sharded_optimizer is set from the mode
};

template <typename Holder>
class AnyMode {
 public:
  AnyMode(Holder model, const World& world, plan::Mode mode, AnyModeOptions o = {})
      : model_(model), mode_(mode) {
    if (mode == plan::Mode::FullShard || mode == plan::Mode::Zero2) {
      o.fully_shard.strategy = mode == plan::Mode::FullShard ? Strategy::FullShard : Strategy::ShardGradOp;
      fsdp_ = std::make_unique<FullyShard<Holder>>(model, world, o.fully_shard);
      if (o.sgd) {
        shard_opt_ = std::make_unique<optim::SGD>(fsdp_->shards(), *o.sgd);
      } else {
        shard_opt_ = std::make_unique<optim::Adam>(fsdp_->shards(), o.adamw);
      }
    } else {
      o.ddp.sharded_optimizer = mode == plan::Mode::Zero1;
      ddp_ = std::make_unique<DistributedDataParallel<Holder>>(model, world, o.ddp);
      if (mode == plan::Mode::DDP && o.sgd) {
        torch_opt_ = std::make_unique<torch::optim::SGD>(
            ddp_->optimizer_params(),
            torch::optim::SGDOptions(o.sgd->lr).momentum(o.sgd->momentum).weight_decay(o.sgd->weight_decay));
      } else if (mode == plan::Mode::DDP) {
        torch_opt_ = std::make_unique<torch::optim::AdamW>(ddp_->optimizer_params(),
                                                           torch::optim::AdamWOptions(o.adamw.lr)
                                                               .betas({o.adamw.beta1, o.adamw.beta2})
                                                               .eps(o.adamw.eps)
                                                               .weight_decay(o.adamw.weight_decay));
      } else {
        zero_ = o.sgd ? std::make_unique<ZeroRedundancyOptimizer>(*ddp_, *o.sgd)
                      : std::make_unique<ZeroRedundancyOptimizer>(*ddp_, o.adamw);
      }
    }
  }

  at::Tensor forward(const at::Tensor& x) { return fsdp_ ? fsdp_->forward(x) : ddp_->forward(x); }

  double clip_grad_norm(double max_norm) {
    if (fsdp_) return fsdp_->clip_grad_norm(max_norm);
    return zero_ ? zero_->clip_grad_norm(max_norm) : ddp_->clip_grad_norm(max_norm);
  }

  // The optimizer's step, then zero_grad.
  void step() {
    if (shard_opt_) {
      shard_opt_->step();
      shard_opt_->zero_grad();
    } else if (torch_opt_) {
      torch_opt_->step();
      torch_opt_->zero_grad();
    } else {
      zero_->step();
      zero_->zero_grad();
    }
  }

  checkpoint::CheckpointInfo save(const std::string& root, std::int64_t step, int keep_last = 2) {
    checkpoint::SaveOptions o;
    o.step = step;
    o.keep_last = keep_last;
    if (fsdp_) return checkpoint::save_sharded(root, *fsdp_, shard_opt_.get(), o);
    if (zero_) return checkpoint::save_sharded(root, *zero_, o);
    return checkpoint::save_sharded(root, *ddp_, torch_opt_.get(), o);
  }

  checkpoint::CheckpointInfo load(const std::string& path) {
    if (fsdp_) return checkpoint::load_sharded(path, *fsdp_, shard_opt_.get());
    if (zero_) return checkpoint::load_sharded(path, *zero_);
    return checkpoint::load_sharded(path, *ddp_, torch_opt_.get());
  }

  // Full parameters on rank `to` (every rank when -1). A collective.
  std::map<std::string, at::Tensor> params(int to = -1) {
    return fsdp_ ? checkpoint::full_state_dict(*fsdp_, *model_, to)
                 : checkpoint::full_state_dict(*ddp_, *model_, to);
  }

  // AdamW's state by "<parameter>.<state>" plus "step", on rank 0. A collective.
  std::map<std::string, at::Tensor> adam_state() {
    if (fsdp_) return checkpoint::full_optimizer_state_dict(*fsdp_, *shard_opt_, 0);
    if (zero_) return zero_->consolidated_state_dict(0);
    std::map<std::string, at::Tensor> out;
    std::int64_t steps = 0;
    for (const auto& item : model_->named_parameters()) {
      const auto& st = static_cast<const torch::optim::AdamWParamState&>(
          *torch_opt_->state().at(item.value().unsafeGetTensorImpl()));
      out[item.key() + ".exp_avg"] = st.exp_avg();
      out[item.key() + ".exp_avg_sq"] = st.exp_avg_sq();
      steps = std::max(steps, st.step());
    }
    out["step"] = at::full({}, steps, at::kLong);
    return out;
  }

  Communicator& comm() { return fsdp_ ? fsdp_->comm() : ddp_->comm(); }
  std::int64_t skipped_steps() const { return fsdp_ ? fsdp_->skipped_steps() : ddp_->skipped_steps(); }
  plan::Mode mode() const { return mode_; }
  Holder& model() { return model_; }
  FullyShard<Holder>* fully_shard() { return fsdp_.get(); }
  optim::ShardOptimizer* shard_optimizer() { return shard_opt_.get(); }
  ZeroRedundancyOptimizer* zero() { return zero_.get(); }

 private:
  Holder model_;
  plan::Mode mode_;
  std::unique_ptr<FullyShard<Holder>> fsdp_;
  std::unique_ptr<optim::ShardOptimizer> shard_opt_;
  std::unique_ptr<DistributedDataParallel<Holder>> ddp_;
  std::unique_ptr<torch::optim::Optimizer> torch_opt_;
  std::unique_ptr<ZeroRedundancyOptimizer> zero_;
};

}  // namespace flatshard::examples
