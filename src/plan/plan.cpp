// The planner's arithmetic (no LibTorch: flatshard-plan links only this).
#include "flatshard/plan.h"

#include <algorithm>

#include <fmt/format.h>

#include "flatshard/shard.h"

namespace flatshard::plan {
namespace {

// A unit's flat buffer: padded to a multiple of the world size and 16 bytes per shard.
std::int64_t padded(std::int64_t numel, int world, int elem) {
  return padded_numel(numel, world, std::max(1, 16 / elem));
}

double mib(std::int64_t b) { return static_cast<double>(b) / (1 << 20); }

}  // namespace

std::int64_t ModelShape::total() const {
  std::int64_t t = root_numel;
  for (auto n : unit_numels) t += n;
  return t;
}

std::int64_t ModelShape::frozen() const {
  std::int64_t t = root_frozen;
  for (auto n : unit_frozen) t += n;
  return t;
}

ModelShape uniform_shape(std::int64_t params, int units, double frozen_fraction) {
  ModelShape s;
  const int u = std::max(units, 1);
  for (int i = 0; i < u; ++i) s.unit_numels.push_back(shard_range(params, u, i).numel);
  s.largest_param_numel = s.unit_numels.front();
  if (frozen_fraction > 0) {
    for (auto n : s.unit_numels)
      s.unit_frozen.push_back(static_cast<std::int64_t>(frozen_fraction * static_cast<double>(n)));
  }
  return s;
}

// Note [Where the peak is]
// Model states live throughout; the rest peaks at the start of backward, when every
// activation is still alive and the first gradients arrive (measured with the counting
// allocator; docs/memory-model.md):
// - FullyShard (both strategies): fp32 master shards and optimizer state; gradient
//   shards are dropped by zero_grad and come back only as units finish backward, after
//   the peak (unless the model's states outweigh its activations: then the end of
//   backward, with every gradient shard, is the peak; Note [Late in backward]). Gathered: the root unit and,
//   under full shard, the last unit with `prefetch` units gathered ahead for backward; under shard-grad-op
//   every unit. The root unit's unsharded gradient (the output layer's comes first) lives through backward.
// - DDP and ZeRO-1 (NoShard, ShardOptimizerState): the replicated flat buffer and the
//   buckets' gradients (allocated when backward begins), fp32 masters (DDP: under mixed
//   precision, whole; ZeRO-1: this rank's slices), the optimizer state (whole or 1/N).
// With recomputation the activations alive at the start of backward are the units'
// inputs only, and the sharded modes peak inside a unit's recomputed backward instead:
// there the unit's unsharded gradient and the previous unit's, still being
// reduce-scattered, are alive besides the root's (measured: leaving them out
// under-predicts the full-shard peak by 11-17%).
Plan predict(const ModelShape& shape, const PlanOptions& o) {
  Plan p;
  // HybridShard: full shard within its group.
  const Strategy mode = o.strategy == Strategy::HybridShard ? Strategy::FullShard : o.strategy;
  const int world = std::max(o.world_size, 1);
  const bool sharded_mode = mode == Strategy::ShardGradOp || mode == Strategy::FullShard;
  // The ranks one copy of the model is sharded over (hybrid: a shard group).
  const int n = sharded_mode && o.shard_group_size > 0 ? std::min(o.shard_group_size, world) : world;
  const int e = o.param_bytes;
  const std::int64_t psi = shape.total();
  // Frozen parameters get no gradient and no optimizer state, and the sharded modes keep
  // them in a group of their own within their unit (Note [Partly frozen units] in
  // sharding/engine.cpp; Note [Frozen parameters in the replicated strategies]).
  const std::int64_t trained = psi - shape.frozen();
  const std::int64_t k = o.optimizer_state_bytes;
  p.activations = o.activation_bytes;
  // Note [The bf16 copy of an offloaded master] (sharding/flat_param.cpp).
  const bool bf16_copy = o.cpu_offload && o.offload_bf16_copy && e == 2;
  // Note [The device peak in the loss's backward]
  // On a GPU, without recomputation, the peak falls in the loss's backward: the logits'
  // gradient and the output layer's weight gradient exist beside every saved activation,
  // and the activation measure (a plain model's forward and backward) counts them both.
  // No unit is gathered for backward yet, and under mixed precision no gradient bucket of
  // DDP's or ZeRO-1's has been filled: they come once the loss's temporaries are gone.
  // Measured on an H100 (tests/cuda/test_cuda.cpp, a bf16 GPT, every mode, with and
  // without offload): what the device holds at that peak is the forward's end plus the
  // plain model's rise in backward, to the MiB. Counting the gathered units, the root's
  // gradient and the buckets' gradients beside the activations over-predicted the
  // offloaded peaks by 27-59%.
  const bool peak_in_loss = !o.cpu_compute && !o.recompute;
  // Note [Late in backward]
  // With recomputation the activations alive at the start of backward are small, and the
  // sharded modes may peak late in backward instead: the gradient shards of the units
  // done so far exist, the loss's temporaries are gone, and the inputs of the units not
  // yet done and one unit's recomputed internals remain (about half of the measured
  // activations). Measured: a proof run with plain SGD at world 4 (mostly shards)
  // peaks there; leaving the gradient shards out under-predicts it by 32%.
  std::int64_t late_backward = 0, shards_bytes = 0, late_grads = 0, late_activations = 0, late_gathered = -1,
               late_pool = 0, late_gathered_grads = 0, early_masters = 0;
  switch (mode) {
    case Strategy::NoShard:
    case Strategy::ShardOptimizerState: {
      p.params = psi * e;
      // Under mixed precision each bucket's gradient exists from its first gradient to its
      // reduction into the masters' (Note [The device peak in the loss's backward]).
      p.grads = e != 4 && peak_in_loss ? 0 : trained * e;
      // fp32 masters and their gradients
      if (mode == Strategy::NoShard && e != 4) p.masters = psi * 4 + trained * 4;
      // ZeRO-1: this rank's fp32 slices of the masters (on the CPU in fp32 their reduced
      // gradient slices come after the peak, as the buckets' gradients are freed; on a GPU
      // under mixed precision they exist at its peak, as DDP's do); on one rank in fp32
      // the masters are the parameters themselves.
      if (mode == Strategy::ShardOptimizerState && (n > 1 || e != 4)) p.masters = (psi * 4 + n - 1) / n;
      // The masters at construction and when the buckets are laid out again (the end of the
      // first backward, every bucket's gradient alive), before ZeRO-1's reduced slices exist.
      early_masters = p.masters;
      if (mode == Strategy::ShardOptimizerState && e != 4 && !o.cpu_compute)
        p.masters += (trained * 4 + n - 1) / n;
      p.optimizer_state = mode == Strategy::NoShard ? trained * k : (trained * k + n - 1) / n;
      if (o.cpu_offload) {
        // Note [Offloaded buckets]: the fp32 masters (the whole model, or this rank's
        // slices) and their gradients on the host, always apart from the parameters.
        auto share = [&](std::int64_t numel) {
          return mode == Strategy::NoShard ? numel : (numel + n - 1) / n;
        };
        const std::int64_t master = share(psi * 4), trained_master = share(trained * 4);
        p.host = master + trained_master + p.optimizer_state;  // the gradient from the first bucket on
        // ZeRO-1 lays its buckets out again from every rank's slices, gathered on the host
        // (under fp32 compute the parameters hold them, and nothing is gathered), before
        // the first step makes the bf16 copy.
        if (mode == Strategy::ShardOptimizerState && n > 1 && e != 4) p.host_rebuild = trained * 4 + p.host;
        if (bf16_copy) p.host += trained_master / 2;
        p.masters = 0;
        p.optimizer_state = 0;
        early_masters = 0;
      }
      break;
    }
    case Strategy::ShardGradOp:
    case Strategy::HybridShard:
    case Strategy::FullShard: {
      // Padded flat buffers of the declared units (a partly frozen unit's trained and
      // frozen groups, each padded), and of their trained groups.
      std::vector<std::int64_t> units, trained_units;
      auto group = [&](std::int64_t numel) { return numel > 0 ? padded(numel, n, e) : 0; };
      std::int64_t shards = 0, trained_shards = 0;
      const std::int64_t root_trained = group(shape.root_numel - shape.root_frozen);
      const std::int64_t root = root_trained + group(shape.root_frozen);
      shards += root / n;
      trained_shards += root_trained / n;
      for (std::size_t i = 0; i < shape.unit_numels.size(); ++i) {
        const std::int64_t frozen = shape.frozen_in_unit(i);
        trained_units.push_back(group(shape.unit_numels[i] - frozen));
        units.push_back(trained_units.back() + group(frozen));
        shards += units.back() / n;
        trained_shards += trained_units.back() / n;
      }
      p.params = shards * 4;  // fp32 masters
      p.optimizer_state = trained_shards * k;
      std::sort(units.rbegin(), units.rend());
      std::sort(trained_units.rbegin(), trained_units.rend());
      auto largest_of = [](const std::vector<std::int64_t>& sorted, int count) {
        std::int64_t s = 0;
        for (int i = 0; i < count && i < static_cast<int>(sorted.size()); ++i) s += sorted[i];
        return s;
      };
      auto largest = [&](int count) { return largest_of(units, count); };
      auto largest_trained = [&](int count) { return largest_of(trained_units, count); };
      std::int64_t all_units = 0, all_trained = 0;
      for (auto u : units) all_units += u;
      for (auto u : trained_units) all_trained += u;
      // Note [Reductions in one order] (sharding/engine.cpp): with find_unused_parameters
      // above one rank every unit is reduced when backward ends, so the units' unsharded
      // gradients (and the root's) are all alive then, beside the gathered root (under
      // shard-grad-op every unit) and the masters and optimizer state; as the reductions
      // go, each unit's unsharded gradient gives way to its shard, a tenth of it or less.
      // On the CPU each unit's gradient takes a block the pool kept (the buffer the unit
      // before it freed), so the pool holds one block then, not two (measured at worlds 2
      // and 4: counting two over-predicts full shard's peak at world 4 by 11%).
      const auto held_to_the_end = [&] {
        if (!o.find_unused_parameters || world == 1) return;
        const std::int64_t gathered = (root + (mode == Strategy::ShardGradOp ? all_units : 0)) * e;
        const std::int64_t grads = (root_trained + all_trained) * e;
        const std::int64_t pool = late_pool / 2;
        const std::int64_t at_end = p.params + p.optimizer_state + p.staging + gathered + grads + pool;
        if (at_end <= late_backward) return;
        late_backward = at_end;
        late_grads = 0;
        late_activations = 0;
        late_gathered = gathered;
        late_gathered_grads = grads;
        late_pool = pool;
      };
      // Note [The device peak in the loss's backward]: on a GPU only the root (and under
      // shard-grad-op every unit, gathered since forward) is gathered at the peak.
      const std::int64_t gathered_units = mode == Strategy::ShardGradOp ? all_units
                                          : peak_in_loss                ? 0
                                                                        : largest(1 + o.prefetch);
      p.gathered_params = (root + gathered_units) * e;
      p.gathered_grads = peak_in_loss ? 0 : (root_trained + (o.recompute ? largest_trained(2) : 0)) * e;
      shards_bytes = shards * 4;
      if (o.cpu_offload) {
        // Note [Offloaded gradients]: masters, gradient shards and optimizer state on the
        // host; on the device, a unit's fp32 shard crossing to be converted for its gather,
        // or its reduced shard on its way back. The bf16 copies cross straight into the
        // gathered buffer (sharding/flat_param.cpp, copy_master_to_slot): nothing is staged
        // but in the first step's gathers, before the first step makes the copies, which
        // fall where the activations are few (measured on an H100: 1 MiB more in the
        // first step's backward than in the next ones').
        p.host = shards * 4 + trained_shards * (bf16_copy ? 6 + k : 4 + k);
        p.params = 0;
        p.optimizer_state = 0;
        // fp32 compute copies straight from the host's shard and reduces into fp32.
        if (e != 4 && !bf16_copy) p.staging = (units.empty() ? root : std::max(root, units.front())) / n * 4;
        p.late_host_grads = trained_shards * 4;
        held_to_the_end();
        break;
      }
      // Stepping in backward, a gradient shard lives from its reduction to its unit's
      // step: at most the root's and one unit's exist together.
      late_grads = o.step_in_backward ? (root_trained + largest_trained(1)) / n * 4 : trained_shards * 4;
      // On the CPU the pool keeps up to two freed buffers of the largest size at the end of
      // backward (measured: a states-heavy run at worlds 1 and 2 peaks 12-15% above the
      // rest without them). Recomputing, the peak inside a unit's backward already counts
      // the buffers the pool serves there.
      if (o.cpu_compute && !o.recompute) late_pool = 2 * std::max(root, largest(1)) * e;
      if (o.recompute) {
        late_backward = p.params + p.optimizer_state + late_grads + p.gathered_params + p.gathered_grads +
                        p.activations / 2;
        late_activations = p.activations / 2;
      } else {
        // The end of backward: every gradient shard exists, the activations are gone, the
        // root and the first unit are still gathered (shard-grad-op: every unit). Where
        // the model's states outweigh its activations, this is the peak (measured on an
        // H100: a 5.5B GPT needs its 16 bytes per parameter).
        // Above one rank the root's unsharded gradient (the embeddings', last to finish)
        // lives until its reduce-scatter is done; on one rank it is its own average.
        late_gathered = (root + (mode == Strategy::ShardGradOp ? all_units : largest(1))) * e;
        late_gathered_grads = n > 1 ? root_trained * e : 0;
        late_backward =
            p.params + p.optimizer_state + late_grads + late_gathered + late_gathered_grads + late_pool;
      }
      held_to_the_end();
      break;
    }
  }
  // Note [Construction]
  // Measured from before the model is built (tests/multirank/test_plan.cpp):
  // - FullyShard, model built whole: every parameter in fp32 before the wrapper takes it
  //   over (it frees each unit as the unit's shard is copied out).
  // - FullyShard, built into shards: the fp32 shards, the root unit's parameters and the
  //   unit being built (at worst the largest) at full size.
  // - DDP and ZeRO-1 (NoShard, ShardOptimizerState): the whole model, then its copy into
  //   the persistent flat buffer and the masters; after the first backward the buckets
  //   are laid out again in arrival order, old and new buffers alive together.
  // - Built on the host and placed by options.device (a GPU run; always under offload):
  //   the device receives only what it keeps, and the host holds the model as built.
  const bool sharded = mode == Strategy::ShardGradOp || mode == Strategy::FullShard;
  const std::int64_t largest_unit =
      shape.unit_numels.empty() ? 0 : *std::max_element(shape.unit_numels.begin(), shape.unit_numels.end());
  // DDP's masters exist at construction; their gradients come with the first bucket.
  const std::int64_t built_masters =
      mode == Strategy::NoShard && e != 4 && !o.cpu_offload ? psi * 4 : early_masters;
  if (!sharded) {
    // One buffer at a time is laid out again, its old and new copies side by side (the
    // parameters' is the largest); ZeRO-1's master slices are cut from every rank's
    // masters, gathered in fp32 under mixed precision (bucket by bucket under offload).
    // The frozen parameters' group is not laid out again.
    p.rebuild = p.params + 2 * trained * e + early_masters;
    if (mode == Strategy::ShardOptimizerState && e != 4 && !o.cpu_offload) p.rebuild += trained * 4;
  }
  if (o.build_on_host || o.cpu_offload) {
    // Built on the host and placed by options.device: each unit's fp32 shard is copied
    // from the host's parameters straight to the device (under offload, to host memory),
    // and DDP and ZeRO-1 fill their flat buffer and masters there, one parameter crossing
    // at a time for rank 0's broadcast (above one rank). The device never holds the whole
    // model.
    p.construction =
        sharded ? p.params : p.params + built_masters + (n > 1 ? shape.largest_param_numel * 4 : 0);
    // The host holds the model as built (built into shards: the root and one unit), and
    // under offload the masters cut from it as each unit (or bucket) is taken over: a
    // unit's parameters are freed only once it is on the device.
    const std::int64_t host_masters = !o.cpu_offload ? 0
                                      : sharded
                                          ? shards_bytes
                                          : (mode == Strategy::NoShard ? psi * 4 : (psi * 4 + n - 1) / n);
    p.host_construction =
        (sharded && o.build_into_shards ? (shape.root_numel + largest_unit) * 4 : psi * 4) + host_masters;
  } else if (sharded && o.build_into_shards) {
    p.construction = p.params + (shape.root_numel + largest_unit) * 4;
  } else if (sharded) {
    std::int64_t largest_shard = shape.root_numel > 0
                                     ? padded(shape.root_numel, n, e) / n
                                     : 0;  // a unit's shard is copied out before its parameters go
    for (auto u : shape.unit_numels) largest_shard = std::max(largest_shard, padded(u, n, e) / n);
    p.construction = psi * 4 + largest_shard * 4;
  } else {
    p.construction = psi * 4 + p.params + built_masters;
  }
  // Between steps the masters (p.params, or DDP's and ZeRO-1's p.params plus their masters)
  // and the optimizer state are what a rank holds; a load reads one piece at a time into
  // them, an export assembles one flat group (padded) at full size in fp32.
  {
    const std::int64_t held = p.params + p.masters + p.optimizer_state;
    const std::int64_t whole_group =
        sharded || mode == Strategy::HybridShard
            ? std::max(padded(shape.root_numel, n, 4), largest_unit == 0 ? 0 : padded(largest_unit, n, 4)) * 4
            : psi * 4;
    p.load_whole = held + shape.largest_param_numel * 4;
    const std::int64_t trained_share = (shape.total() - shape.frozen() + n - 1) / n;
    const std::int64_t frozen_share = (shape.frozen() + n - 1) / n;
    p.async_save_host = (4 + o.optimizer_state_bytes) * trained_share + 4 * frozen_share;
    p.export_whole = held + whole_group;
  }
  p.peak = std::max({p.training(), p.construction, p.rebuild});
  // Note [Late in backward]: the training figures are those of training's own peak, also
  // where construction or a rebuild sets the whole run's.
  if (late_backward > p.training()) {
    p.grads = late_grads;
    p.activations = late_activations;
    p.pool = late_pool;
    if (late_gathered >= 0) {
      p.gathered_params = late_gathered;
      p.gathered_grads = late_gathered_grads;
    }
    p.peak = std::max(p.peak, late_backward);
  }
  switch (mode) {
    case Strategy::NoShard: p.zero_formula = (8 + k) * psi; break;
    case Strategy::ShardOptimizerState: p.zero_formula = 8 * psi + k * psi / n; break;
    case Strategy::ShardGradOp: p.zero_formula = 4 * psi + (4 + k) * psi / n; break;
    case Strategy::HybridShard:
    case Strategy::FullShard: p.zero_formula = (8 + k) * psi / n; break;
  }
  return p;
}

std::int64_t Plan::training() const {
  return params + masters + grads + optimizer_state + gathered_params + gathered_grads + activations +
         staging;
}

std::int64_t Plan::host_peak() const { return std::max({host, host_construction, host_rebuild}); }

std::int64_t largest_model(const PlanOptions& options, int units, std::int64_t device_bytes,
                           std::int64_t host_bytes, double frozen_fraction) {
  const int u = std::max(units, 1);
  auto fits = [&](std::int64_t params) {
    const Plan p = predict(uniform_shape(params, u, frozen_fraction), options);
    return p.peak <= device_bytes && (host_bytes <= 0 || p.host_peak() <= host_bytes);
  };
  // Every figure grows with the parameter count: bisect between a size that fits and one
  // that does not (at most 2^50 parameters).
  std::int64_t lo = 0, hi = u;
  if (!fits(hi)) return 0;
  while (hi < (std::int64_t{1} << 50) && fits(hi)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

std::string Plan::describe() const {
  const char* when = peak == training() + pool ? ""
                     : peak == construction    ? " while the model is built"
                                               : " while the buckets are rebuilt";
  return fmt::format(
             "peak {:.1f} MiB{}; in training params {:.1f} + masters {:.1f} + grads {:.1f} + optimizer state "
             "{:.1f} "
             "+ "
             "gathered params {:.1f} + gathered grads {:.1f} + activations {:.1f}{} = {:.1f}; construction "
             "{:.1f}{} "
             "(ZeRO "
             "formula {:.1f})",
             mib(peak), when, mib(params), mib(masters), mib(grads), mib(optimizer_state),
             mib(gathered_params), mib(gathered_grads), mib(activations),
             pool > 0 ? fmt::format(" + pool {:.1f}", mib(pool)) : "", mib(training() + pool),
             mib(construction), rebuild > 0 ? fmt::format("; bucket rebuild {:.1f}", mib(rebuild)) : "",
             mib(zero_formula)) +
         (host > 0
              ? fmt::format("; offloaded to the host {:.1f} MiB (host while built {:.1f}{}; device staging "
                            "{:.1f})",
                            mib(host), mib(host_construction),
                            host_rebuild > 0
                                ? fmt::format(", while the buckets are rebuilt {:.1f}", mib(host_rebuild))
                                : "",
                            mib(staging))
          : host_construction > 0 ? fmt::format("; host while built {:.1f} MiB", mib(host_construction))
                                  : "");
}

}  // namespace flatshard::plan
