// Fully sharded data parallel: the root wrapper.
//
//   auto world = flatshard::init();
//   GPT model(cfg);                                  // blocks declared as flatshard::Unit<Block>
//   flatshard::FullyShard fsdp(model, world, {.strategy = flatshard::Strategy::FullShard});
//   flatshard::optim::AdamW opt(fsdp, {.lr = 3e-4});
//   auto loss = criterion(fsdp.forward(x), y);
//   loss.backward();                                 // gathers, reduce-scatters
//   fsdp.clip_grad_norm(1.0);
//   opt.step(); opt.zero_grad();
//
// Each unit's parameters are flattened into one buffer, padded to a multiple of the
// world size and of 16 bytes per shard, and sharded: this rank keeps an fp32 master
// shard (what the optimizer updates) and its gradient. The module keeps its own
// parameter objects: between gathers they are empty; while a unit is gathered they are
// views into its flat buffer. Parameters outside every unit form the root unit.
// See docs/fully-shard.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "flatshard/comm_hooks.h"
#include "flatshard/communicator.h"
#include "flatshard/strategy.h"
#include "flatshard/unit.h"
#include "flatshard/world.h"

namespace flatshard {

// FSDP2's MixedPrecisionPolicy, for every unit of the model (docs/fully-shard.md#mixed-precision).
struct MixedPrecision {
  // dtype of gathered parameters, activations' weights and gradients (default: as the
  // model's). Master shards and optimizer states stay fp32.
  std::optional<at::ScalarType> param;
  // dtype gradients are reduce-scattered in (default: the param dtype).
  std::optional<at::ScalarType> reduce;
  // dtype the wrapper's floating-point outputs are cast to (default: left as computed),
  // e.g. kFloat to take the loss in fp32 from a bf16 model.
  std::optional<at::ScalarType> output;
  // With `param` set: floating-point tensor arguments of the wrapper's forward and of each
  // unit's are cast to it first (integer ones, such as token ids, are left alone), so that
  // fp32 inputs, or an fp32 buffer added between units, meet bf16 weights as bf16.
  bool cast_forward_inputs = true;
};

// A per-rank memory budget, checked when a wrapper is built: if the model's states
// (parameters, gradients, optimizer state, gathered units; plan.h, activations not
// included) need more, construction throws MemoryBudgetError stating need and budget.
struct MemoryBudget {
  std::int64_t bytes = 0;             // 0: no budget
  int optimizer_state_bytes = 8;      // per parameter: AdamW 8, SGD with momentum 4, SGD 0
  std::int64_t activation_bytes = 0;  // add this much for activations, when known
};

// What to do when gradients hold NaN or Inf after backward. The check is collective
// (a non-finite value on any rank is seen by every rank) and runs once per synced
// backward, after the gradients are reduced.
enum class NonFiniteGrads {
  Ignore,  // no check
  Skip,    // drop this step's gradients (the optimizer then skips the step), log it, count it
  Raise,   // backward throws NonFiniteGradError on every rank
};

// How a sharded wrapper (FullShard, ShardGradOp, HybridShard) meets ranks whose model holds
// different initial values (Note [Same values on every rank] in sharding/model_check.cpp).
// Models built into shards (BuildIntoShards) were compared unit by unit as they were
// built. NoShard and ShardOptimizerState always start every rank from rank 0's parameters
// and buffers, as PyTorch's DDP does, whatever this says.
enum class SyncModuleStates {
  // Each rank hashes each unit's parameters and the model's buffers (24 bytes per unit
  // cross the network); on any difference every rank throws InvalidArgument naming the
  // unit and which ranks hold which version.
  Check,
  // Rank 0's parameters and buffers are copied to every rank before sharding (PyTorch
  // FSDP's sync_module_states=True): ranks may build with any seed; rank 0 may load a
  // checkpoint alone.
  FromRank0,
  // Neither: the caller guarantees the values agree (skips hashing the whole model).
  Trust,
};

struct FullyShardOptions {
  Strategy strategy = Strategy::FullShard;
  // HybridShard: ranks per shard group; they are consecutive (ranks [k G, (k + 1) G) form
  // group k) and the world size must divide by G. 0: the ranks of one machine
  // (World::local_world_size()). Ignored by the other strategies (they shard over the world).
  int shard_group_size = 0;
  // Default: true for FullShard, false for ShardGradOp.
  std::optional<bool> reshard_after_forward;
  // Units gathered ahead of the one running (forward: the next; backward: the
  // previous). At most prefetch + 1 units besides the root are gathered at once.
  int prefetch = 1;
  MixedPrecision mixed_precision;
  SyncModuleStates sync_module_states = SyncModuleStates::Check;
  CommunicatorOptions comm{std::chrono::minutes(5), "fully_shard"};
  MemoryBudget memory_budget;
  NonFiniteGrads nonfinite_grads = NonFiniteGrads::Ignore;
  // The device the gathered units, their gradients and the collectives live on (and,
  // without offload, the master shards and optimizer state). Default: the device of the
  // model's parameters. A model built on the host may name a GPU here: each unit moves
  // to it as it is sharded, so the whole model never sits on the GPU.
  std::optional<c10::Device> device;
  // NoShard and ShardOptimizerState reduce gradients in buckets: segments of the model's
  // flat buffer, filled in reverse registration order (the first up to
  // first_bucket_bytes, the rest up to bucket_bytes; a larger parameter gets its own) and
  // laid out again after the first backward in the order gradients arrived (DDP's
  // bucket_cap_mb and rebuild).
  std::int64_t first_bucket_bytes = std::int64_t{1} << 20;
  std::int64_t bucket_bytes = std::int64_t{25} << 20;
  // Parameters may get no gradient in a step, and not on every rank alike: one small
  // all-reduce per synced backward finds those no rank gave one, which the optimizer
  // leaves untouched (DDP's find_unused_parameters). Off: NoShard and ShardOptimizerState
  // refuse a parameter without a gradient (an error naming it); the sharded strategies
  // leave untouched the parameters this rank gave none, which is right when every rank
  // leaves the same ones unused (as FSDP2 assumes). A whole unit some ranks' backward does
  // not reach is reduced with zeros there; under FullShard and HybridShard, where backward
  // gathers units again, ranks whose backwards gathered different units throw
  // InvalidArgument (Note [Units a backward did not reach] in sharding/gradients.cpp).
  bool find_unused_parameters = false;
  // NoShard and ShardOptimizerState: rank 0's buffers (batch-norm statistics, ...) are
  // broadcast before each forward (DDP's broadcast_buffers).
  bool broadcast_buffers = true;
  // CPU offload (FSDP's CPUOffload, DeepSpeed's offload_optimizer), every strategy: master
  // shards (NoShard: the whole fp32 master; ShardOptimizerState: this rank's slices), their
  // gradients and the optimizer's state stay in host memory (pinned, when `device` is a
  // GPU) and the optimizer steps on the CPU; each gather (or refresh) copies the updated
  // values to the device and each reduced gradient is copied back, both without blocking
  // the host. Not with decentralized_every.
  bool cpu_offload = false;
  // Under cpu_offload with a bf16 compute dtype (mixed_precision.param): the optimizer's
  // step also writes each master shard rounded to bf16 into host memory beside it, and the
  // gathers copy that to the device instead of the fp32 master: half the bytes cross, for
  // 2 more bytes of host memory per parameter (DeepSpeed's offload keeps such a copy too).
  // Training is bit for bit the same either way.
  bool offload_bf16_copy = true;
  // NoShard and ShardOptimizerState: asynchronous data parallelism with bounded staleness
  // (0: off; at most kMaxStaleness). The gradients of synced backward t are averaged while
  // the next `staleness` steps compute, and backward t + staleness hands the optimizer step
  // t's average: each update is `staleness` steps late, and no step waits for the
  // communication of its own gradients. The first `staleness` steps find no gradient and
  // do not step. Combines with communication hooks.
  int staleness = 0;
  // NoShard: decentralized training (0: off). No gradient is averaged: every
  // `decentralized_every`-th synced backward each rank averages its parameters with its two
  // ring neighbours', w_i <- (w_{i-1} + w_i + w_{i+1}) / 3 (exchanged while forward and
  // backward run), and the optimizer steps that average with this rank's own gradient.
  int decentralized_every = 0;
  static constexpr int kMaxStaleness = 8;
};

// The ranks a FullyShard shards over: all of them, or under HybridShard this rank's
// group of `size` consecutive ranks, one of `replicas` groups that hold the same shards.
// Under NoShard every rank is a group of one: a whole replica.
struct ShardGroup {
  int size = 1;      // ranks sharing one copy of the model (the shards' world size)
  int rank = 0;      // this rank's place in its group (its shard index)
  int replicas = 1;  // groups (world size / size)
  int replica = 0;   // this rank's group
};
// The shard group `options` give on `world`; throws InvalidArgument when HybridShard's
// group size does not divide the world size.
ShardGroup shard_group(const World& world, const FullyShardOptions& options);

// Byte counts of one rank (see memory accounting in docs/fully-shard.md).
struct ShardMemory {
  std::int64_t param_shard_bytes = 0;      // fp32 master shards
  std::int64_t bf16_copy_bytes = 0;        // their bf16 copies (cpu_offload, offload_bf16_copy)
  std::int64_t grad_shard_bytes = 0;       // fp32 shard gradients
  std::int64_t unsharded_param_bytes = 0;  // gathered flat buffers now
  std::int64_t unsharded_grad_bytes = 0;   // unsharded flat gradients now
  std::int64_t peak_unsharded_param_bytes = 0;
  std::int64_t peak_unsharded_grad_bytes = 0;
};

// Where each parameter sits in a shard's flat buffer (see FullyShardBase::layout()). The
// buffer is one or more segments (a unit is one; NoShard and ShardOptimizerState cut the
// model into buckets), each padded to shard-group-size equal slices; the shard is this
// rank's slice of every segment, one after the other.
struct ShardLayout {
  struct Param {
    std::string name;
    std::vector<std::int64_t> shape;
    std::int64_t offset = 0;  // in the flat buffer, elements
    std::int64_t numel = 0;
  };
  struct Segment {
    std::int64_t offset = 0;        // in the flat buffer
    std::int64_t padded_numel = 0;  // shard-group-size slices
    std::int64_t slice = 0;         // elements of it in each shard
    std::int64_t shard_offset = 0;  // where this rank's slice sits in the shard
  };
  std::vector<Param> params;
  std::vector<Segment> segments;
  std::int64_t padded_numel = 0;  // the flat buffer: every segment
  std::int64_t shard_numel = 0;   // the shard: one slice of every segment
};

namespace sharding {
class Engine;
}
namespace optim {
class ShardOptimizer;
}

// The engine, independent of the model's type. FullyShard<M> adds a typed forward.
class FullyShardBase {
 public:
  FullyShardBase(std::shared_ptr<torch::nn::Module> model, const World& world,
                 const FullyShardOptions& options);
  ~FullyShardBase();
  FullyShardBase(const FullyShardBase&) = delete;
  FullyShardBase& operator=(const FullyShardBase&) = delete;

