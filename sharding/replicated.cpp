// The replicated strategies, NoShard (DDP) and ShardOptimizerState (ZeRO-1): one
// persistent flat group cut into buckets, reduced as they fill, laid out again after the
// first backward, refreshed from the master shard before forward (Note [Replicated
// strategies]).
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
                                   at::ScalarType compute, const FlatParamGroup::Placement& given) {
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
  if (g.master_aliases_full()) {
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

// Note [Bounded staleness]
// With FullyShardOptions::staleness s, a bucket's gradients are copied when they are
// ready and that copy is averaged (by the engine's collective or the hook, as without
// staleness) while the backward and the next s steps compute. The bucket's own reduction
// then delivers, in place of its own average, the average that bucket got s synced
// backwards ago, which has had s steps to arrive: the update of step t is made from the
// gradients of step t - s, taken at the parameters of step t - s (a single process doing
// the same: tests/multirank/test_decentralized.cpp). In the first s synced backwards
// there is no such average: the gradients are dropped after the backward and the
// optimizer does not step. Each bucket keeps s + 1 buffers for the copies, which take
// turns: s + 1 gradients' worth of memory is the price of never waiting.
void Engine::delay(PendingReduce& pending, int s) {
  if (delayed_.size() < pending_.size()) delayed_.resize(pending_.size());
  Delayed& d = delayed_[s];
  // The buffer the copy made staleness + 1 reductions ago used; that reduction was applied
  // at the end of the previous synced backward.
  const auto turn = static_cast<std::size_t>(d.count++ % (options_.staleness + 1));
  if (d.inputs.size() <= turn) {
    d.inputs.push_back(at::empty_like(pending.input));
    d.outputs.push_back(
        shard_.size == 1 ? d.inputs.back()
                         : at::empty({units_[kRoot]->group->segments()[s].slice}, pending.input.options()));
  }
  auto copy = std::make_unique<PendingReduce>();
  copy->unit = pending.unit;
  copy->input = d.inputs[turn];
  copy->output = d.outputs[turn];
  copy->input.copy_(pending.input);
  start_bucket_reduction(*copy, s);
  d.queue.push_back(std::move(copy));
  if (static_cast<int>(d.queue.size()) > options_.staleness) {
    pending.stale = std::move(d.queue.front());
    d.queue.pop_front();
  } else {
    warming_up_ = true;
  }
}

// Note [Communication hooks]
// Under NoShard and ShardOptimizerState a hook (comm_hooks.h) replaces the bucket's
// average: it gets the bucket when it is ready, in bucket order on every rank, starts its
// collectives on this engine's communicator and returns them with what finishes them,
// and the bucket then waits in in_flight_ like the engine's own all-reduce, finished
// (waited for, then the hook's finish) off the backward's path. The sharded strategies
// reduce-scatter units, which a bucket-averaging hook cannot do, and refuse hooks.
void Engine::set_comm_hook(std::shared_ptr<CommHook> hook) {
  const std::string who =
      fmt::format("flatshard::FullyShard::register_comm_hook (rank {}/{})", rank_, world_size_);
  if (hook && options_.decentralized_every > 0) {
    throw InvalidArgument(fmt::format(
        "{}: decentralized training (decentralized_every {}) averages parameters with the neighbours and "
        "no gradient, so there is nothing for a hook to reduce",
        who, options_.decentralized_every));
  }
  if (hook && !replicated_ && !replica_comm_) {
    throw InvalidArgument(fmt::format(
        "{}: {} reduce-scatters each unit's gradients within {}, and a hook averages over replicas; use "
        "Strategy::NoShard, Strategy::ShardOptimizerState, or HybridShard with more than one shard group",
        who, to_string(options_.strategy),
        options_.strategy == Strategy::HybridShard ? "its only shard group" : "the whole world"));
  }
  if (backward_active_) throw InvalidArgument(fmt::format("{}: called during backward", who));
  // Every rank must run the same hook with the same settings: compare their descriptions.
  const std::string mine = hook ? hook->describe() : "none";
  const auto all = checkpoint::shards::exchange_strings(*comm_, mine);
  for (int r = 0; r < world_size_; ++r) {
    if (all[r] != mine) {
      throw InvalidArgument(
          fmt::format("{}: rank {} registered a communication hook with other settings ({}) than this rank's "
                      "{}; every rank "
                      "must register the same hook with the same settings",
                      who, r, all[r], mine));
    }
  }
  finish_pending_reduce();
  comm_hook_ = std::move(hook);
}

void Engine::start_hook(PendingReduce& pending, int s) {
  const FlatParamGroup& g = *units_[kRoot]->group;
  const FlatSegment& seg = g.segments()[s];
  GradBucket bucket;
  bucket.index = s;
  bucket.step = synced_backwards_;
  bucket.buffer = pending.input;
  for (int i = seg.first_slot; i < seg.end_slot; ++i) {
    const ParamSlot& slot = g.slots()[i];
    bucket.params.push_back({slot.name, slot.shape, slot.offset - seg.offset});
  }
  HookWork work = comm_hook_->reduce(*comm_, bucket);
  pending.hook_works = std::move(work.works);
  pending.hook_finish = std::move(work.finish);
  pending.hook = comm_hook_;
}

// A run resumed from a checkpoint starts its staleness over: the averages waiting belong
// to the steps before the checkpoint was loaded. Their collectives are waited for (no rank
// leaves one behind), and what would finish them is not run: a hook's finish would
// overwrite the state just loaded.
void Engine::restore_synced_backwards(std::int64_t count) {
  synced_backwards_ = count;
  for (auto& d : delayed_) {
    for (auto& pending : d.queue) {
      if (pending->work) pending->work->wait();
      for (const Work& w : pending->hook_works) w.wait();
    }
    d.queue.clear();
  }
}

// Note [Decentralized training]
// With FullyShardOptions::decentralized_every k (NoShard), no gradient is averaged. At
// the first forward of every k-th step, the parameters (the master buffer, which holds
// them, or their fp32 master under mixed precision) go to both ring neighbours and theirs
// come back (Communicator::neighbor_exchange, on the all-gather stream), while forward
// and backward run; the parameters do not change until the step. At the end of that
// step's synced backward each rank replaces its parameters with the mean of its own and
// its neighbours', and the optimizer steps that mean with this rank's own gradient:
// w_{t+1,i} = (w_{t,i-1} + w_{t,i} + w_{t,i+1}) / 3 - lr g_{t,i} for SGD. The first step
// exchanges nothing: until the buckets are laid out every rank holds rank 0's
// parameters, whose mean is themselves.
void Engine::start_neighbor_exchange() {
  const auto& group = units_[kRoot]->group;
  if (options_.decentralized_every <= 0 || world_size_ == 1 || !group || exchange_ || !rebuilt_) return;
  if ((synced_backwards_ + 1) % options_.decentralized_every != 0) return;
  const at::Tensor master = group->master().detach();
  if (!neighbors_.defined() || neighbors_.numel() != 2 * master.numel())
    neighbors_ = at::empty({2 * master.numel()}, master.options());
  CollectiveOptions opts;
  opts.stream = StreamRole::AllGather;
  exchange_ = comm_->neighbor_exchange(neighbors_, master, opts);
}

void Engine::average_with_neighbors() {
  if (!exchange_) return;
  const Work work = *exchange_;
  exchange_.reset();
  work.wait();
  at::NoGradGuard no_grad;
  at::Tensor master = units_[kRoot]->group->master().detach();
  const std::int64_t n = master.numel();
  master.add_(neighbors_.narrow(0, 0, n)).add_(neighbors_.narrow(0, n, n)).div_(3);
  stale_ = true;  // under mixed precision the parameters are refreshed from it
}

void Engine::check_communication_options() const {
  const std::string who = fmt::format("flatshard::FullyShard (rank {}/{})", rank_, world_size_);
  if (options_.staleness < 0 || options_.staleness > FullyShardOptions::kMaxStaleness) {
    throw InvalidArgument(fmt::format("{}: staleness must be in [0, {}], got {}", who,
                                      FullyShardOptions::kMaxStaleness, options_.staleness));
  }
  if (options_.staleness > 0 && !replicated_) {
    throw InvalidArgument(
        fmt::format("{}: staleness {} needs a replicated strategy (NoShard or ShardOptimizerState): {} "
                    "reduce-scatters each unit into its shard as backward runs; set staleness = 0 or change "
                    "the strategy",
                    who, options_.staleness, to_string(options_.strategy)));
  }
  if (options_.decentralized_every < 0) {
    throw InvalidArgument(
        fmt::format("{}: decentralized_every must be >= 0, got {}", who, options_.decentralized_every));
  }
  if (options_.decentralized_every > 0 && options_.strategy != Strategy::NoShard) {
    throw InvalidArgument(fmt::format(
        "{}: decentralized_every {} needs Strategy::NoShard: every rank keeps and steps its own replica, "
        "while {} holds one copy of the optimizer state for all ranks; set decentralized_every = 0 or use "
        "NoShard",
        who, options_.decentralized_every, to_string(options_.strategy)));
  }
  if (options_.decentralized_every > 0 && options_.cpu_offload) {
    throw InvalidArgument(fmt::format(
        "{}: decentralized_every {} and cpu_offload do not combine: the neighbours' parameters are exchanged "
        "and averaged on the compute device, which offload keeps free of the masters; set one of them off",
        who, options_.decentralized_every));
  }
  if (options_.decentralized_every > 0 && options_.staleness > 0) {
    throw InvalidArgument(fmt::format(
        "{}: decentralized_every {} and staleness {} do not combine: decentralized training averages "
        "no gradient to delay; set one of them to 0",
        who, options_.decentralized_every, options_.staleness));
  }
}

// Note [Hooks across shard groups]
// Under HybridShard the groups that hold the same shard replicate it, and the hook averages
// over them in place of the engine's all-reduce: each unit's reduce-scattered shard (the
// group's average) is handed to the hook as a bucket numbered by the unit, over the
// communicator of this shard's replicas, once its reduce-scatter has completed (the hook
// reads the values when it is called), and is finished at once. The bucket names the
// parameters wholly inside this rank's shard, at their offsets in it; the pieces of
// parameters cut by the shard's edges are plain values to the hook (PowerSGD sends them
// uncompressed).
void Engine::average_across_groups(PendingReduce& pending) {
  const FlatParamGroup& g = *units_[pending.unit]->group;
  const std::int64_t begin = static_cast<std::int64_t>(shard_.rank) * g.shard_numel(),
                     end = begin + g.shard_numel();
  GradBucket bucket;
  bucket.index = pending.unit;
  bucket.step = synced_backwards_;
  bucket.buffer = pending.output;
  for (const auto& slot : g.slots()) {
    if (slot.offset >= begin && slot.offset + slot.numel <= end)
      bucket.params.push_back({slot.name, slot.shape, slot.offset - begin});
  }
  HookWork work = comm_hook_->reduce(*replica_comm_, bucket);
  for (const Work& w : work.works) w.wait();
  if (work.finish) work.finish();
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
  if (!rebuilt_) {
    // Rank 0's arrival order (then the parameters that got no gradient), so that every
    // rank lays out the same buckets.
    std::vector<int> order = arrival_;
    std::set<int> seen(order.begin(), order.end());
    for (int id = 0; id < static_cast<int>(param_names_.size()); ++id) {
      if (!seen.count(id)) order.push_back(id);
    }
    rebuild_buckets(std::move(order));
  }
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
