// Optimizers over flat fp32 shards (FullyShard::shards()), with parameter groups.
//
//   using namespace flatshard::optim;
//   AdamW opt(fsdp, {.lr = 3e-4, .weight_decay = 0.1},
//             {{"no_decay", biases_norms_embeddings(), {.lr = 3e-4, .weight_decay = 0}}});
//   LRScheduler sched(opt, warmup_then(100, cosine(9900, 0.1)));
//   ... opt.step(); sched.step(); opt.zero_grad();
//
// Each step runs the Thrust step kernels (optim/step_kernels.h) over each run of a shard
// whose parameters share a group; results equal torch::optim's with the same groups on
// unsharded training. A parameter that got no gradient in the step (on any rank) is left
// untouched, and its step count does not advance, as torch::optim leaves a parameter whose
// .grad is undefined. See docs/optimizers.md.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace flatshard {
class FullyShardBase;
}

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

// Chooses parameters by their name in the model and their shape. Combine with ||, &&, !.
class ParamFilter {
 public:
  using Fn = std::function<bool(const std::string& name, const std::vector<std::int64_t>& shape)>;
  ParamFilter(Fn fn) : fn_(std::move(fn)) {}  // NOLINT: a lambda is a filter
  bool operator()(const std::string& name, const std::vector<std::int64_t>& shape) const {
    return fn_(name, shape);
  }
  friend ParamFilter operator||(ParamFilter a, ParamFilter b);
  friend ParamFilter operator&&(ParamFilter a, ParamFilter b);
  friend ParamFilter operator!(ParamFilter a);

 private:
  Fn fn_;
};

// Names holding any of `parts` ("bias", "ln_", "wte", ...).
ParamFilter names_containing(std::vector<std::string> parts);
// Parameters with fewer than `dims` dimensions (dims 2: biases and norms' weights).
ParamFilter dims_below(int dims);
// What GPT recipes exempt from weight decay: biases and norms (fewer than 2 dimensions)
// and embeddings (names holding "emb", "wte" or "wpe").
ParamFilter biases_norms_embeddings();

// A group: the parameters `params` chooses, and their hyperparameters. Parameters that
// no group chooses form the default group (the constructor's options), group 0.
template <typename Options>
struct ParamGroup {
  std::string name;
  ParamFilter params;
  Options options;
};

// What every optimizer over shards shares: the shards, the groups, which parameters own
// which elements, per-parameter step counts, zeroing.
class ShardOptimizer {
 public:
  virtual ~ShardOptimizer();
  // Steps every shard that has a gradient.
  void step();
  // Steps shard i if it has a gradient (FullyShardBase::step_in_backward calls it as
  // each unit's gradient shard is ready).
  void step_shard(std::size_t i);
  void zero_grad();
  // Bytes of optimizer state held by this rank.
  virtual std::int64_t state_bytes() const = 0;
  // "SGD", "Adam" or "AdamW" ("" for an optimizer of the program's own): checkpoints record
  // it, and a load into another refuses it (Adam and AdamW keep the same state under the
  // same names, and differ in how weight decay applies).
  virtual std::string kind() const { return {}; }

  // Groups: 0 is the default group ("default"), then the constructor's, in order.
  std::size_t num_groups() const { return group_names_.size(); }
  const std::string& group_name(std::size_t group) const;
  // The group of a parameter, by name (throws InvalidArgument for an unknown name).
  std::size_t group_of(const std::string& param) const;
  // Learning rate of a group, changed between steps (what LRScheduler does).
  virtual double lr(std::size_t group) const = 0;
  virtual void set_lr(std::size_t group, double lr) = 0;
  // A group's hyperparameters by name (lr, momentum, beta1, weight_decay, ...), for
  // checkpoints; set_hyperparameters takes the names hyperparameters() gives.
  virtual std::map<std::string, double> hyperparameters(std::size_t group) const = 0;
  virtual void set_hyperparameters(std::size_t group, const std::map<std::string, double>& values) = 0;
  // Note [A schedule's base rate]: a group's learning rate before any schedule scaled it
  // (PyTorch's param_group["initial_lr"]): taken from lr() by the first LRScheduler made
  // over the optimizer, and kept (checkpoints save it), so that a second scheduler, or one
  // made after a load, scales the same base rather than a rate already scaled.
  double initial_lr(std::size_t group);
  std::optional<double> saved_initial_lr(std::size_t group) const;  // none until taken
  void set_initial_lr(std::size_t group, double lr);

  // The state of shard i by name (momentum_buffer; exp_avg, exp_avg_sq); undefined
  // tensors before its first step.
  virtual std::vector<std::pair<std::string, at::Tensor>> named_state(std::size_t i) const = 0;
  // The names named_state() uses once the optimizer has stepped.
  virtual std::vector<std::string> state_names() const = 0;
  // For loading: the state `name` of shard i (created as zeros if it does not exist
  // yet), to copy values into.
  virtual at::Tensor mutable_state(std::size_t i, const std::string& name) = 0;
  // Steps taken by a parameter (by name; the most of any parameter of shard i when the
  // optimizer was made over bare shards), and setting them when loading.
  std::int64_t steps(std::size_t i, const std::string& param) const;
  void set_steps(std::size_t i, const std::string& param, std::int64_t steps);
  // The most steps any parameter of shard i has taken.
  std::int64_t steps(std::size_t i) const;
  const std::vector<at::Tensor>& shards() const { return shards_; }

