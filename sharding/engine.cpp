// The engine's schedule around forward and backward: gathers, prefetches and reshards of
// the sharded strategies' units, the backward hooks that start each unit's reduction
// (gradients.cpp reduces; the replicated strategies' buckets are in replicated.cpp),
// stepping in backward, clipping, memory accounting.
#include "sharding/engine.h"
#include "sharding/engine_parts.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cmath>
#include <exception>
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

// --- gathers --------------------------------------------------------------------

void Engine::issue_gather(int index) {
  Unit& u = *units_[index];
  FlatParamGroup& g = *u.group;
  g.allocate_full();
  std::optional<c10::StreamGuard> beside;
  if (copy_in_ && g.pinned()) {  // Note [Copies beside compute]
    copy_in_->follow_current();
    beside.emplace(copy_in_->stream());
  }
  g.copy_master_to_slot();  // the local shard goes into its slot: the gather is in place
  u.gathered_version = g.master()._version();
  CollectiveOptions opts;
  opts.stream = StreamRole::AllGather;
  u.gather = shard_comm().all_gather(g.full(), g.full_slot(), opts);
  if (backward_active_) backward_gathers_.push_back(index);  // Note [Units a backward did not reach]
  beside.reset();
  account();
}

void Engine::unshard(int index) {
  Unit& u = *units_[index];
  if (u.group && !u.gathered && !u.gather) issue_gather(index);
  if (u.frozen_part >= 0) unshard(u.frozen_part);  // its gather issued behind ours
  if (!u.group || u.gathered) return;
  u.gather->wait();
  u.gather.reset();
  u.group->use_full_views();
  u.gathered = true;
}

void Engine::reshard(int index) {
  Unit& u = *units_[index];
  if (!u.group || u.group->persistent()) return;
  if (u.gather) {  // a prefetch nobody used: let it land before freeing its buffer
    u.gather->wait();
    u.gather.reset();
  }
  if (u.gathered) u.group->use_empty_views();
  u.group->free_full();
  u.gathered = false;
  if (u.frozen_part >= 0) reshard(u.frozen_part);
}

int Engine::gathered_non_root_units() const {
  int n = 0;
  for (std::size_t i = 1; i < units_.size(); ++i) {
    if (units_[i]->owner < 0 && units_[i]->group && units_[i]->group->full_allocated()) ++n;
  }
  return n;
}

int Engine::num_units() const {
  return static_cast<int>(
      std::count_if(units_.begin(), units_.end(), [](const auto& u) { return u->owner < 0; }));
}

// Note [Prefetch bound]
// A prefetch is issued only while fewer than prefetch + 1 non-root units are gathered,
// so with resharding after forward at most prefetch + 1 units besides the root hold
// gathered buffers at any time. A gather the schedule needs now is never skipped.
void Engine::prefetch(int index) {
  Unit& u = *units_[index];
  if (!u.group || u.gathered || u.gather) return;
  // With find_unused_parameters a unit whose parameter some ranks left unused stays gathered
  // on those ranks until backward ends, so in backward the count differs across ranks: the
  // bound would prefetch on some and not on others, and their gathers would go out of step
  // (Note [Units a backward did not reach]). There every rank prefetches.
  const bool bounded = !(backward_active_ && orders_reductions());
  if (bounded && reshard_after_forward_ && gathered_non_root_units() >= options_.prefetch + 1) return;
  issue_gather(index);
  const int frozen = u.frozen_part;
  if (frozen >= 0 && !units_[frozen]->gathered && !units_[frozen]->gather) issue_gather(frozen);
}

// --- forward --------------------------------------------------------------------

