// Sharded training against a single-process reference on the same global batch.
#pragma once

#include <functional>
#include <map>
#include <string>

#include <torch/torch.h>

#include "flatshard/flatshard.h"

namespace flatshard::testing {

// SGD: momentum 0.9, Nesterov, weight decay. PlainSGD: lr 0.1 and nothing else, so a
// step moves each weight by exactly lr times its gradient: a wrong averaging divisor or a
// clipping norm over the wrong ranks changes the weights in proportion (Adam and AdamW
// are blind to a uniform gradient scale).
enum class OptKind { SGD, PlainSGD, Adam, AdamW };

// Note [Comparing weights] in test_fully_shard.cpp: fp32 training matches single-process
// training to this relative difference per parameter tensor.
constexpr double kFp32Tolerance = 1e-5;
// Note [bf16 tolerance] in test_fully_shard.cpp: bf16 compute with fp32 masters against
// fp32 training. The parameters (rounded to bf16) and the loss, relative over the whole
// model (global_rel_weight_diff, max_rel_loss_diff):
constexpr double kBf16Tolerance = 5e-3;
// The fp32 masters, relative over the whole model (global_rel_master_diff): plain SGD moves
// each master by lr times a gradient that bf16 rounded; Adam-type steps turn that rounding
// into sign flips of lr-sized moves on small-gradient elements.
inline double bf16_master_tolerance(OptKind k) { return k == OptKind::PlainSGD ? 5e-5 : 1e-3; }
const char* to_string(OptKind k);

struct Batch {
  at::Tensor input, target;
};

struct TrainSpec {
  Strategy strategy = Strategy::FullShard;
  int shard_group_size = 0;  // FullyShardOptions::shard_group_size (HybridShard)
  // NoShard and ShardOptimizerState: FullyShardOptions' buckets and unused parameters
  // (small buckets by default, so that every model spans several).
  std::int64_t first_bucket_bytes = 2 << 10;
  std::int64_t bucket_bytes = 16 << 10;
  bool find_unused_parameters = false;
  OptKind optimizer = OptKind::SGD;
  // Parameter groups on both sides: no weight decay for biases, norms and embeddings, and
  // twice the learning rate for the last layer (training_impl.h).
  bool param_groups = false;
  int steps = 10;
  int global_batch = 12;
  int micro_batches = 1;  // gradient accumulation: micro-batches per step
  // Accumulation without no_sync on the sharded side: every micro-batch's backward reduces
  // its gradients and adds them to the last one's.
  bool reduce_every_micro_batch = false;
  // Every micro-batch's forward runs on the sharded side before the first backward (their
  // graphs held together, as a pipeline's schedule holds them); then the backwards, in order.
  bool forwards_first = false;
  double clip = 0;              // > 0: clip the global gradient norm to this
  double clip_norm_type = 2.0;  // ... this norm (clip_grad_norm_'s norm_type)
  std::optional<at::ScalarType> param_dtype;
  std::optional<at::ScalarType> reduce_dtype;
  std::optional<at::ScalarType> output_dtype;  // MixedPrecision::output
  int prefetch = 1;
  // Where both models train (the batches are moved there), and the transport of the
  // sharded side's collectives.
  c10::Device device{c10::kCPU};
  Transport transport = Transport::Auto;
  // The sharded model is built on the host and FullyShardOptions::device names
  // spec.device (instead of moving the model there before wrapping it).
  bool build_on_host = false;
  // The sharded model is built inside a BuildIntoShards scope (on the host, with
  // FullyShardOptions::device naming spec.device).
  bool build_into_shards = false;
  bool cpu_offload = false;  // FullyShardOptions::cpu_offload
  bool recompute = false;    // every unit of the distributed model recomputes its activations
  // The sharded side's optimizer steps inside backward (FullyShardBase::step_in_backward);
  // it still calls step() after backward, which then finds no gradient.
  bool step_in_backward = false;
  // FullyShardOptions::staleness; the reference then applies each step's gradients
  // `staleness` steps late (and does not step in the first `staleness` steps).
  int staleness = 0;
  std::shared_ptr<CommHook> hook;  // registered on the sharded side when set
  // Parameters whose name it accepts are frozen (requires_grad off) on both sides before
  // the sharded side is wrapped (fine-tuning with a frozen embedding or backbone).
  std::function<bool(const std::string&)> frozen;
  // After steps / 2 steps the sharded side saves a sharded checkpoint, and a new sharded
  // side made by *resume_as (another strategy, offload, precision...) loads it and trains
  // the remaining steps. Whatever the reference sees (optimizer, groups, clipping, batches,
  // micro-batches, frozen parameters) must be this spec's; staleness must be 0.
  std::shared_ptr<TrainSpec> resume_as;
  // Called before each step with the reference and the sharded model (e.g. to make a
  // unit go unused in that step).
  std::function<void(int step, torch::nn::Module& reference, torch::nn::Module& sharded)> before_step;
};

struct TrainResult {
  // Max over parameter tensors of ||w - w_ref|| / ||w_ref|| (2-norms).
  double max_rel_weight_diff = 0;
  std::string worst_param;
  // ||all w - all w_ref|| / ||all w_ref|| over the whole model.
  double global_rel_weight_diff = 0;
  // ||all m - all w_ref|| / ||all w_ref|| over the fp32 master values (the optimizer's,
  // before rounding to a compute dtype such as bf16): under mixed precision the tight
  // comparison, where the parameters' own rounding (2^-9 relative in bf16) sets a floor
  // on global_rel_weight_diff.
  double global_rel_master_diff = 0;
  // Max over parameter tensors of max|w - w_ref| / max|w_ref| (element-wise).
  double max_elementwise_diff = 0;
  double max_rel_loss_diff = 0;
  double max_grad_norm = 0;  // largest norm clip_grad_norm returned
  // What the backwards sent, one entry per wrapper trained (two with resume_as: the spec's,
  // then resume_as's).
  struct Backwards {
    // Bytes the wrapper sent during each backward (FullyShardBase::bytes_sent): the most any
    // backward under no_sync sent (no reduction: 0, but FullShard's re-gathers), how many
    // such backwards ran, and the least any other backward sent (-1: none ran).
    std::int64_t no_sync_bytes = 0;
    int no_sync_count = 0;
    std::int64_t synced_bytes = -1;
    // The least MemoryStats::unsharded_grad_bytes after a backward under no_sync (-1: none).
    std::int64_t no_sync_unsharded_grad_bytes = -1;
  };
  std::vector<Backwards> backwards;
  int peak_gathered_units = 0;
  std::int64_t peak_unsharded_param_bytes = 0;
  std::int64_t largest_unit_bytes = 0;  // the largest non-root unit's flat buffer
  std::int64_t root_unit_bytes = 0;
  // The distributed model's parameters after training (host copies, by name).
  std::map<std::string, at::Tensor> weights;
  c10::Device shard_device{c10::kCPU};  // where FullyShard's master shards live
  bool shards_pinned = false;
};

// Gradient accumulation under no_sync: at least one backward ran under it, and none sent a
// reduction. Strategies that free the parameters after forward (FullShard, HybridShard)
// gather them again in backward, so theirs sent less than any synced backward; the others'
// sent nothing. Over one rank nothing is sent at all, so only the count is checked there.
void expect_no_sync_sends_no_reduction(const TrainResult& r, const TrainSpec& spec, int world_size);

// make(): builds the model (same seed -> same weights each call);
// batch(step): the global batch of a step; loss(output, target).
template <typename Holder>
TrainResult train_and_compare(const World& world, const std::function<Holder()>& make,
                              const std::function<Batch(int)>& batch,
                              const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss,
                              const TrainSpec& spec);

}  // namespace flatshard::testing

#include "tests/support/training_impl.h"
