// The sharded strategies' gradients after each unit's backward: the reduce-scatter (one
// in flight), its landing in the shard gradient (on the host under offload, with steps
// beside backward), and the end of backward: parameters without gradients and the
// non-finite check.
#include "sharding/engine.h"
#include "sharding/engine_parts.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "flatshard/errors.h"
#include "flatshard/optim.h"
#include "optim/clip.h"
#include "src/errors.h"
#include "src/logging.h"

namespace flatshard::sharding {

using detail::accumulate;
using detail::fold_strays;

// Note [One reduce-scatter in flight]
// Before a unit's gradients are reduce-scattered, the previous unit's reduction is
// waited for and folded into its shard gradient, and its flat gradient is freed. So at
// most one reduction (and the flat gradient it reads) is outstanding, while the
// reduce-scatter stream still overlaps the backward compute of the next unit. Under
// HybridShard with a hook, the previous unit's hook across the groups is started there
// and stays out beside the next unit's backward, holding only its shard (Note [Hooks across
// shard groups]).
void Engine::reduce(int index) {
  finish_reduces_starting_hooks();
  FlatParamGroup& g = *units_[index]->group;
  const at::ScalarType reduce_dtype = options_.mixed_precision.reduce.value_or(g.compute_dtype());
  auto pending = std::make_unique<PendingReduce>();
  pending->unit = index;
  pending->input_is_full_grad = reduce_dtype == g.compute_dtype();
  pending->input = pending->input_is_full_grad ? g.full_grad() : g.full_grad().to(reduce_dtype);
  if (!pending->input_is_full_grad) g.free_full_grad();
  CollectiveOptions opts;
  opts.stream = StreamRole::ReduceScatter;
  std::optional<Work> scattered;
  if (shard_.size == 1) {
    // Over one rank the average is the gradient itself: no collective, and no copy when
    // the conversion to the reduce dtype already made one.
    pending->output = pending->input_is_full_grad ? g.full_grad().clone() : pending->input;
  } else {
    pending->output = g.pooled_empty(g.shard_numel(), reduce_dtype);
    scattered = shard_comm().reduce_scatter(pending->output, pending->input, ReduceOp::Avg, opts);
    pending->work = scattered;
  }
  if (replica_comm_ && comm_hook_) {
    pending->hook_across_groups = true;  // Note [Hooks across shard groups]: when it is finished
  } else if (replica_comm_) {
    // Note [Shard groups]: the group's average, averaged over the groups that hold the
    // same shard, is the world's average (the groups are the same size).
    CollectiveOptions across;
    across.stream = StreamRole::AllReduce;
    if (scattered) across.wait_for.push_back(scattered->event());
    pending->scatter = scattered;
    pending->work = replica_comm_->all_reduce(pending->output, ReduceOp::Avg, across);
  }
  in_flight_.push_back(std::move(pending));
}

void Engine::finish_pending_reduce() {
  while (!in_flight_.empty()) finish_first_reduce();
}

// Before a unit's reduce-scatter: what is in flight is finished, but a unit whose hook
// across the groups has yet to run (Note [Hooks across shard groups]) has its
// reduce-scatter waited for, its flat gradient freed and its hook started, and stays in
// flight beside the next unit's backward.
void Engine::finish_reduces_starting_hooks() {
  std::deque<std::unique_ptr<PendingReduce>> started;
  try {
    while (!in_flight_.empty()) {
      PendingReduce& first = *in_flight_.front();
      if (!first.hook_across_groups) {
        finish_first_reduce();
        continue;
      }
      complete(first);
      first.work.reset();  // waited for
      first.scatter.reset();
      first.input = at::Tensor();
      if (first.input_is_full_grad) {
        units_[first.unit]->group->free_full_grad();
        first.input_is_full_grad = false;
      }
      start_hook_across_groups(first);
      started.push_back(std::move(in_flight_.front()));
      in_flight_.pop_front();
    }
  } catch (...) {
    // The hooks started stay in flight, in front, so that whoever handles the failure
    // waits for their collectives before their buffers go.
    while (!started.empty()) {
      in_flight_.push_front(std::move(started.back()));
      started.pop_back();
    }
    throw;
  }
  in_flight_ = std::move(started);
}

bool Engine::completed(const PendingReduce& p) {
  if (p.work && !p.work->is_completed()) return false;
  if (p.scatter && !p.scatter->is_completed()) return false;
  for (const Work& w : p.hook_works) {
    if (!w.is_completed()) return false;
  }
  return !p.stale || completed(*p.stale);
}

void Engine::finish_completed_reduces() {
  while (!in_flight_.empty() && completed(*in_flight_.front())) finish_first_reduce();
}

// Waits for `pending`'s collectives and leaves its average in `pending.output`.
void Engine::complete(PendingReduce& pending) {
  if (pending.scatter) pending.scatter->wait();
  if (pending.work) pending.work->wait();
  for (const Work& w : pending.hook_works) w.wait();  // Note [Communication hooks]
  if (pending.hook_finish) pending.hook_finish();
  at::NoGradGuard no_grad;
  if (pending.slice_numel >= 0)
    pending.output.copy_(pending.input.narrow(0, pending.slice_offset, pending.slice_numel));
  if (pending.stale) {  // Note [Bounded staleness]: an earlier step's average stands for ours
    complete(*pending.stale);
    pending.output.copy_(pending.stale->output);
    pending.stale.reset();
  }
}

void Engine::wait_for_collectives(const PendingReduce& pending) {
  for (const PendingReduce* p = &pending; p; p = p->stale.get()) {
    if (p->scatter) p->scatter->wait();
    if (p->work) p->work->wait();
    for (const Work& w : p->hook_works) w.wait();
  }
}

void Engine::finish_first_reduce() {
  auto pending = std::move(in_flight_.front());
  in_flight_.pop_front();
  complete(*pending);
  if (pending->hook_across_groups) average_across_groups(*pending);
  const int pending_segment = pending->segment;
  if (pending->segment >= 0) {  // a bucket of a replicated group
    FlatParamGroup& g = *units_[pending->unit]->group;
    if (g.offloaded()) {
      // Note [Offloaded buckets]
      at::NoGradGuard no_grad;
      const auto reduced = pending->output.to(at::kFloat);
      if (pending->add) {  // an earlier backward's gradient is there: land apart, add after
        landing_grads_.push_back({pending->unit, land(g, reduced), pending->target});
      } else {  // straight into the master's gradient; the end of backward waits for it
        copy_to_host(pending->target, reduced, g.pinned());
        landing_grads_.push_back({pending->unit, at::Tensor(), pending->target});
      }
    } else if (pending->target.defined()) {
      at::NoGradGuard no_grad;
      if (pending->add) {
        pending->target.add_(pending->output);
      } else {
        pending->target.copy_(pending->output);
      }
    }
    pending.reset();
    g.free_segment_grad(pending_segment);
    return;
  }
  FlatParamGroup& g = *units_[pending->unit]->group;
  at::NoGradGuard no_grad;
  // The reduced shard is this reduction's own buffer: an fp32 one becomes the gradient.
  auto reduced = pending->output.to(at::kFloat);
  if (g.offloaded()) {
    // Note [Offloaded gradients]: the reduced shard is copied to page-locked host memory
    // beside the compute stream (Note [Copies beside compute]) without blocking the host;
    // end_of_backward waits for the device once and adds every landed shard into the host
    // gradients. With no gradient there yet it lands in the group's own gradient block
    // (page-locked at its size and taken again every step: Note [Page-locked at its
    // size]), which becomes the gradient; an earlier backward's gradient is there: land
    // apart, add after.
    if (g.master().grad().defined()) {
      landing_grads_.push_back({pending->unit, land(g, reduced), at::Tensor()});
    } else {
      at::Tensor block = g.empty_master_grad();
      copy_to_host(block, reduced, g.pinned());
      if (step_in_backward_) {
        step_beside_backward(pending->unit, std::move(block));
      } else {
        landing_grads_.push_back({pending->unit, std::move(block), at::Tensor()});
      }
    }
  } else {
    const bool adds = g.master().grad().defined();
    accumulate(g.master().mutable_grad(), reduced);
    if (adds) {
      pending->output = at::Tensor();
      g.release(std::move(reduced));
    }
    step_now(pending->unit);
  }
  if (pending->input_is_full_grad) g.free_full_grad();
}

void Engine::end_of_backward() {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  if (replicated_) {
    end_of_replicated_backward();  // a failure leaves the backward to be abandoned
    backward_active_ = false;
    accumulating_ = no_sync_;
    if (no_sync_) return;
    ++synced_backwards_;
    find_params_with_grad();
    check_nonfinite();
    return;
  }
  // Units whose hooks did not all fire (parameters that got no gradient this step).
  for (int i = static_cast<int>(units_.size()) - 1; i >= 0; --i) {
    if (units_[i]->pre_backward_done && !units_[i]->post_backward_done) post_backward(i);
  }
  if (orders_reductions()) {
    agree_on_units_reached();
  } else if (!no_sync_) {
    reduce_units_not_reached();
  }
  if (!deferred_reduces_.empty()) reduce_in_order();  // Note [Reductions in one order]
  finish_pending_reduce();
  // A failed step (Note [Offloaded steps beside backward]) is rethrown once backward's
  // bookkeeping is done, so that the next forward starts from a finished backward.
  std::exception_ptr failed_step;
  try {
    finish_steps_beside_backward();
  } catch (...) {
    failed_step = std::current_exception();
  }
  land_offloaded_grads();
  backward_gathers_.clear();
  for (int i = 0; i < static_cast<int>(units_.size()); ++i) {
    reshard(i);
    units_[i]->pre_backward_done = false;
    units_[i]->post_backward_done = false;
    units_[i]->awaited.clear();
  }
  backward_active_ = false;
  ++backwards_;
  if (no_sync_) return;
  ++synced_backwards_;
  find_params_with_grad();
  if (failed_step) std::rethrow_exception(failed_step);
  check_nonfinite();
}

// Note [Units a backward did not reach]
// A unit's backward starts from its outputs' or its parameters' hooks, so a unit that the
// synced backward does not reach (a block skipped in the last micro-batch, a LayerDrop)
// runs none; yet backwards under no_sync before it may have left a gradient in its full
// gradient, which torch would step (its .grad stays defined). The synced end of backward
// reduces every unit that holds one, in unit order, so that the sum reaches the shards.
// Without find_unused_parameters every rank is taken to reach the same units (as FSDP2
// takes it). With it, the ranks may reach different units: every rank then reduces the
// units any rank holds a gradient for, a rank that holds none with zeros, in the one order
// of Note [Reductions in one order], which one small all-gather per backward (beside the
// all-reduce that combines the parameters' records) tells them. The same all-gather
// compares the gathers each rank's backward issued (FullShard's and HybridShard's units
// are gathered again for backward, by their own backward or a later unit's prefetch): in
// other numbers or orders they paired one unit's parameters with another's, and the
// gradients of this backward are not to be trusted; every rank throws InvalidArgument
// listing the units it gathered, and the job must restart (with a loss that reaches the
// same units on every rank, ShardGradOp, which gathers nothing in backward, or a
// replicated strategy). Where a rank waits for a gather that no other rank issued, the
// backward ends earlier, in a CommError (timeout or mismatch) naming that gather.
void Engine::reduce_units_not_reached() {
  for (int i = static_cast<int>(units_.size()) - 1; i >= 0; --i) {
    Unit& u = *units_[i];
    if (u.pre_backward_done || !u.group || !u.group->trains() || !u.group->full_grad_allocated()) continue;
    reduce(i);
  }
}

void Engine::agree_on_units_reached() {
  // ShardGradOp under no_sync: nothing is gathered in backward and nothing reduced.
  if (no_sync_ && !reshard_after_forward_) return;
  const int n = static_cast<int>(units_.size());
  // Per rank: a trace of its backward's gathers (their count, then a hash of their order),
  // then which units hold a gradient to reduce.
  std::vector<std::int64_t> mine(2 + static_cast<std::size_t>(n), 0);
  std::uint64_t trace = 1469598103934665603ull;  // FNV-1a over the units' indices
  for (int g : backward_gathers_) {
    trace ^= static_cast<std::uint64_t>(g) + 1;
    trace *= 1099511628211ull;
  }
  mine[0] = static_cast<std::int64_t>(backward_gathers_.size());
  mine[1] = static_cast<std::int64_t>(trace >> 1);
  for (int i = 0; i < n; ++i) {
    const Unit& u = *units_[i];
    mine[2 + i] =
        u.group && u.group->trains() && (u.pre_backward_done || u.group->full_grad_allocated()) ? 1 : 0;
  }
  const auto width = static_cast<std::int64_t>(mine.size());
  auto all = at::empty({world_size_ * width}, at::TensorOptions().dtype(at::kLong).device(device_));
  // On the all-reduce stream: a gather left unmatched on the gathers' stream would hold it.
  CollectiveOptions beside;
  beside.stream = StreamRole::AllReduce;
  comm_->all_gather(all, at::tensor(mine, at::kLong).to(device_), beside).wait();
  all = all.cpu();
  const std::int64_t* rows = all.data_ptr<std::int64_t>();
  std::vector<char> holds(static_cast<std::size_t>(n), 0);
  bool in_step = true;
  for (int r = 0; r < world_size_; ++r) {
    const std::int64_t* row = rows + r * width;
    in_step = in_step && row[0] == mine[0] && row[1] == mine[1];
    for (int i = 0; i < n; ++i) holds[static_cast<std::size_t>(i)] |= row[2 + i] != 0 ? 1 : 0;
  }
  if (!in_step) {
    std::vector<std::string> names;
    for (int g : backward_gathers_) names.push_back(units_[g]->name);
    throw InvalidArgument(fmt::format(
        "flatshard::FullyShard (rank {}/{}): the ranks' backwards gathered different units (this rank: {} "
        "gathers, of [{}]): the loss reached other units on other ranks, and under {} a unit's backward "
        "gathers its parameters, so the gathers paired one unit's parameters with another's; this job "
        "cannot go on: restart it with a loss that reaches the same units on every rank, or with "
        "ShardGradOp (which gathers nothing in backward) or a replicated strategy (NoShard, "
        "ShardOptimizerState) (Note [Units a backward did not reach])",
        rank_, world_size_, backward_gathers_.size(), fmt::join(names, ", "), to_string(options_.strategy)));
  }
  if (no_sync_) return;
  bool zeros = false;
  for (int i = n - 1; i >= 0; --i) {
    Unit& u = *units_[i];
    if (!holds[static_cast<std::size_t>(i)] || u.post_backward_done || !u.group || !u.group->trains())
      continue;
    zeros = zeros || !u.group->full_grad_allocated();
    u.group->allocate_full_grad();  // zeros where this rank has none
    deferred_reduces_.push_back(i);
  }
  if (zeros) account();
}

// Note [A backward that failed]
// A backward that throws midway (out of memory on the device, a failing op or hook) never
// runs its end: autograd runs the final callbacks of a backward that completed only. Its
// units stay gathered and marked as in backward, its reductions in flight, its gradients
// half made; a wrapper left so would skip the next backward's hooks. The next forward of
// the root (or zero_grad) finds the backward still active and abandons it: it waits for
// the reductions in flight (the ranks issued the same ones when they failed alike: a
// failure on some ranks only leaves the others in a collective, which their deadline
// ends), drops their results and every gradient of the step, as zero_grad would, and
// reshards every unit. Training then goes on from the same weights: a batch that ran out
// of memory can be retried smaller, as a batch size finder does. What stepped in backward
// before the failure (step_in_backward) has stepped. Gradients accumulated under no_sync
// before the failed backward are dropped with it; under bounded staleness the averages in
// flight too (the next `staleness` steps warm up again); a hook's error-feedback residuals
// keep what the buckets reduced before the failure left over. A backward that meets the
// failed one still active (a second graph kept from before it) abandons it first; step()
// and clip_grad_norm refuse partial gradients until then, and the optimizers' zero_grad
// abandons it too. How each knows the backward failed: a forward, zero_grad, step or clip
// finds it active with no graph task running on the thread (a forward inside a backward
// leaves the live one alone); a hook of a backward finds the failed one's end callback
// gone (a token the callback holds has expired: autograd drops the callbacks of a backward
// that failed), which a backward nested in the live one (a recomputed unit's reentrant
// grad) does not.
void Engine::abandon_backward() {
  backward_active_ = false;
  deferred_reduces_.clear();
  backward_gathers_.clear();
  std::exception_ptr failed;
  const auto keep_first = [&failed] {
    if (!failed) failed = std::current_exception();
  };
  while (!in_flight_.empty()) {
    std::unique_ptr<PendingReduce> pending = std::move(in_flight_.front());
    in_flight_.pop_front();
    try {
      wait_for_collectives(*pending);
    } catch (...) {
      keep_first();
    }
  }
  try {
    wait_for_device_and_copies();
  } catch (...) {
    keep_first();
  }
  landing_grads_.clear();
  try {
    finish_steps_beside_backward();
  } catch (...) {
    keep_first();
  }
  for (int i = 0; i < static_cast<int>(units_.size()); ++i) {
    Unit& u = *units_[i];
    try {
      reshard(i);
    } catch (...) {
      keep_first();
    }
    u.pre_backward_done = false;
    u.post_backward_done = false;
    u.awaited.clear();
    if (!u.group) continue;
    u.group->drop_param_grads();
    u.group->free_full_grad();
    u.group->master().mutable_grad().reset();
  }
  if (replicated_ && !arrival_recorded_) arrival_.clear();  // the first backward's, recorded again
  // Bounded staleness: the buckets launched before the failure took their delayed average
  // and queued the failed batch's; the others did not. Every delayed average is dropped, so
  // that the buckets stay in step: the next `staleness` steps warm up again, as after a load.
  if (options_.staleness > 0) {
    try {
      restore_synced_backwards(synced_backwards_);
    } catch (...) {
      keep_first();
    }
  }
  accumulating_ = false;
  step_begins_ = true;
  ++backwards_;
  account();
  if (failed) std::rethrow_exception(failed);
}

// Note [Parameters without gradients]
// torch::optim leaves a parameter whose .grad is undefined untouched: no weight decay, no
// momentum, no step count. A flat shard has a gradient for every element, so the engine
// records which parameters got one since the gradients were last cleared (zero_grad, or a
// step in backward, which consumes them), over every backward since, synced or not, as
// torch's .grad stays defined through backwards that accumulate into it (a head only the
// first of two micro-batches used is stepped), and the optimizer steps only theirs
// (ShardOptimizer::step_shard). With
// find_unused_parameters the ranks' records are combined (a parameter any rank used got a
// gradient), one small all-reduce per synced backward; without it each rank's own record
// stands, which is right when every rank leaves the same parameters unused (as FSDP2
// assumes; the replicated strategies refuse an unused parameter then).
void Engine::find_params_with_grad() {
  if (step_in_backward_) step_begins_ = true;  // stepped: the gradients are gone
  std::vector<int> units;
  for (int i = 0; i < static_cast<int>(units_.size()); ++i) {
    if (units_[i]->group) units.push_back(i);
  }
  std::vector<float> flags;
  for (int i : units) {
    for (const auto& slot : units_[i]->group->slots()) flags.push_back(got_grad_[i][slot.id] ? 1.0f : 0.0f);
  }
  if (options_.find_unused_parameters && world_size_ > 1) {
    auto t = at::tensor(flags, at::kFloat).to(device_);
    comm_->all_reduce(t, ReduceOp::Sum).wait();
    t = t.cpu();
    flags.assign(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
  }
  std::size_t k = 0;
  params_with_grad_.assign(units.size(), {});
  for (std::size_t s = 0; s < units.size(); ++s) {
    const std::size_t n = units_[units[s]]->group->slots().size();
    const auto first = flags.begin() + k, last = first + n;
    if (std::find(first, last, 0.0f) != last) {  // else empty: every one
      for (auto f = first; f != last; ++f) params_with_grad_[s].push_back(*f > 0 ? 1 : 0);
    }
    k += n;
  }
}

void Engine::check_nonfinite() {
  if (options_.nonfinite_grads == NonFiniteGrads::Ignore) return;
  std::vector<at::Tensor> grads;
  for (auto& u : units_) {
    if (u->group) grads.push_back(u->group->master().grad());
  }
  const auto bad = optim::nonfinite_ranks(grads, *comm_);
  if (optim::handle_nonfinite(bad, static_cast<int>(options_.nonfinite_grads), synced_backwards_, rank_,
                              world_size_, "FullyShard")) {
    zero_grad();
    ++skipped_steps_;
  }
}

// A host copy of `reduced` (fp32, on the compute device), page-locked with the group's
// master, made without blocking the host (Note [Offloaded gradients]).
at::Tensor Engine::land(FlatParamGroup& g, const at::Tensor& reduced) {
  auto landing =
      at::empty({reduced.numel()}, at::TensorOptions().dtype(at::kFloat).pinned_memory(g.pinned()));
  copy_to_host(landing, reduced, g.pinned());
  return landing;
}

// Copies `reduced` into `host`: into page-locked host memory on the copy stream to the
// host (Note [Copies beside compute]); otherwise on the caller's stream.
void Engine::copy_to_host(const at::Tensor& host, const at::Tensor& reduced, bool pinned) {
  if (!copy_out_ || !pinned) {
    host.copy_(reduced, /*non_blocking=*/pinned);
    return;
  }
  copy_out_->follow_current();
  copy_out_->keep_until_read(reduced);
  const c10::StreamGuard beside(copy_out_->stream());
  host.copy_(reduced, /*non_blocking=*/true);
}

// Note [Offloaded steps beside backward]
// Stepping in backward under CPU offload, a unit whose reduced gradient shard is on its
// way to the host (copied into the group's own block, no earlier gradient to add to) is
// handed to a host thread of the engine's own (step_stream_), which waits for that copy
// alone (an event recorded on the copy stream after it; on the CPU the copy is done) and
// steps the unit's master there, in the order the units were reduced. The thread that
// runs backward goes on queueing the next units' backward meanwhile, so the optimizer's
// work on the host, which after backward would leave the GPU idle, runs beside the rest of
// backward instead. A unit's step touches its own group only (its master, gradient and
// bf16 copy, and its entry of params_with_grad_): backward no longer reads them, and the
// next forward's gathers come after the end of backward, which waits for every step
// (finish_steps_beside_backward) and then rethrows the first step's error. The arithmetic
// is the step's after backward, bit for bit.
void Engine::step_beside_backward(int unit, at::Tensor landing) {
  std::shared_ptr<c10::Event> copied;
  if (copy_out_) copied = copy_out_->record();
  if (!step_stream_) step_stream_ = std::make_unique<Stream>("flatshard offloaded steps");
  steps_beside_.push_back(step_stream_->submit([this, unit, copied, landing = std::move(landing)]() mutable {
    if (copied) copied->synchronize();
    at::NoGradGuard no_grad;
    units_[unit]->group->master().mutable_grad() = std::move(landing);
    step_now(unit);
  }));
}

void Engine::finish_steps_beside_backward() {
  std::exception_ptr first;
  for (auto& step : steps_beside_) {
    try {
      step.synchronize();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  steps_beside_.clear();
  if (first) std::rethrow_exception(first);
}

void Engine::wait_for_device_and_copies() {
  if (!device_.is_cpu()) c10::impl::VirtualGuardImpl(device_.type()).getStream(device_).synchronize();
  if (copy_out_) copy_out_->synchronize();
  if (copy_in_) copy_in_->synchronize();
}

void Engine::land_offloaded_grads() {
  if (landing_grads_.empty()) return;
  // One host wait for the device: the copies to the host, and those to the device, which
  // read the masters the optimizer is about to write (Note [Copies beside compute]).
  wait_for_device_and_copies();
  at::NoGradGuard no_grad;
  for (auto& l : landing_grads_) {
    if (l.target.defined()) {  // a bucket's slice (Note [Offloaded buckets])
      if (l.landed.defined()) l.target.add_(l.landed);
      continue;
    }
    accumulate(units_[l.unit]->group->master().mutable_grad(), l.landed);
    step_now(l.unit);
  }
  landing_grads_.clear();
}

}  // namespace flatshard::sharding