void Engine::pre_forward(int index) {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  if (index == kRoot && backward_failed()) abandon_backward();  // Note [A backward that failed]
  if (index == kRoot) check_frozen_unchanged();
  // A backward that failed midway did not wait for its steps (Note [Offloaded steps beside
  // backward]): no gather reads a master while one may still be stepped.
  if (!steps_beside_.empty()) finish_steps_beside_backward();
  Unit& u = *units_[index];
  if (replicated_) {
    refresh_replicas();
    start_neighbor_exchange();
    if (options_.broadcast_buffers && world_size_ > 1) {
      for (auto& b : buffers_) comm_->broadcast(b, 0).wait();
    }
    return;
  }
  if (!order_recorded_ && index != kRoot && u.forward_position < 0) {
    u.forward_position = static_cast<int>(forward_order_.size());
    forward_order_.push_back(index);
  }
  // Note [Masters written while gathered]: a unit can stay gathered across a write to its
  // master (the root after a forward without grad, then load_sharded or load_hf): its
  // parameters hold the values gathered before. The write moved the master's version;
  // such a unit is gathered again.
  for (int part : {index, u.frozen_part}) {
    if (part < 0) continue;
    Unit& p = *units_[part];
    if (p.group && (p.gathered || p.gather) && p.group->master()._version() != p.gathered_version)
      reshard(part);
  }
  unshard(index);
  if (order_recorded_ && u.forward_position >= 0) {
    for (int k = 1; k <= options_.prefetch; ++k) {
      const int next = u.forward_position + k;
      if (next < static_cast<int>(forward_order_.size())) prefetch(forward_order_[next]);
    }
  }
}

std::vector<at::Tensor> Engine::post_forward(int index, std::vector<at::Tensor> outputs) {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  if (index == kRoot) order_recorded_ = true;
  if (!at::GradMode::is_enabled()) {  // no backward will come: free now
    units_[index]->watching.reset();
    if (index != kRoot) reshard(index);
    return outputs;
  }
  if (reshard_after_forward_ && index != kRoot) reshard(index);
  std::shared_ptr<InputWatch> forward = std::move(units_[index]->watching);  // Note [Inputs by forward]
  for (auto& t : outputs) {
    if (t.defined() && t.requires_grad()) {
      t.register_hook([this, index, forward](const at::Tensor&) { output_grad_ready(index, forward); });
    }
  }
  return outputs;
}

// --- backward -------------------------------------------------------------------

void Engine::pre_backward(int index) {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  abandon_if_its_graph_is_gone();
  if (!backward_active_) {
    backward_active_ = true;
    // Note [A backward that failed]: the token lives as long as the backward's graph task
    // holds this callback, which a backward that fails drops without running it.
    auto token = std::make_shared<char>(0);
    backward_token_ = token;
    torch::autograd::Engine::get_default_engine().queue_callback([this, token] { end_of_backward(); });
    if (step_begins_) {  // Note [Parameters without gradients]: the first backward since the gradients went
      for (auto& flags : got_grad_) std::fill(flags.begin(), flags.end(), 0);
      step_begins_ = false;
    }
  }
  Unit& u = *units_[index];
  if (u.pre_backward_done) return;  // several outputs: once per backward
  u.pre_backward_done = true;
  if (!u.group) return;
  if (u.group->persistent()) {
    FlatParamGroup& g = *u.group;
    // NoShard without mixed precision keeps its gradient in the flat gradient: it starts
    // from zero unless an earlier backward's is still there (no zero_grad, or no_sync).
    if (g.master_aliases_full()) {
      if (g.full_grad_allocated() && !accumulating_ && !g.master().grad().defined()) g.full_grad().zero_();
      g.allocate_full_grad();
    }
    // Buckets' gradient buffers are allocated as their first gradients arrive.
    g.use_grad_views();
    account();
    std::fill(pending_.begin(), pending_.end(), 0);
    for (auto& slot : g.slots()) {
      if (slot.accumulator) ++pending_[segment_of_param_[slot.id]];
    }
    std::fill(used_.begin(), used_.end(), false);
    next_segment_ = 0;
    fresh_grad_ = false;
    return;
  }
  unshard(index);
  if (u.group->trains()) {          // Note [Frozen units]
    u.group->allocate_full_grad();  // kept, not zeroed, while accumulating under no_sync
    u.group->use_grad_views();
  }
  account();
  u.pending_grads = 0;
  for (auto& slot : u.group->slots()) u.pending_grads += slot.accumulator ? 1 : 0;
  if (u.forward_position >= 0) {
    for (int k = 1; k <= options_.prefetch; ++k) {
      const int prev = u.forward_position - k;
      if (prev >= 0) prefetch(forward_order_[prev]);
    }
  }
}

