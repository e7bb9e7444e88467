// Optimizers over flat fp32 shards (FullyShard::shards()). Each step runs the Thrust
// step kernels (optim/step_kernels.h) on every shard that has a gradient; results
// equal torch::optim's on unsharded training.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace flatshard::optim {

struct SGDOptions {
  double lr = 0.01;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
};

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;  // L2, added to the gradient (torch::optim::Adam)
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;  // decoupled (torch::optim::AdamW)
};

// What every optimizer over shards shares: the shards and zeroing.
class ShardOptimizer {
 public:
  explicit ShardOptimizer(std::vector<at::Tensor> shards);
  virtual ~ShardOptimizer() = default;
  // Steps every shard that has a gradient.
  void step();
  // Steps shard i if it has a gradient (FullyShardBase::step_in_backward calls it as
  // each unit's gradient shard is ready).
  virtual void step_shard(std::size_t i) = 0;
  void zero_grad();
  // Bytes of optimizer state held by this rank.
  virtual std::int64_t state_bytes() const = 0;
  // The state of shard i by name (momentum_buffer; exp_avg, exp_avg_sq), and its step
  // count; undefined tensors before its first step.
  virtual std::vector<std::pair<std::string, at::Tensor>> named_state(std::size_t i) const = 0;
  virtual std::int64_t steps(std::size_t i) const = 0;
  // The names named_state() uses once the optimizer has stepped.
  virtual std::vector<std::string> state_names() const = 0;
  // For loading: the state `name` of shard i (created as zeros if it does not exist
  // yet), to copy values into, and its step count.
  virtual at::Tensor mutable_state(std::size_t i, const std::string& name) = 0;
  virtual void set_steps(std::size_t i, std::int64_t steps) = 0;
  const std::vector<at::Tensor>& shards() const { return shards_; }

 protected:
  std::vector<at::Tensor> shards_;
};

class SGD final : public ShardOptimizer {
 public:
  SGD(std::vector<at::Tensor> shards, const SGDOptions& options);
  void step_shard(std::size_t i) override;
  std::int64_t state_bytes() const override;
  std::vector<std::pair<std::string, at::Tensor>> named_state(std::size_t i) const override;
  std::int64_t steps(std::size_t i) const override { return steps_[i]; }
  std::vector<std::string> state_names() const override;
  at::Tensor mutable_state(std::size_t i, const std::string& name) override;
  void set_steps(std::size_t i, std::int64_t steps) override { steps_[i] = steps; }

 private:
  SGDOptions options_;
  std::vector<std::int64_t> steps_;
  std::vector<at::Tensor> momentum_;  // per shard; undefined until its first step
};

class Adam : public ShardOptimizer {
 public:
  Adam(std::vector<at::Tensor> shards, const AdamOptions& options);
  Adam(std::vector<at::Tensor> shards, const AdamWOptions& options);
  void step_shard(std::size_t i) override;
  std::int64_t state_bytes() const override;
  std::vector<std::pair<std::string, at::Tensor>> named_state(std::size_t i) const override;
  std::int64_t steps(std::size_t i) const override { return steps_[i]; }
  std::vector<std::string> state_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  at::Tensor mutable_state(std::size_t i, const std::string& name) override;
  void set_steps(std::size_t i, std::int64_t steps) override { steps_[i] = steps; }

 private:
  AdamOptions options_;
  bool decoupled_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;
  std::vector<std::int64_t> steps_;
};

// AdamW: Adam with decoupled weight decay (torch::optim::AdamW), a ShardOptimizer like
// the others.
class AdamW final : public Adam {
 public:
  AdamW(std::vector<at::Tensor> shards, const AdamWOptions& options) : Adam(std::move(shards), options) {}
};

}  // namespace flatshard::optim