 protected:
  // Over bare shards: one group, each shard one run (no parameter names, so every
  // element of a shard with a gradient steps).
  explicit ShardOptimizer(std::vector<at::Tensor> shards);
  // Over a wrapper's shards, with groups chosen by name and shape. The optimizer reads
  // the wrapper's layout and which parameters got gradients: keep the wrapper alive.
  ShardOptimizer(FullyShardBase& fsdp, const std::vector<std::pair<std::string, ParamFilter>>& groups,
                 const char* who);

  // A run of shard elements [offset, offset + numel) whose parameters share a group and
  // a step count; `step` counts this step (1 on the first), `first` is step == 1.
  struct Run {
    std::int64_t offset = 0;
    std::int64_t numel = 0;
    std::size_t group = 0;
    std::int64_t step = 1;
    // Where the run starts in the shard's bf16 copy (CPU offload:
    // FullyShardOptions::offload_bf16_copy), for step_run to write each updated element
    // rounded to bf16 (optim/step_kernels.h does it as it steps); null when the shard has
    // none, or the optimizer does not write copies.
    std::uint16_t* bf16_copy = nullptr;
  };
  // Steps one run of shard i, whose gradient is `grad` (contiguous, same length).
  virtual void step_run(std::size_t i, const at::Tensor& grad, const Run& run) = 0;
  // Whether step_run writes Run::bf16_copy. An optimizer that does not leaves the copies
  // stale (its step still counts as a write of the masters), and the gathers then send
  // the fp32 masters.
  virtual bool writes_bf16_copies() const { return false; }
  // Makes shard i's state before its first run steps.
  virtual void ensure_state(std::size_t i) = 0;

  std::vector<at::Tensor> shards_;

 private:
  struct Layout;
  void refresh_layout();
  std::vector<std::string> group_names_;
  std::vector<std::optional<double>> initial_lrs_;  // by group; Note [A schedule's base rate]
  FullyShardBase* fsdp_ = nullptr;
  std::unique_ptr<Layout> layout_;
};

class SGD final : public ShardOptimizer {
 public:
  SGD(std::vector<at::Tensor> shards, const SGDOptions& options);
  SGD(FullyShardBase& fsdp, const SGDOptions& options, std::vector<ParamGroup<SGDOptions>> groups = {});
  std::int64_t state_bytes() const override;
  std::string kind() const override { return "SGD"; }
  double lr(std::size_t group) const override { return options_.at(group).lr; }
  void set_lr(std::size_t group, double lr) override;
  std::map<std::string, double> hyperparameters(std::size_t group) const override;
  void set_hyperparameters(std::size_t group, const std::map<std::string, double>& values) override;
  std::vector<std::pair<std::string, at::Tensor>> named_state(std::size_t i) const override;
  std::vector<std::string> state_names() const override;
  at::Tensor mutable_state(std::size_t i, const std::string& name) override;

 private:
  void step_run(std::size_t i, const at::Tensor& grad, const Run& run) override;
  bool writes_bf16_copies() const override { return true; }
  void ensure_state(std::size_t i) override;
  bool has_momentum() const;
  std::vector<SGDOptions> options_;   // by group
  std::vector<at::Tensor> momentum_;  // per shard; undefined until its first step
};

class Adam : public ShardOptimizer {
 public:
  Adam(std::vector<at::Tensor> shards, const AdamOptions& options);
  Adam(FullyShardBase& fsdp, const AdamOptions& options, std::vector<ParamGroup<AdamOptions>> groups = {});
  std::int64_t state_bytes() const override;
  std::string kind() const override { return decoupled_ ? "AdamW" : "Adam"; }
  double lr(std::size_t group) const override { return options_.at(group).lr; }
  void set_lr(std::size_t group, double lr) override;
  std::map<std::string, double> hyperparameters(std::size_t group) const override;
  void set_hyperparameters(std::size_t group, const std::map<std::string, double>& values) override;
  std::vector<std::pair<std::string, at::Tensor>> named_state(std::size_t i) const override;
  std::vector<std::string> state_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  at::Tensor mutable_state(std::size_t i, const std::string& name) override;

 protected:
  // AdamW: the same state and step with decoupled weight decay.
  Adam(std::vector<at::Tensor> shards, const AdamWOptions& options);
  Adam(FullyShardBase& fsdp, const AdamWOptions& options, std::vector<ParamGroup<AdamWOptions>> groups);

 private:
  void step_run(std::size_t i, const at::Tensor& grad, const Run& run) override;
  bool writes_bf16_copies() const override { return true; }
  void ensure_state(std::size_t i) override;
  std::vector<AdamOptions> options_;  // by group
  bool decoupled_ = false;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;
};

// AdamW: Adam with decoupled weight decay (torch::optim::AdamW), a ShardOptimizer like
// the others.
class AdamW final : public Adam {
 public:
  AdamW(std::vector<at::Tensor> shards, const AdamWOptions& options) : Adam(std::move(shards), options) {}
  AdamW(FullyShardBase& fsdp, const AdamWOptions& options, std::vector<ParamGroup<AdamWOptions>> groups = {})
      : Adam(fsdp, options, std::move(groups)) {}
};

}  // namespace flatshard::optim