  // The fp32 master shards, one per unit (root unit first): the optimizer's parameters.
  // After backward each has its shard of the averaged gradient in .grad().
  std::vector<at::Tensor> shards() const;

  // One entry per shard, in the order of shards(): where its parameters sit.
  std::vector<ShardLayout> layout() const;
  // Changes whenever layout() does (NoShard and ShardOptimizerState lay their buckets out
  // again in the first backward).
  std::int64_t layout_version() const;
  // Which parameters of shard i (in layout() order) got a gradient since the gradients
  // were last cleared (zero_grad, a failed backward, a step in backward), as of the last
  // synced backward: on any rank with find_unused_parameters, else on this rank. Empty when every one did.
  // Optimizers step only those (Note [Parameters without gradients] in sharding/gradients.cpp).
  const std::vector<char>& params_with_grad(std::size_t shard) const;
  // Optimizers over shards call it after stepping each segment of shard i, in order
  // (ShardOptimizerState then gathers that bucket while the next ones step).
  void segment_stepped(std::size_t shard, std::size_t segment);
  // Optimizers over shards call it before stepping shard i: the shard's bf16 copy, made
  // current, for the step to write as it writes the master (an undefined tensor when the
  // shard has none; FullyShardOptions::offload_bf16_copy). After each run they write, they
  // bump the master's version and call bf16_copy_written(i).
  at::Tensor bf16_copy_for_step(std::size_t shard);
  void bf16_copy_written(std::size_t shard);
  // Returns once no copy to the device still reads the master shards on the host (CPU
  // offload on a GPU: a gather outside backward, by an evaluation forward or
  // summon_full_params, copies from them without blocking the host). Optimizers over
  // shards and checkpoint loads call it before they write the masters; so should anything
  // else that writes shards() in place (Note [Copies beside compute]).
  void wait_for_shard_reads();