void Engine::on_grad_accumulated(int index, int param, bool arrived) {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  abandon_if_its_graph_is_gone();  // Note [A backward that failed]
  Unit& u = *units_[index];
  if (!u.pre_backward_done) {
    // The gradient reached a parameter before its unit's outputs did (a parameter used
    // outside its unit's forward: a learnable temperature on the logits). It landed in a
    // fresh tensor, which pre_backward's pointing of every .grad() at its flat view would
    // drop: it is kept and added into its view (allocated here if its bucket has none yet).
    auto& slots = u.group->slots();
    int k = 0;
    while (k < static_cast<int>(slots.size()) && slots[static_cast<std::size_t>(k)].id != param) ++k;
    const at::Tensor early =
        k < static_cast<int>(slots.size()) ? slots[static_cast<std::size_t>(k)].param.grad() : at::Tensor();
    pre_backward(index);
    if (early.defined()) {
      slots[static_cast<std::size_t>(k)].param.mutable_grad() = early;
      fold_strays(*u.group, k, k + 1);
    }
  }
  if (!arrived) {  // no gradient: the unit stops waiting for it, and the parameter is not stepped
    if (!replicated_) {
      --u.pending_grads;
      post_backward_if_done(index);
    }
    return;
  }
  got_grad_[index][param] = 1;
  if (!replicated_) {
    --u.pending_grads;
    post_backward_if_done(index);
    return;
  }
  if (used_[param]) return;  // counted once per backward
  used_[param] = true;
  FlatParamGroup& g = *u.group;
  const int s = segment_of_param_[param];
  if (!g.segment_grad_allocated(s)) {
    // The bucket's first gradient (it landed in a tensor of its own): the bucket gets its
    // buffer now, and the rest of its gradients accumulate there in place.
    g.allocate_segment_grad(s);
    fold_strays(g, g.segments()[s].first_slot, g.segments()[s].end_slot);
  }
  if (!rebuilt_ && !arrival_recorded_) arrival_.push_back(param);
  --pending_[s];
  // The first synced backward reduces nothing until it has laid the buckets out again.
  if (!no_sync_ && rebuilt_) launch_ready_segments();
}

// Note [Partly frozen units]
// A unit whose parameters are partly frozen (a block of frozen base weights with low-rank
// adapters beside them, as PEFT's LoRA writes it) keeps its frozen parameters in a part of
// their own: a second flat group, gathered right behind the unit's and resharded with it,
// that is never reduced, so that the gradient buffer, the reduce-scatter, the gradient
// shard and the optimizer state cover the trained parameters only, as under FSDP2. The
// part is a unit without a driver (`owner` names the unit it belongs to); shards() lists
// it after its owner. A unit built into shards and frozen in part afterwards is laid out
// again when it is adopted (Note [Built units frozen afterwards] in engine_setup.cpp).
// The gradients of a unit's trained parameters may all arrive before its backward is
// done: autograd runs the nodes made last first, and a product with a frozen weight that
// was made before the adapters' (whose result only flows back to the unit's input) runs
// after their gradients are in. So a unit holding frozen parameters (partly or wholly
// frozen) also waits for the gradients of the tensors its forward got (hooks on them,
// which fire once every node that used them has run; Note [Inputs by forward]) before it
// is resharded; one whose inputs need no gradient has no frozen node left to run once its
// parameters' gradients are in. A wholly frozen unit is then resharded as soon as its backward is done, not
// at the end of backward. The units' forwards get their leaves as aliases (Note [Watching a unit's inputs]),
// so the hooks are on tensors of the graph.
bool Engine::watches_inputs(int index) const {
  return units_[index]->waits_for_inputs && at::GradMode::is_enabled();
}

// Note [Inputs by forward]
// A unit may run forward several times before a backward (micro-batches whose forwards
// all run first, a block used twice), and a backward may reach any of those forwards'
// graphs, some of them, or one again (retain_graph). So each forward counts its own watched
// inputs, and a backward waits for the inputs of the forwards whose outputs it reached
// (the output's hook names its forward), counted in this backward only. One count over
// every forward would wait for inputs no backward reaches, or, after a backward reset it,
// not wait for the inputs of a forward that ran before that backward: the unit would be
// resharded while a frozen weight's product of that forward is still to run.
void Engine::watch_inputs(int index, const std::vector<at::Tensor>& inputs) {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  Unit& u = *units_[index];
  u.watching.reset();
  if (!watches_inputs(index)) return;
  auto forward = std::make_shared<InputWatch>();
  for (const at::Tensor& t : inputs) {
    if (!t.requires_grad()) continue;
    ++forward->inputs;
    at::Tensor watched = t;
    // The graph owns the hook, and the hook this forward's count (not the unit).
    watched.register_hook([this, index, forward](const at::Tensor&) { input_grad_ready(index, *forward); });
  }
  if (forward->inputs > 0) u.watching = std::move(forward);
}

