// The ways the replicated strategies' buckets can be averaged besides the engine's own
// collective: bounded staleness (each step applies the average of `staleness` steps ago),
// communication hooks (also across HybridShard's replica groups), and decentralized
// training (parameters averaged with ring neighbours instead of gradients), with the
// check of which of them combine.
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
  if (hook && device_.is_cuda() && !hook->runs_on_cuda()) {
    throw InvalidArgument(fmt::format(
        "{}: the hook {} says it does not reduce CUDA gradients (CommHook::runs_on_cuda); on GPUs use one "
        "that does, such as every hook of flatshard::hooks",
        who, hook->describe()));
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
  // Every queue is emptied, whatever a wait throws, so that the buckets stay in step.
  std::exception_ptr failed;
  for (auto& d : delayed_) {
    for (auto& pending : d.queue) {
      try {
        wait_for_collectives(*pending);
      } catch (...) {
        if (!failed) failed = std::current_exception();
      }
    }
    d.queue.clear();
  }
  if (failed) std::rethrow_exception(failed);
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
  if (options_.staleness > 0 && options_.find_unused_parameters) {
    throw InvalidArgument(fmt::format(
        "{}: staleness {} and find_unused_parameters do not combine: each step's record of which parameters "
        "got a gradient is this step's, while the gradients applied are those of {} step(s) before, so a "
        "parameter used in one step and not the next would step on the wrong gradient; set one of them off",
        who, options_.staleness, options_.staleness));
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
// reads the values when it is called). The bucket names the parameters wholly inside this
// rank's shard, at their offsets in it; the pieces of parameters cut by the shard's edges
// are plain values to the hook (PowerSGD sends them uncompressed). When the next unit's
// gradients are reduced, the previous unit's reduce-scatter is waited for, its flat
// gradient freed and its hook started; the hook's rounds then run beside that unit's
// backward and are finished (waited for, the average written and folded into the shard's
// gradient) at the unit after it, or at the end of backward: at most one reduce-scatter
// and one hook in flight (Note [One reduce-scatter in flight]), every rank starting the
// hooks in the units' order.
void Engine::start_hook_across_groups(PendingReduce& pending) {
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
  // Cleared first: a hook that throws is never started again (a second start would issue
  // rounds its peers do not match); the failure goes to whoever handles it.
  pending.hook_across_groups = false;
  HookWork work = comm_hook_->reduce(*replica_comm_, bucket);
  pending.hook_works = std::move(work.works);
  pending.hook_finish = std::move(work.finish);
  pending.hook = comm_hook_;
}

// At once, where nothing follows to overlap (the end of backward).
void Engine::average_across_groups(PendingReduce& pending) {
  start_hook_across_groups(pending);
  for (const Work& w : pending.hook_works) w.wait();
  if (pending.hook_finish) pending.hook_finish();
  pending.hook_works.clear();
  pending.hook_finish = nullptr;
}

}  // namespace flatshard::sharding