  // Scales every shard gradient so that the global norm over all ranks is at most
  // max_norm; returns the norm before clipping (torch.nn.utils.clip_grad_norm_'s rule;
  // norm_type 2 is the Euclidean norm, INFINITY the largest magnitude, any p > 0 the
  // p-norm). A collective: every rank calls it, after the backward that reduces (not
  // between backwards under no_sync(): InvalidArgument).
  double clip_grad_norm(double max_norm, double norm_type = 2.0);

  // While the guard lives, backward accumulates unsharded gradients locally and
  // communicates nothing; the first backward after it ends reduces the sum. Guards nest:
  // syncing resumes when the outermost ends.
  class NoSync {
   public:
    explicit NoSync(FullyShardBase& owner);
    ~NoSync();
    NoSync(const NoSync&) = delete;  // each guard ends syncing's pause once
    NoSync& operator=(const NoSync&) = delete;

   private:
    FullyShardBase& owner_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // Zeroes (drops) the shard gradients; abandons a backward that failed midway (Note [A
  // backward that failed] in sharding/gradients.cpp).
  void zero_grad();
  // A backward failed midway and has not been abandoned yet: its gradients are partial, and
  // the optimizers refuse to step them.
  bool backward_failed() const;

  // Steps `optimizer` (made over shards()) inside backward: each unit's shard steps as
  // soon as its gradient shard is reduced, and that gradient is freed at once, so the
  // fp32 gradients of all units never exist together (for a model whose states are most
  // of its memory: about 4 bytes per parameter less at the peak, divided by the ranks).
  // backward() then does the optimizer's work; optimizer.step() after it finds no
  // gradient and does nothing. Not with clip_grad_norm (it throws), with nonfinite_grads
  // other than Ignore, with find_unused_parameters on more than one rank, or under NoShard
  // and ShardOptimizerState (refused here). Gradient accumulation works:
  // the step happens in the backward that reduces. nullptr turns it off.
  void step_in_backward(optim::ShardOptimizer* optimizer);
  // NoShard and ShardOptimizerState: `hook` reduces each gradient bucket instead of the
  // plain average (comm_hooks.h; nullptr: the plain average again). A collective: every
  // rank registers the same hook with the same settings (checked), between steps.
  void register_comm_hook(std::shared_ptr<CommHook> hook);
  const std::shared_ptr<CommHook>& comm_hook() const;
  // Synced backwards so far (GradBucket::step); load_sharded restores the saved count (and
  // under staleness drops the averages still waiting: a resumed run starts its delay over).
  std::int64_t synced_backwards() const;
  void restore_synced_backwards(std::int64_t count);
  bool steps_in_backward() const;  // an optimizer is registered by step_in_backward

