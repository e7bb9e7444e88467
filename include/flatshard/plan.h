// The memory planner: per-rank peak memory of a training mode, predicted from the
// model's unit sizes (no training run needed).
//
//   auto shape = flatshard::plan::shape_of(*model);            // units as FullyShard sees them
//   flatshard::plan::PlanOptions o{.strategy = flatshard::Strategy::FullShard, .world_size = 4};
//   o.activation_bytes = ...;                                    // one rank's micro-batch
//   auto p = flatshard::plan::predict(shape, o);
//   std::puts(p.describe().c_str());
//
// The same figures come from the command line: flatshard-plan --help. The model of
// memory is written out in docs/memory-model.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flatshard/strategy.h"

namespace torch::nn {
class Module;
}

namespace flatshard::plan {

// Element counts: the root unit (parameters in no declared unit) and each declared unit,
// and the largest single parameter (DDP's optimizer step works per parameter).
// Of those, the elements of frozen parameters (requires_grad off: no gradient, no
// optimizer state; docs/fully-shard.md#frozen-parameters-fine-tuning), for the root and by
// unit (an empty unit_frozen: none).
struct ModelShape {
  std::int64_t root_numel = 0;
  std::vector<std::int64_t> unit_numels;
  std::int64_t largest_param_numel = 0;
  std::int64_t root_frozen = 0;
  std::vector<std::int64_t> unit_frozen;
  std::int64_t total() const;
  std::int64_t frozen() const;
  std::int64_t frozen_in_unit(std::size_t i) const { return i < unit_frozen.size() ? unit_frozen[i] : 0; }
};

// The units and sizes FullyShard would build for `model` (Unit<M> declarations).
ModelShape shape_of(torch::nn::Module& model);
// A model of `params` elements in `units` equal units (and no root unit), with
// `frozen_fraction` of each unit's elements frozen (a fine-tuning).
ModelShape uniform_shape(std::int64_t params, int units, double frozen_fraction = 0.0);

struct PlanOptions {
  // HybridShard is planned as FullShard within its group (shard_group_size).
  Strategy strategy = Strategy::FullShard;
  int world_size = 1;
  // Hybrid sharding: FullShard and ShardGradOp shard over groups of this many ranks and
  // replicate across them, so per-rank figures are those of a world of this size. 0: the
  // whole world.
  int shard_group_size = 0;
  // Bytes per element of the compute dtype (4: fp32, 2: bf16). Below 4, fp32 masters
  // are kept (FullyShard: sharded; DDP: replicated).
  int param_bytes = 4;
  // Optimizer state bytes per parameter: AdamW/Adam 8, SGD with momentum 4, SGD 0.
  int optimizer_state_bytes = 8;
  // Units gathered ahead (FullyShardOptions::prefetch).
  int prefetch = 1;
  // Activations and backward temporaries of one rank's micro-batch (measure once with
  // measure_activation_bytes, or estimate); added as they are.
  std::int64_t activation_bytes = 0;
  // Units recompute their activations (recompute.h); activation_bytes then measured with
  // recomputation on. Moves the sharded modes' peak into a unit's backward (see
  // Note [Where the peak is] in src/plan/plan.cpp).
  bool recompute = false;
  // The model is built into shards (build.h; sharded modes only) instead of whole before
  // wrapping. Decides the construction peak (Plan::construction).
  bool build_into_shards = false;
  // The model is built on the host and placed on the device by FullyShardOptions::device
  // (a GPU run whose model is made on the CPU), instead of made on, or moved whole to, the
  // device it trains on: the device then never holds the whole model (the sharded modes
  // receive each unit's shard, DDP and ZeRO-1 their flat buffer and masters), and the host
  // holds it while it is built (Plan::host_construction). Implied by cpu_offload. Leave it
  // off for training on the CPU, where the host is the device.
  bool build_on_host = false;
  // FullyShardOptions::cpu_offload: the fp32 masters (shards, or DDP's and ZeRO-1's
  // replicated masters and slices), their gradients and the optimizer state live in host
  // memory (Plan::host) instead of on the device; the device keeps the parameters, their
  // gradients, the staging copies and the activations.
  bool cpu_offload = false;
  // FullyShardOptions::offload_bf16_copy: under cpu_offload with a 2-byte compute dtype
  // (taken as bf16), the host also keeps the masters rounded to bf16 (2 bytes per master
  // element, in Plan::host).
  bool offload_bf16_copy = true;
  // FullyShardBase::step_in_backward (sharded modes): each unit's shard steps as soon as
  // its gradient shard is final, and that gradient is freed at once, so late in backward
  // only the shards in flight exist (the root's and one unit's) instead of every one.
  // Under offload the gradient shards are the host's, where each group keeps its
  // page-locked block for the next step: the figures do not change.
  bool step_in_backward = false;
  // FullyShardOptions::find_unused_parameters (sharded modes, above one rank): every unit is
  // reduced when backward ends (Note [Reductions in one order]), so every unit's unsharded
  // gradient is alive then.
  bool find_unused_parameters = false;
  // Training on the CPU (the compute device is the host; sharded modes): FullyShard keeps
  // freed gathered buffers and gradients in a pool (Note [Reused host buffers] in
  // sharding/flat_param.h), up to two of the largest, taken again before the start of
  // backward but still held where the peak falls late in backward (Plan::pool).
  bool cpu_compute = false;
};

// Per-rank bytes by kind, and the predicted peak.
struct Plan {
  std::int64_t params = 0;   // replicated parameters, or sharded fp32 masters
  std::int64_t masters = 0;  // replicated fp32 masters (DDP/ZeRO-1 under bf16)
  std::int64_t grads = 0;    // replicated gradients, or gradient shards
  std::int64_t optimizer_state = 0;
  std::int64_t gathered_params = 0;  // unsharded units alive at the peak
  std::int64_t gathered_grads = 0;   // unsharded unit gradients alive at the peak
  std::int64_t activations = 0;
  // While the model is built and wrapped: the whole model at full size (fp32), or, built
  // into shards, the fp32 shards with the root unit and the largest unit at full size.
  // DDP and ZeRO-1 copy the model's parameters into flat buckets when wrapping, so that the
  // whole model, the parameter buckets and the gradient buckets exist at once.
  std::int64_t construction = 0;
  // DDP and ZeRO-1 rebuild their buckets in arrival order after the first backward: old
  // and new parameter and gradient buckets exist at once.
  std::int64_t rebuild = 0;
  // Under cpu_offload: the host memory the offloaded states take in training (page-locked
  // on a GPU machine), which the figures above and `peak` leave out: the fp32 masters,
  // their gradients, the optimizer state and the masters' bf16 copies
  // (PlanOptions::offload_bf16_copy). 0 without offload.
  std::int64_t host = 0;
  // Built on the host (build_on_host, cpu_offload): the host memory while the model is
  // built and wrapped. Built whole, the model (4 bytes per parameter), beside the
  // offloaded masters cut from it under offload (the shards, DDP's whole master, ZeRO-1's
  // slices); built into shards, the root unit and the unit being built at full size (and
  // the offloaded fp32 shards). The host's peak is the larger of this and `host`. 0 when
  // the model is built on the device.
  std::int64_t host_construction = 0;
  // Under cpu_offload, ZeRO-1 above one rank with a compute dtype other than fp32: the
  // host while its buckets are laid out again after the first backward (every rank's
  // master slices gathered in fp32 on the host, beside the old and new slices and the
  // optimizer state). 0 otherwise.
  std::int64_t host_rebuild = 0;
  // The host's peak under offload: the largest of host, host_construction, host_rebuild.
  std::int64_t host_peak() const;
  // Of `host`: what exists only after the device's peak at the start of backward (the
  // sharded modes' gradient shards, made as units finish their backward; the replicated
  // modes' master gradient is made by the first bucket, at the peak).
  std::int64_t late_host_grads = 0;
  // Under cpu_offload, with a compute dtype other than fp32: device copies of offloaded
  // values on their way (an fp32 shard crossing to the device to be converted for its
  // gather, a reduced one converted to fp32 on its way back).
  std::int64_t staging = 0;
  // Under cpu_compute, where the peak falls late in backward: the pool's blocks then.
  std::int64_t pool = 0;
  // Loading a whole model (checkpoint::load_hf) or exporting one (save_hf, full_state_dict)
  // between steps: the fp32 masters and optimizer state as in training, and beside them,
  // loading, nothing but the piece being read (at most one parameter's slice); exporting,
  // one flat group at full size in fp32 (Note [Streaming full state dicts]): the largest
  // unit's or the root's (the replicated strategies: the model, one flat group).
  std::int64_t load_whole = 0, export_whole = 0;
  // checkpoint::AsyncSaver's host copy: this rank's share of the fp32 masters and of the
  // optimizer state (every strategy writes (4 + K)Ψ/N per rank), alive from one save to the
  // next, in host memory.
  std::int64_t async_save_host = 0;
  std::int64_t training() const;  // the sum of the device figures above `construction`
  std::int64_t peak = 0;          // what one rank needs: the largest of training(), construction, rebuild
  // The ZeRO paper's model-state formula for this mode (fp32 params and grads, K bytes
  // of optimizer state per parameter): DDP (8+K)Ψ, ZeRO-1 8Ψ+KΨ/N, ZeRO-2 4Ψ+(4+K)Ψ/N,
  // full shard (8+K)Ψ/N.
  std::int64_t zero_formula = 0;
  std::string describe() const;
};

Plan predict(const ModelShape& shape, const PlanOptions& options);

// The largest model of `units` equal units (uniform_shape, `frozen_fraction` of each
// frozen) whose predicted peak fits `device_bytes` per rank, and whose host memory
// (Plan::host_peak) fits `host_bytes` per rank when the model is built on the host
// (options.build_on_host or cpu_offload; 0: the host is not limited), with options' other
// settings (the activations as given). 0 when not even one parameter per unit fits.
std::int64_t largest_model(const PlanOptions& options, int units, std::int64_t device_bytes,
                           std::int64_t host_bytes = 0, double frozen_fraction = 0.0);

}  // namespace flatshard::plan