void Engine::output_grad_ready(int index, const std::shared_ptr<InputWatch>& forward) {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  abandon_if_its_graph_is_gone();  // before this forward is awaited: abandoning forgets what was
  Unit& u = *units_[index];
  if (forward && std::find(u.awaited.begin(), u.awaited.end(), forward) == u.awaited.end()) {
    u.awaited.push_back(forward);
    // A unit that trains nothing is done as soon as the inputs of the forwards reached so
    // far have their gradients, which may come before this backward reaches another of its
    // forwards (the unit called twice, two forwards' losses summed): it is gathered again
    // for this one. A unit that trains waits for its parameters' gradients, which come
    // only once every forward this backward reaches is done.
    if (u.post_backward_done && u.group && !u.group->trains()) {
      u.pre_backward_done = false;
      u.post_backward_done = false;
    }
  }
  pre_backward(index);
}

void Engine::input_grad_ready(int index, InputWatch& forward) {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  if (forward.backward != backwards_) {  // the first of its inputs in this backward
    forward.backward = backwards_;
    forward.arrived = 0;
  }
  ++forward.arrived;
  post_backward_if_done(index);
}

bool Engine::inputs_done(const Unit& u) const {
  return std::all_of(u.awaited.begin(), u.awaited.end(), [this](const std::shared_ptr<InputWatch>& f) {
    return f->backward == backwards_ && f->arrived >= f->inputs;
  });
}

void Engine::post_backward_if_done(int index) {
  const Unit& u = *units_[index];
  if (u.pre_backward_done && u.pending_grads == 0 && inputs_done(u)) post_backward(index);
}

// Note [Reductions in one order]
// A unit is reduced once its parameters' gradients are all in, which is the same moment on
// every rank when every rank uses the same parameters. With find_unused_parameters they
// may not: a unit holding a parameter that only some ranks' data reaches (a gate, a
// router) is done during backward on those ranks and only when backward ends on the
// others, so the ranks would issue their units' reduce-scatters in different orders, and
// the collectives would pair one unit's gradients with another's (silently, when the units
// are of one size). Holding a done unit back until the units before it in a fixed order
// are reduced is not enough: a rank waiting for a reduce-scatter that another rank only
// issues when its backward ends stops issuing the gathers that rank needs first. So under
// find_unused_parameters on more than one rank the sharded strategies reshard each unit
// when its backward is done, as always, but keep its gradient and reduce every unit when
// backward ends, in one order on every rank: the reverse of the first forward's, then the
// rest (the root last). The price is the units' full gradients held until backward ends, as
// DDP holds its whole gradient, and no reduction overlapping the backward.
bool Engine::orders_reductions() const {
  return options_.find_unused_parameters && !replicated_ && world_size_ > 1;
}

void Engine::reduce_in_order() {
  if (reduce_order_.empty()) {
    std::vector<char> placed(units_.size(), 0);
    const auto add = [&](int i) {
      if (placed[static_cast<std::size_t>(i)]) return;
      placed[static_cast<std::size_t>(i)] = 1;
      reduce_order_.push_back(i);
    };
    for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it) add(*it);
    for (int i = static_cast<int>(units_.size()) - 1; i >= 0; --i) add(i);
  }
  std::vector<char> waiting(units_.size(), 0);
  for (int i : deferred_reduces_) waiting[static_cast<std::size_t>(i)] = 1;
  deferred_reduces_.clear();
  for (int i : reduce_order_) {
    if (waiting[static_cast<std::size_t>(i)]) reduce(i);
  }
}

void Engine::post_backward(int index) {
  Unit& u = *units_[index];
  if (u.post_backward_done || !u.pre_backward_done) return;
  u.post_backward_done = true;
  if (!u.group) return;
  FlatParamGroup& g = *u.group;
  if (g.trains()) {  // Note [Frozen units]
    fold_strays(g, 0, static_cast<int>(g.slots().size()));
    g.drop_param_grads();
    if (!no_sync_) {
      if (orders_reductions()) {
        deferred_reduces_.push_back(index);  // Note [Reductions in one order]
      } else {
        reduce(index);
      }
    }
  }
  if (reshard_after_forward_ && index != kRoot) reshard(index);
}