  // While the guard lives, every unit is gathered: the module's parameters hold the
  // full current weights (for evaluation or comparison). A collective.
  class FullParams {
   public:
    explicit FullParams(FullyShardBase& owner);
    ~FullParams();

   private:
    FullyShardBase& owner_;
  };
  FullParams summon_full_params() { return FullParams(*this); }

  ShardMemory memory() const;
  // One line of this rank's figures: shards, unsharded buffers (now and peak), the
  // optimizer's state when given (ShardOptimizer::state_bytes()), and the counting
  // allocator's current and peak when installed (memory.h).
  std::string memory_report(std::int64_t optimizer_state_bytes = -1) const;
  // The most units (besides the root) gathered at once since the last reset.
  int peak_gathered_units() const;
  void reset_peaks();

  // Note [Communication wait] (docs/fully-shard.md#communication-wait): how long this
  // rank's compute stalled waiting for the engine's collectives (gathers, reductions, the
  // optimizer's gathers and norms), over all of its communicators, since the last reset.
  // Off until turned on; on CUDA, reading it blocks the host until the timed waits have
  // passed on the GPU.
  void time_communication_waits(bool on);
  CommunicationWait communication_wait();
  void reset_communication_wait();
  // Note [Waiting for peers] (docs/fully-shard.md#waiting-for-peers): communication_wait()
  // split into the wait for the slowest rank to reach each collective and the wait for the
  // collective itself. A collective call on every rank; CPU ranks on one host only.
  PeerWait communication_wait_for_peers();

