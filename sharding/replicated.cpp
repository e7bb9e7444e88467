// The replicated strategies, NoShard (DDP) and ShardOptimizerState (ZeRO-1): one
// persistent flat group cut into buckets, reduced as they fill, laid out again after the
// first backward, refreshed from the master shard before forward (Note [Replicated
// strategies]). The other ways a bucket can be averaged (staleness, communication hooks,
// decentralized training) are in averaging.cpp.
#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "flatshard/errors.h"
#include "sharding/buckets.h"
#include "sharding/engine_parts.h"
#include "src/errors.h"
#include "src/io/shard_files.h"
#include "src/logging.h"

namespace flatshard::sharding {

at::Tensor detail::gather_master_values(FlatParamGroup& g, Communicator& comm) {
  if (g.world_size() == 1) return g.master().detach();
  const c10::Device device = comm.device();
  at::Tensor values = at::empty({g.padded_numel()}, g.master().options());
  for (int k = 0; k < static_cast<int>(g.segments().size()); ++k) {
    const at::Tensor part = g.master_part(g.master(), k).to(device);
    at::Tensor out = g.segment_of(values, k);
    at::Tensor gathered = out.device() == device ? out : at::empty({out.numel()}, part.options());
    comm.all_gather(gathered, part).wait();
    if (!gathered.is_same(out)) out.copy_(gathered);
  }
  return values;
}

using detail::AccumulatedHook;
using detail::fold_strays;

// Note [Replicated strategies]
// NoShard (DDP) and ShardOptimizerState (ZeRO-1) are the engine's strategies whose
// parameters stay gathered: the whole model is one persistent group (no unit is
// gathered or freed), cut into segments that are DDP's buckets: the first up to
// first_bucket_bytes, the rest up to bucket_bytes, in reverse registration order. Every
// rank starts from rank 0's values. A bucket's gradient is reduced as soon as all its
// parameters' gradients have arrived, in bucket order on every rank, one reduction in
// flight (Note [One reduce-scatter in flight]): by all-reduce under NoShard (each rank is
// a shard group of one), by reduce-scatter under ShardOptimizerState (each rank receives
// its slice of the bucket, which is its part of the master shard). The first synced
// backward records the order gradients arrive in, reduces nothing until it ends, and
// then lays the group out again in rank 0's arrival order (DDP's rebuild). After a synced
// backward the optimizer steps the master shard; before the next forward (or
// summon_full_params) the parameters are refreshed from it: copied, and under
// ShardOptimizerState all-gathered bucket by bucket. Without mixed precision, NoShard's
// master shard is the flat buffer and its gradient the flat gradient: nothing is copied.
void Engine::make_replicated_group(std::vector<std::pair<std::string, at::Tensor>> params,
                                   at::ScalarType compute, const FlatParamGroup::Placement& given,
                                   const std::unordered_map<const c10::TensorImpl*, int>& unit_of) {
  if (options_.first_bucket_bytes <= 0 || options_.bucket_bytes <= 0) {
    throw InvalidArgument(
        fmt::format("flatshard::FullyShard (rank {}/{}): bucket sizes must be positive, got "
                    "{} and {}",
                    rank_, world_size_, options_.first_bucket_bytes, options_.bucket_bytes));
  }
  if (world_size_ > 1) {
    // Every rank starts from rank 0's parameters and buffers (a model built on the host
    // crosses to the compute device for it).
    at::NoGradGuard no_grad;
    for (auto& [name, p] : params) {
      auto t = p.detach().to(device_);
      comm_->broadcast(t, 0).wait();
      if (t.data_ptr() != p.data_ptr()) p.detach().copy_(t);
    }
    for (auto& b : buffers_) comm_->broadcast(b, 0).wait();
  }
  auto frozen = detail::take_frozen(params);  // Note [Frozen parameters in the replicated strategies]
  // Reverse registration order: roughly the order backward produces gradients.
  std::reverse(params.begin(), params.end());
  for (const auto& [name, p] : params) {
    param_names_.push_back(name);
    param_bytes_.push_back(p.numel() * static_cast<std::int64_t>(c10::elementSize(compute)));
    const auto it = unit_of.find(p.unsafeGetTensorImpl());
    unit_of_param_.push_back(it == unit_of.end() ? 0 : it->second);
  }
  std::vector<int> ids(params.size());
  std::iota(ids.begin(), ids.end(), 0);
  const auto sizes = bucket_sizes(ids);
  FlatParamGroup::Placement placement = given;
  placement.persistent = true;
  auto unit = std::make_unique<Unit>();
  unit->name = "root";
  if (!params.empty()) {
    unit->group = std::make_shared<FlatParamGroup>("model", std::move(params), shard_.size, shard_.rank,
                                                   compute, placement, sizes);
    for (auto& slot : unit->group->slots()) {
      if (slot.accumulator)
        slot.accumulator->add_post_hook(std::make_unique<AccumulatedHook>(this, kRoot, slot.id));
    }
    unit->gathered = true;
    master_version_ = unit->group->master()._version();
  }
  units_.push_back(std::move(unit));
  if (!frozen.empty()) {
    auto part = std::make_unique<Unit>();
    part->name = "frozen";
    part->owner = kRoot;
    part->group = std::make_shared<FlatParamGroup>("model (frozen)", std::move(frozen), shard_.size,
                                                   shard_.rank, compute, placement);
    part->gathered = true;
    part->refreshed_version = part->group->master()._version();
    units_[kRoot]->frozen_part = static_cast<int>(units_.size());
    units_.push_back(std::move(part));
  }
  segment_of_param_.assign(param_names_.size(), 0);
  used_.assign(param_names_.size(), false);
  if (units_[kRoot]->group) {
    const auto& g = *units_[kRoot]->group;
    for (int k = 0; k < static_cast<int>(g.segments().size()); ++k) {
      for (int i = g.segments()[k].first_slot; i < g.segments()[k].end_slot; ++i)
        segment_of_param_[g.slots()[i].id] = k;
    }
    pending_.assign(g.segments().size(), 0);
  }
  log::at(log::Level::Info, "FullyShard ({}): {} parameters in {} buckets", to_string(options_.strategy),
          param_names_.size(), pending_.size());
}

std::vector<int> Engine::bucket_sizes(const std::vector<int>& ids) const {
  std::vector<int> sizes;
  for (const auto& bucket :
       assign_buckets(param_bytes_, ids, options_.first_bucket_bytes, options_.bucket_bytes))
    sizes.push_back(static_cast<int>(bucket.size()));
  return sizes;
}

void Engine::launch_ready_segments() {
  while (next_segment_ < static_cast<int>(pending_.size()) && pending_[next_segment_] == 0)
    reduce_segment(next_segment_++);
}

// Note [Queued bucket reductions]
// A bucket is reduced as soon as its gradients are in, in bucket order on every rank, on
// one stream of the communicator, which runs them one after another. When the gradients
// live in one persistent flat buffer (NoShard in fp32, as DDP's gradient_as_bucket_view),
// launching one never waits for the one before: the backward computes on while the
// buckets queue, and those already completed are finished each time another is launched.
// Otherwise each bucket's gradient buffer is allocated at its first gradient and freed
// when its reduction is finished, so the launch waits for the one before (one in flight):
// queuing would let the backward allocate the next buckets' buffers while reductions lag
// (measured: 10% more allocator peak under ShardOptimizerState at 2 ranks, no faster).
void Engine::reduce_segment(int s) {
  FlatParamGroup& g = *units_[kRoot]->group;
  // A hook may issue collectives when its bucket is finished (PowerSGD's second round):
  // on a GPU, where every rank must launch a device's collectives in one order (Note [One
  // launch order per device]), buckets are then finished in bucket order before each
  // launch, not whenever their events happen to have completed.
  const bool finish_in_order = comm_hook_ && device_.is_cuda();
  if (g.master_aliases_full() && !finish_in_order) {
    finish_completed_reduces();
  } else {
    finish_pending_reduce();
  }
  const FlatSegment& seg = g.segments()[s];
  g.allocate_segment_grad(s);  // a bucket no parameter got a gradient in reduces zeros
  fold_strays(g, seg.first_slot, seg.end_slot);
  at::NoGradGuard no_grad;
  const at::ScalarType reduce_dtype = options_.mixed_precision.reduce.value_or(g.compute_dtype());
  const at::Tensor grads = g.segment_grad(s);
  auto pending = std::make_unique<PendingReduce>();
  pending->unit = kRoot;
  pending->segment = s;
  at::Tensor& master_grad = g.master().mutable_grad();
  if (!g.master_aliases_full() && !master_grad.defined()) {
    master_grad = g.empty_master_grad();
    fresh_grad_ = true;
  }
  if (g.offloaded()) {
    // Note [Offloaded buckets]: reduced on the device, then landed in the host's gradient.
    pending->input = reduce_dtype == g.compute_dtype() ? grads : grads.to(reduce_dtype);
    pending->output = shard_.size == 1 ? pending->input : at::empty({seg.slice}, pending->input.options());
    pending->target = g.master_part(master_grad, s);
    pending->add = !fresh_grad_;
  } else if (shard_.size == 1) {
    // NoShard: every rank averages the whole bucket, in place.
    at::Tensor target = g.master_aliases_full() ? grads : g.master_part(master_grad, s);
    if (g.master_aliases_full() ? reduce_dtype == g.compute_dtype()
                                : fresh_grad_ && reduce_dtype == at::kFloat) {
      if (!target.is_same(grads)) target.copy_(grads);  // converted straight into the master's gradient
      pending->input = target;
    } else {
      pending->input = grads.to(reduce_dtype);
      pending->target = target;
      pending->add = !g.master_aliases_full() && !fresh_grad_;
    }
    pending->output = pending->input;
  } else {
    // ShardOptimizerState: each rank receives its slice, its part of the master shard.
    pending->input = reduce_dtype == g.compute_dtype() ? grads : grads.to(reduce_dtype);
    if (fresh_grad_ && reduce_dtype == at::kFloat) {
      pending->output = g.master_part(master_grad, s);
    } else {
      pending->output = at::empty({seg.slice}, pending->input.options());
      pending->target = g.master_part(master_grad, s);
      pending->add = !fresh_grad_;
    }
  }
  if (options_.decentralized_every > 0) {
    // Note [Decentralized training]: each rank steps with its own gradient.
  } else if (options_.staleness > 0) {
    delay(*pending, s);
  } else {
    start_bucket_reduction(*pending, s);
  }
  in_flight_.push_back(std::move(pending));
}

// Note [Frozen parameters in the replicated strategies]
// Parameters with requires_grad off when the wrapper is made (a fine-tuning's frozen
// backbone) are left out of the buckets, as DDP leaves them out of its reducer: they go,
// in registration order, into a persistent group of their own (the root's frozen part,
// a unit without a driver) that is gathered once and never reduced. So they cost no
// gradient, no reduction and no optimizer state: under NoShard the optimizer steps only
// the trained parameters, and under ShardOptimizerState each rank holds its slice of the
// frozen parameters' fp32 values and the gathered parameters, as of every other parameter.
// The part's parameters change only when a checkpoint is loaded into it; the next forward
// then writes them from its master (and all-gathers them under ShardOptimizerState).

// Note [Offloaded buckets]
// With cpu_offload under NoShard and ShardOptimizerState the fp32 master (the whole model,
// or this rank's slices), its gradient and the optimizer's state live in host memory
// (page-locked when the compute device is a GPU), and the device keeps the parameters and
// the buckets' gradients, as DeepSpeed's offload_optimizer does under ZeRO-1. A bucket is
// reduced on the device as without offload (all-reduce, reduce-scatter or the hook, in the
// reduce dtype), and its average (this rank's slice of it) is copied into its part of the
// master's gradient in page-locked host memory, beside the compute stream without blocking
// the host (Note [Copies beside compute]; when an earlier backward left a gradient there,
// into a landing buffer, added after);
// the end of backward waits for the device once (Note [Offloaded gradients]). The
// optimizer steps on the host; the refresh copies each stepped slice to the device
// (fp32, converted there) before the all-gather. On a CPU compute device the same path
// runs, host to host.

// Starts averaging `pending.input` over the ranks: in place under NoShard, this rank's
// slice into `pending.output` under ShardOptimizerState; by the hook when there is one.
void Engine::start_bucket_reduction(PendingReduce& pending, int s) {
  CollectiveOptions opts;
  if (shard_.size == 1) {
    if (shard_.replicas == 1) return;  // one rank: the average is the gradient
    if (comm_hook_) {
      start_hook(pending, s);
    } else {
      opts.stream = StreamRole::AllReduce;
      pending.work = comm_->all_reduce(pending.input, ReduceOp::Avg, opts);
    }
  } else if (comm_hook_) {
    // The hook averages the whole bucket in place (`input` is the bucket's own buffer, or
    // its converted copy); this rank's slice of the average is then the output.
    const std::int64_t slice = units_[kRoot]->group->segments()[s].slice;
    pending.slice_offset = static_cast<std::int64_t>(shard_.rank) * slice;
    pending.slice_numel = slice;
    start_hook(pending, s);
  } else {
    opts.stream = StreamRole::ReduceScatter;
    pending.work = comm_->reduce_scatter(pending.output, pending.input, ReduceOp::Avg, opts);
  }
}

void Engine::end_of_replicated_backward() {
  Unit& root = *units_[kRoot];
  root.pre_backward_done = false;
  if (!root.group) return;
  FlatParamGroup& g = *root.group;
  if (!rebuilt_) arrival_recorded_ = true;
  if (no_sync_) {
    fold_strays(g, 0, static_cast<int>(g.slots().size()));
    g.drop_param_grads();
    return;
  }
  std::vector<std::string> missing;
  for (const auto& slot : g.slots()) {
    if (slot.accumulator && !used_[slot.id]) missing.push_back(slot.name);
  }
  if (!missing.empty() && !options_.find_unused_parameters) {
    g.drop_param_grads();
    g.free_full_grad();
    throw InvalidArgument(fmt::format(
        "flatshard::FullyShard (rank {}/{}): {} parameter(s) got no gradient in this backward: {}. Set "
        "FullyShardOptions::find_unused_parameters = true if parameters may go unused, or make the loss "
        "depend on them.",
        rank_, world_size_, missing.size(), fmt::join(missing, ", ")));
  }
  if (!rebuilt_) rebuild_buckets(bucket_order_from_arrivals());
  // What is left: buckets holding unused parameters (their slices hold zeros).
  for (int k = next_segment_; k < static_cast<int>(pending_.size()); ++k) reduce_segment(k);
  next_segment_ = static_cast<int>(pending_.size());
  finish_pending_reduce();
  land_offloaded_grads();
  if (g.master_aliases_full()) {
    g.alias_master_grad();
  } else {
    g.free_full_grad();
  }
  g.drop_param_grads();
  stale_ = true;      // the optimizer steps the master shard next
  if (warming_up_) {  // Note [Bounded staleness]: no average old enough yet, so no step
    warming_up_ = false;
    g.master().mutable_grad().reset();
  }
  average_with_neighbors();
  account();
}

// Note [Buckets keep units together]
// The buckets are laid out again after the first backward in the order gradients arrived
// (DDP's rebuild), with one change: a declared unit's parameters stay together, in reverse
// registration order, where the unit's first gradient arrived. A recomputed unit
// (Note [Recomputation and DDP's buckets]) hands its gradients over at the end of its
// second run in another order than a unit whose backward runs op by op; the units
// themselves, and the parameters outside every unit, arrive in the same order either way.
// So the layout, and with it the order in which a ring of three or more ranks adds each
// element's contributions, does not depend on recomputation, and training with it is bit
// for bit training without it. A unit's gradients arrive within one unit's backward, so
// its order inside a bucket costs no overlap. Parameters no gradient reached come last;
// the order is rank 0's, so every rank lays out the same buckets.
std::vector<int> Engine::bucket_order_from_arrivals() const {
  std::vector<int> order;
  std::set<int> placed, units_placed;
  auto place = [&](int id) {
    if (placed.insert(id).second) order.push_back(id);
  };
  for (int id : arrival_) {
    const int unit = unit_of_param_[id];
    if (unit == 0) {
      place(id);
    } else if (units_placed.insert(unit).second) {
      for (int other = 0; other < static_cast<int>(unit_of_param_.size()); ++other) {
        if (unit_of_param_[other] == unit) place(other);  // ids ascend in reverse registration order
      }
    }
  }
  for (int id = 0; id < static_cast<int>(param_names_.size()); ++id) place(id);
  return order;
}

void Engine::rebuild_buckets(std::vector<int> order) {
  FlatParamGroup& g = *units_[kRoot]->group;
  if (world_size_ > 1) {
    auto shared = at::tensor(std::vector<std::int64_t>(order.begin(), order.end()), at::kLong).to(device_);
    comm_->broadcast(shared, 0).wait();
    shared = shared.cpu();
    order.assign(shared.data_ptr<std::int64_t>(), shared.data_ptr<std::int64_t>() + shared.numel());
  }
  std::vector<int> slot_of_id(g.slots().size());
  for (int k = 0; k < static_cast<int>(g.slots().size()); ++k) slot_of_id[g.slots()[k].id] = k;
  std::vector<int> slot_order;
  for (int id : order) slot_order.push_back(slot_of_id[id]);
  at::Tensor values;  // every rank's master slices, in the layout before
  if (!g.master_aliases_full()) {
    if (shard_.size == 1) {
      values = g.master().detach();  // one rank's slices are the whole buffer
    } else if (g.compute_dtype() == at::kFloat && !stale_ && g.master()._version() == master_version_) {
      values = g.full().detach();  // the parameters hold the masters' values, bit for bit
    } else {
      values = detail::gather_master_values(g, *comm_);
    }
  }
  g.relayout(slot_order, bucket_sizes(order), values);
  for (int k = 0; k < static_cast<int>(g.segments().size()); ++k) {
    for (int i = g.segments()[k].first_slot; i < g.segments()[k].end_slot; ++i)
      segment_of_param_[g.slots()[i].id] = k;
  }
  pending_.assign(g.segments().size(), 0);
  next_segment_ = 0;
  master_version_ = g.master()._version();
  rebuilt_ = true;
  ++layout_version_;
}

// Note [Gathers behind the step]
// Under ShardOptimizerState the optimizer reports each segment (bucket) of the master
// shard as soon as it has stepped it (ShardOptimizer::step_shard, in segment order), and
// that bucket's slice is copied into the parameters and its all-gather issued at once, so
// the gathers run while the optimizer steps the next buckets instead of after the whole
// step. The report of the last bucket waits for them all: the step returns with the
// parameters refreshed and no collective outstanding. When the step did not report every
// bucket (it failed midway, or an optimizer that does not report stepped), or the master
// changed after it (a loaded checkpoint), the next forward refreshes everything itself.
void Engine::segment_stepped(std::size_t shard, std::size_t segment) {
  if (options_.strategy != Strategy::ShardOptimizerState || shard_.size == 1 || shard != 0 || !stale_) return;
  FlatParamGroup& g = *units_[kRoot]->group;
  if (g.master_aliases_full()) return;
  if (segment == 0 && !early_gathers_.empty()) {  // an earlier step that stopped midway
    auto gathers = std::move(early_gathers_);
    early_gathers_.clear();
    for (auto& w : gathers) w.wait();
  }
  const int k = static_cast<int>(segment);
  if (k != static_cast<int>(early_gathers_.size())) return;  // out of order: refresh_replicas does it all
  g.copy_master_to_slot(k);
  CollectiveOptions opts;
  opts.stream = StreamRole::AllGather;
  early_gathers_.push_back(comm_->all_gather(g.segment_of(g.full(), k), g.slot_of(g.full(), k), opts));
  if (early_gathers_.size() < g.segments().size()) return;
  // The last bucket: the step ends with no collective outstanding, so a failed gather
  // (a lost rank) surfaces here, from the first that failed, not in whatever the caller
  // runs next.
  auto gathers = std::move(early_gathers_);
  early_gathers_.clear();
  for (auto& w : gathers) w.wait();
  stale_ = false;
  master_version_ = g.master()._version();
}

void Engine::refresh_replicas() {
  const auto& group = units_[kRoot]->group;
  if (!early_gathers_.empty()) {  // a step that did not report every bucket
    auto gathers = std::move(early_gathers_);
    early_gathers_.clear();
    for (auto& w : gathers) w.wait();
  }
  if (const int k = units_[kRoot]->frozen_part; k >= 0) {  // changed only by a loaded checkpoint
    Unit& part = *units_[k];
    FlatParamGroup& g = *part.group;
    if (g.master()._version() != part.refreshed_version) {
      g.copy_master_to_slot();
      if (shard_.size > 1) shard_comm().all_gather(g.full(), g.full_slot()).wait();
      part.refreshed_version = g.master()._version();
    }
  }
  if (!group || (!stale_ && group->master()._version() == master_version_)) return;
  FlatParamGroup& g = *group;
  g.copy_master_to_slot();
  if (shard_.size > 1) {
    CollectiveOptions opts;
    opts.stream = StreamRole::AllGather;
    std::vector<Work> gathers;
    for (int k = 0; k < static_cast<int>(g.segments().size()); ++k)
      gathers.push_back(comm_->all_gather(g.segment_of(g.full(), k), g.slot_of(g.full(), k), opts));
    for (auto& w : gathers) w.wait();
  }
  stale_ = false;
  master_version_ = g.master()._version();
}

std::vector<std::vector<std::string>> Engine::bucket_layout() const {
  std::vector<std::vector<std::string>> out;
  if (!replicated_ || !units_[kRoot]->group) return out;
  const auto& g = *units_[kRoot]->group;
  for (const auto& seg : g.segments()) {
    out.emplace_back();
    for (int i = seg.first_slot; i < seg.end_slot; ++i) out.back().push_back(g.slots()[i].name);
  }
  return out;
}

std::vector<std::string> Engine::bucket_order() const {
  std::vector<std::string> out;
  if (!rebuilt_) return out;
  for (const auto& names : bucket_layout()) out.insert(out.end(), names.begin(), names.end());
  return out;
}

void Engine::restore_bucket_order(const std::vector<std::string>& names) {
  if (!replicated_ || !units_[kRoot]->group || rebuilt_ || backward_active_) return;
  // Whatever the saved order, the layout is fixed from here: state loaded into the master
  // shard must not move under a later rebuild.
  if (names.empty()) {
    rebuilt_ = true;
    return;
  }
  std::map<std::string, int> id_of;
  for (int id = 0; id < static_cast<int>(param_names_.size()); ++id) id_of[param_names_[id]] = id;
  std::vector<int> order;
  for (const auto& name : names) {
    auto it = id_of.find(name);
    if (it == id_of.end()) {  // another model's order: keep ours
      rebuilt_ = true;
      return;
    }
    order.push_back(it->second);
  }
  if (order.size() != param_names_.size()) {
    rebuilt_ = true;
    return;
  }
  rebuild_buckets(std::move(order));
}

}  // namespace flatshard::sharding