// Note [Frozen units]
// A unit whose parameters all have requires_grad off (set before the wrapper is made: a
// fine-tuning's frozen embedding or lower blocks) is still gathered for backward when a
// gradient flows through it to earlier units, but it gets no gradient buffer, no
// reduce-scatter and no gradient shard, and the optimizer finds nothing to step (nor
// makes state for it), as under FSDP2; it is resharded once the gradients of its inputs
// are in. A unit with some parameters frozen puts them in a part of their own (Note
// [Partly frozen units]), built into shards or not (Note [Built units frozen afterwards]
// in engine_setup.cpp).

// Note [Freezing after wrapping]
// Which parameters are frozen decides the layout (a unit's frozen part, the replicated
// strategies' frozen group), the reductions and the optimizer's state, all made when the
// wrapper is. A parameter frozen afterwards would leave its unit or bucket waiting for a
// gradient that never comes; one unfrozen afterwards would never get one. FSDP2 follows
// such a change; here each forward compares every parameter's requires_grad with the
// layout (one flag per parameter) and refuses a change, before any collective, naming the
// parameter. The user freezes before wrapping, or wraps again (from a checkpoint) to
// change what trains.
void Engine::check_frozen_unchanged() const {
  for (const auto& u : units_) {
    if (!u->group) continue;
    for (const ParamSlot& slot : u->group->slots()) {
      const bool trained = slot.accumulator != nullptr;
      if (slot.param.requires_grad() == trained) continue;
      throw InvalidArgument(fmt::format(
          "flatshard::FullyShard::forward (rank {}/{}): parameter '{}' was {} after the model was wrapped; "
          "which parameters train is fixed when FullyShard lays the model out. Set requires_grad before "
          "wrapping; to change it mid-training, save a checkpoint, set it on a freshly built model, wrap "
          "that, and load the checkpoint",
          rank_, world_size_, slot.name,
          trained ? "frozen (requires_grad set to false)" : "unfrozen (requires_grad set to true)"));
    }
  }
}

// --- the rest -------------------------------------------------------------------

// Note [Step in backward]
// With an optimizer registered by step_in_backward, each unit's master shard steps as soon
// as its gradient shard is final (reduced, or landed on the host), and the gradient shard
// is freed at once: the fp32 gradients of all units never exist together. The arithmetic
// is the step's after backward (each shard steps independently); what it rules out is
// whatever needs every gradient first: clipping the global norm, and skipping a step for
// NaN/Inf.
void Engine::set_step_in_backward(optim::ShardOptimizer* optimizer) {
  finish_steps_beside_backward();
  step_in_backward_ = nullptr;
  shard_of_unit_.clear();
  if (!optimizer) return;
  const std::string who =
      fmt::format("flatshard::FullyShard::step_in_backward (rank {}/{})", rank_, world_size_);
  if (options_.nonfinite_grads != NonFiniteGrads::Ignore) {
    throw InvalidArgument(fmt::format(
        "{}: nonfinite_grads must be Ignore: a step in backward cannot be skipped once a unit has stepped",
        who));
  }
  if (options_.find_unused_parameters && world_size_ > 1) {
    throw InvalidArgument(fmt::format(
        "{}: find_unused_parameters combines the ranks' records of which parameters got a gradient when "
        "backward ends, but a unit stepping in backward steps before that, on this rank's record alone (a "
        "parameter only other ranks used would not step here); turn one of them off",
        who));
  }
  if (replicated_) {
    throw InvalidArgument(fmt::format(
        "{}: strategy {} keeps the whole model's gradient until backward ends (its buckets are laid out "
        "again after the first); step in backward under FullShard, ShardGradOp or HybridShard",
        who, to_string(options_.strategy)));
  }
  const auto mine = shards();
  const auto& theirs = optimizer->shards();
  bool same = mine.size() == theirs.size();
  for (std::size_t i = 0; same && i < mine.size(); ++i) same = mine[i].is_same(theirs[i]);
  if (!same) {
    throw InvalidArgument(fmt::format(
        "{}: the optimizer does not step this FullyShard's shards (it has {}, this has {}); make it over "
        "fsdp.shards()",
        who, theirs.size(), mine.size()));
  }
  shard_of_unit_.assign(units_.size(), -1);
  int next = 0;
  for (std::size_t i = 0; i < units_.size(); ++i) {
    if (units_[i]->group) shard_of_unit_[i] = next++;
  }
  step_in_backward_ = optimizer;
}