  // Steps whose gradients were dropped for NaN/Inf (NonFiniteGrads::Skip).
  std::int64_t skipped_steps() const;
  NonFiniteGrads nonfinite_grads() const;  // FullyShardOptions::nonfinite_grads
  int num_units() const;                   // including the root unit
  // Bytes of the largest non-root unit's gathered flat buffer, and of the root unit's.
  std::int64_t largest_unit_bytes() const;
  std::int64_t root_unit_bytes() const;
  // A communicator over every rank (checkpoints, loss averaging, your own collectives).
  Communicator& comm();
  // Bytes this rank has sent over all of the engine's communicators: comm()'s, and under
  // HybridShard its shard group's and replica set's (Communicator::bytes_sent).
  std::uint64_t bytes_sent() const;
  const World& world() const { return world_; }
  ShardGroup shard_group() const;
  Strategy strategy() const;
  // The dtype gathered parameters compute in (MixedPrecision::param, or the model's).
  at::ScalarType param_dtype() const;
  // NoShard and ShardOptimizerState: the parameter names of each bucket, in bucket order.
  std::vector<std::vector<std::string>> bucket_layout() const;
  // NoShard and ShardOptimizerState: the parameter order of the buckets after the first
  // backward's rebuild (empty before it), and setting it before any backward (a run
  // resumed from a checkpoint then reduces in the same buckets as the run that saved it).
  std::vector<std::string> bucket_order() const;
  void restore_bucket_order(const std::vector<std::string>& names);
  torch::nn::Module& root_module();

 protected:
  void root_pre_forward();
  // Casts the outputs to MixedPrecision::output, when set.
  std::vector<at::Tensor> root_post_forward(std::vector<at::Tensor> outputs);
  // MixedPrecision::param under cast_forward_inputs; nullopt: no cast.
  std::optional<at::ScalarType> input_dtype() const;

 private:
  World world_;
  std::unique_ptr<sharding::Engine> engine_;
};

template <typename ModelHolder>
class FullyShard : public FullyShardBase {
 public:
  FullyShard(ModelHolder model, const World& world, const FullyShardOptions& options = {})
      : FullyShardBase(model.ptr(), world, options), model_(std::move(model)) {}

  // The model's forward, with the root unit gathered around it.
  // Under mixed precision its floating-point arguments are cast to the param dtype first,
  // and its outputs to MixedPrecision::output after (MixedPrecision::cast_forward_inputs).
  template <typename... Args>
  auto forward(Args&&... args) {
    root_pre_forward();
    auto out = detail::call_with_inputs_prepared(
        detail::InputPrep{input_dtype()},
        [this](auto&&... a) { return model_->forward(std::forward<decltype(a)>(a)...); },
        std::forward<Args>(args)...);
    auto wrapped = root_post_forward(detail::tensors_of(out));
    return detail::rebuild(out, wrapped);
  }

  ModelHolder& module() { return model_; }

 private:
  ModelHolder model_;
};

}  // namespace flatshard
