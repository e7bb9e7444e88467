// Distributed data parallel: replicated parameters, gradients averaged by bucketed
// all-reduce that overlaps backward.
//
//   auto world = flatshard::init();
//   Net model;
//   flatshard::DistributedDataParallel<Net> ddp(model, world, {});
//   torch::optim::SGD opt(ddp.optimizer_params(), 0.1);   // model->parameters() unless mixed precision
//   auto loss = criterion(ddp.forward(x), y);
//   loss.backward();                                     // buckets all-reduce as they fill
//   opt.step(); opt.zero_grad();
//
// See docs/ddp-zero.md.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "flatshard/communicator.h"
#include "flatshard/fully_shard.h"
#include "flatshard/unit.h"
#include "flatshard/world.h"

namespace flatshard {

enum class GradReduce {
  AllReduce,      // every rank gets the averaged gradient
  ReduceScatter,  // each rank gets its slice of each bucket (ZeroRedundancyOptimizer only)
};

struct DDPOptions {
  // Gradients go into buckets in reverse registration order: the first holds up to
  // first_bucket_bytes, the rest up to bucket_bytes (a larger parameter gets its own).
  std::int64_t first_bucket_bytes = std::int64_t{1} << 20;
  std::int64_t bucket_bytes = std::int64_t{25} << 20;
  // Parameters that get no gradient in a step are allowed (and their gradient stays
  // undefined when no rank used them). Off: a missing gradient is an error naming them.
  bool find_unused_parameters = false;
  // Broadcast rank 0's buffers (batch-norm statistics, ...) before each forward.
  bool broadcast_buffers = true;
  // param: compute dtype of the model's parameters and gradients; the optimizer then
  // updates fp32 masters (optimizer_params()). reduce: dtype of the all-reduce.
  MixedPrecision mixed_precision;
  CommunicatorOptions comm{std::chrono::minutes(5), "ddp"};
  // Checked at construction for DDP with a replicated optimizer; set
  // sharded_optimizer when a ZeroRedundancyOptimizer will hold the state (ZeRO-1).
  MemoryBudget memory_budget;
  bool sharded_optimizer = false;
  // NaN/Inf in the reduced gradients: Skip drops them (torch::optim and
  // ZeroRedundancyOptimizer then skip the step), Raise throws from backward.
  NonFiniteGrads nonfinite_grads = NonFiniteGrads::Ignore;
};

namespace sharding {
class DdpEngine;
}

class DDPBase {
 public:
  DDPBase(std::shared_ptr<torch::nn::Module> model, const World& world, const DDPOptions& options);
  ~DDPBase();
  DDPBase(const DDPBase&) = delete;
  DDPBase& operator=(const DDPBase&) = delete;

  // What the optimizer should update: the model's parameters, or their fp32 masters
  // under mixed precision (copied into the model before each forward).
  std::vector<at::Tensor> optimizer_params() const;

  // While the guard lives, backward accumulates gradients locally and sends nothing.
  class NoSync {
   public:
    explicit NoSync(DDPBase& owner);
    ~NoSync();

   private:
    DDPBase& owner_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // Global gradient-norm clipping over optimizer_params()' gradients (all-reduced
  // gradients are the same everywhere, so no communication); returns the norm.
  double clip_grad_norm(double max_norm);

  std::int64_t skipped_steps() const;
  int num_buckets() const;
  // Parameter names per bucket, in bucket order (for tests and logs).
  std::vector<std::vector<std::string>> bucket_layout() const;
  // Bytes of replicated parameters, gradients and fp32 masters on this rank.
  std::string memory_report() const;
  Communicator& comm();
  const World& world() const { return world_; }
  sharding::DdpEngine& engine() { return *engine_; }
  torch::nn::Module& root_module();

 protected:
  void pre_forward();

 private:
  World world_;
  std::unique_ptr<sharding::DdpEngine> engine_;
};

template <typename ModelHolder>
class DistributedDataParallel : public DDPBase {
 public:
  DistributedDataParallel(ModelHolder model, const World& world, const DDPOptions& options = {})
      : DDPBase(model.ptr(), world, options), model_(std::move(model)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    pre_forward();
    return model_->forward(std::forward<Args>(args)...);
  }

  ModelHolder& module() { return model_; }

 private:
  ModelHolder model_;
};

}  // namespace flatshard