void Engine::step_now(int unit) {
  if (!step_in_backward_ || shard_of_unit_[unit] < 0) return;
  at::NoGradGuard no_grad;
  // Note [Parameters without gradients]: the unit steps before backward ends, on this
  // rank's own record of which of its parameters got a gradient.
  const auto shard = static_cast<std::size_t>(shard_of_unit_[unit]);
  auto& flags = params_with_grad_[shard];
  flags.clear();
  const auto& slots = units_[unit]->group->slots();
  if (std::any_of(slots.begin(), slots.end(), [&](const ParamSlot& s) { return !got_grad_[unit][s.id]; })) {
    for (const auto& s : slots) flags.push_back(got_grad_[unit][s.id]);
  }
  step_in_backward_->step_shard(shard);
  units_[unit]->group->master().mutable_grad().reset();
}

double Engine::clip_grad_norm(double max_norm, double norm_type) {
  if (!(norm_type > 0) || !(max_norm >= 0)) {  // NaN too
    throw InvalidArgument(fmt::format(
        "flatshard::FullyShard::clip_grad_norm (rank {}/{}): needs max_norm >= 0 and norm_type > 0 "
        "(2 for the Euclidean norm, infinity for the largest magnitude); got max_norm {} and "
        "norm_type {}",
        rank_, world_size_, max_norm, norm_type));
  }
  if (backward_failed()) {
    throw InvalidArgument(fmt::format(
        "flatshard::FullyShard::clip_grad_norm (rank {}/{}): the last backward failed midway and its "
        "gradients "
        "are partial; call zero_grad() (or run the next forward) first (Note [A backward that failed])",
        rank_, world_size_));
  }
  if (step_in_backward_) {
    throw InvalidArgument(
        fmt::format("flatshard::FullyShard::clip_grad_norm (rank {}/{}): the optimizer steps in backward "
                    "(step_in_backward), so no gradient is left to clip; clip without stepping in backward",
                    rank_, world_size_));
  }
  // Note [zero_grad after no_sync]: what backwards under no_sync left is not reduced yet,
  // and the shard gradients do not hold it: there would be nothing (or an older step's
  // gradient) to clip.
  const bool unreduced = !backward_active_ && std::any_of(units_.begin(), units_.end(), [&](const auto& u) {
    return u->group && (replicated_ ? accumulating_ : u->group->full_grad_allocated());
  });
  if (unreduced) {
    throw InvalidArgument(fmt::format(
        "flatshard::FullyShard::clip_grad_norm (rank {}/{}): the gradients accumulated under no_sync() are "
        "not reduced yet; clip after the backward that synchronizes (the first one outside no_sync())",
        rank_, world_size_));
  }
  std::vector<at::Tensor> grads;
  for (auto& u : units_) {
    if (u->group) grads.push_back(u->group->master().grad());
  }
  // One group's shards make the whole model once (the other groups hold the same); a
  // group of one rank (NoShard) holds all of it.
  return optim::clip_by_global_norm(grads, max_norm, shard_.size > 1 ? &shard_comm() : nullptr, norm_type);
}

bool Engine::backward_failed() const {
  // Set, with no backward running on this thread: its end never ran.
  return backward_active_ && torch::autograd::get_current_graph_task_id() == -1;
}

void Engine::abandon_if_its_graph_is_gone() {
  // A hook of a new backward (a graph kept from before the failure) meets one whose graph
  // task ended without running its end. A hook of a backward nested in the live one (the
  // reentrant grad of a recomputed unit, Note [Recomputation]) finds that one's task alive.
  if (backward_active_ && backward_token_.expired()) abandon_backward();
}

// Note [zero_grad after no_sync]
// Backwards under no_sync leave their gradients in the units' flat gradients (and, for the
// replicated strategies, their buckets), where the next backward adds to them. zero_grad
// drops them, as DDP's zero_grad clears the .grad its no_sync accumulated into: the
// flat gradients are freed, the parameters' .grad views dropped, and the record of which
// parameters got a gradient starts again with the next backward (Note [Parameters without
// gradients]), so a parameter only the dropped batches reached is not stepped.
void Engine::zero_grad() {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  if (backward_failed()) abandon_backward();  // Note [A backward that failed]
  bool dropped = false;
  for (auto& u : units_) {
    if (!u->group) continue;
    // The replicated strategies mark an accumulating flat gradient; the sharded ones free a
    // unit's full gradient once it is reduced, so one still there outside a backward holds
    // what backwards under no_sync left.
    const bool accumulated =
        !backward_active_ && (replicated_ ? accumulating_ : u->group->full_grad_allocated());
    if (accumulated) {
      u->group->drop_param_grads();
      u->group->free_full_grad();
      dropped = true;
    }
    u->group->master().mutable_grad().reset();
  }
  step_begins_ = true;  // Note [Parameters without gradients]: none has one now
  if (dropped) {
    accumulating_ = false;
    account();
  }
}

void Engine::gather_all() {
  if (replicated_) refresh_replicas();
  for (int i = 0; i < static_cast<int>(units_.size()); ++i) unshard(i);
}

void Engine::reshard_all() {
  for (int i = 0; i < static_cast<int>(units_.size()); ++i) reshard(i);
}

void Engine::account() {
  std::int64_t params = 0, grads = 0;
  for (auto& u : units_) {
    if (!u->group) continue;
    params += static_cast<std::int64_t>(u->group->full().storage().nbytes());
    grads += u->group->full_grad_bytes();
  }
  memory_.unsharded_param_bytes = params;
  memory_.unsharded_grad_bytes = grads;
  memory_.peak_unsharded_param_bytes = std::max(memory_.peak_unsharded_param_bytes, params);
  memory_.peak_unsharded_grad_bytes = std::max(memory_.peak_unsharded_grad_bytes, grads);
  peak_gathered_units_ = std::max(peak_gathered_units_, gathered_non_root_units());
}

ShardMemory Engine::memory() const {
  ShardMemory m = memory_;
  m.unsharded_param_bytes = 0;
  m.unsharded_grad_bytes = 0;
  m.grad_shard_bytes = 0;
  for (auto& u : units_) {
    if (!u->group) continue;
    m.unsharded_param_bytes += static_cast<std::int64_t>(u->group->full().storage().nbytes());
    m.unsharded_grad_bytes += u->group->full_grad_bytes();
    if (u->group->master().grad().defined()) m.grad_shard_bytes += u->group->master().grad().nbytes();
    m.bf16_copy_bytes += u->group->bf16_copy_bytes();
  }
  return m;
}

std::int64_t Engine::unit_bytes(bool root) const {
  std::int64_t bytes = 0;
  for (std::size_t i = root ? 0 : 1; i < (root ? 1 : units_.size()); ++i) {
    const Unit& u = *units_[i];
    if (u.owner >= 0) continue;  // counted with its owner
    std::int64_t unit = u.group ? u.group->full_bytes() : 0;
    if (u.frozen_part >= 0) unit += units_[u.frozen_part]->group->full_bytes();
    bytes = std::max(bytes, unit);
  }
  return bytes;
}

void Engine::reset_peaks() {
  account();
  memory_.peak_unsharded_param_bytes = memory_.unsharded_param_bytes;
  memory_.peak_unsharded_grad_bytes = memory_.unsharded_grad_bytes;
  peak_gathered_units_ = gathered_non_root_units();
}

std::vector<Communicator*> Engine::communicators() const {
  std::vector<Communicator*> all;
  for (Communicator* c : {comm_.get(), shard_comm_.get(), replica_comm_.get()}) {
    if (c) all.push_back(c);
  }
  return all;
}

void Engine::time_communication_waits(bool on) {
  for (Communicator* c : communicators()) c->time_waits(on);
}

CommunicationWait Engine::communication_wait() {
  CommunicationWait total;
  for (Communicator* c : communicators()) total += c->waited();
  return total;
}

PeerWait Engine::communication_wait_for_peers() {
  // Each communicator's split is a collective over its own ranks and refuses on all of them
  // alike: every communicator is asked before an error is rethrown, so that no group is
  // left waiting in a split that another group's refusal skipped (HybridShard).
  PeerWait total;
  std::exception_ptr refused;
  for (Communicator* c : communicators()) {
    try {
      total += c->waited_for_peers();
    } catch (const InvalidArgument&) {
      if (!refused) refused = std::current_exception();
    }
  }
  if (refused) std::rethrow_exception(refused);
  return total;
}

std::uint64_t Engine::bytes_sent() const {
  std::uint64_t total = 0;
  for (Communicator* c : communicators()) total += c->bytes_sent();
  return total;
}

void Engine::reset_communication_wait() {
  for (Communicator* c : communicators()) c->reset_waited();
}

}  // namespace flatshard::sharding
