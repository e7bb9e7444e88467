// The engine's internal parts, shared by its source files: the per-unit schedule state,
// a reduction in flight, the gradient hook, and the helpers the strategies share.
#pragma once

#include <algorithm>
#include <deque>
#include <functional>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/function_hook.h>

#include "sharding/engine.h"

namespace flatshard::sharding {

// Per-unit schedule state. Touched from the thread that runs forward and from the one
// that runs backward's hooks: the caller's thread on the CPU, a device thread on CUDA.
// The hook entry points hold hooks_mutex_.
struct Engine::Unit {
  std::string name;
  std::shared_ptr<FlatParamGroup> group;  // null for a unit without parameters
  UnitBase* declared = nullptr;           // null for the root unit
  std::unique_ptr<UnitHooks> driver;
  std::optional<Work> gather;  // an all-gather issued and not yet waited for
  bool gathered = false;       // parameters are views of the flat buffer
  // The master's version when its gather was issued (Note [Masters written while gathered]).
  std::int64_t gathered_version = -1;
  bool pre_backward_done = false;
  bool post_backward_done = false;
  int pending_grads = 0;      // parameters whose gradient has not been accumulated yet
  int forward_position = -1;  // index in forward_order_
  // Note [Partly frozen units]: the unit that holds this unit's frozen parameters, which
  // is gathered and resharded with it (-1: none); for that unit, the one it belongs to.
  int frozen_part = -1;
  int owner = -1;
  // The replicated strategies' frozen part: its master's version when the parameters were
  // last written from it (Note [Frozen parameters in the replicated strategies]).
  std::int64_t refreshed_version = 0;
  // The unit holds frozen parameters: its backward is done when its parameters' gradients
  // have arrived and its inputs' too (Note [Partly frozen units]). Each forward's inputs
  // are counted apart (Note [Inputs by forward]): `watching` is the forward running now
  // (from watch_inputs to post_forward), `awaited` those whose outputs this backward reached.
  bool waits_for_inputs = false;
  std::shared_ptr<InputWatch> watching;
  std::vector<std::shared_ptr<InputWatch>> awaited;
};

// One forward's watched inputs, and how many of them got their gradient in the backward
// numbered `backward` (the last that reached them).
struct Engine::InputWatch {
  int inputs = 0;
  std::int64_t backward = -1;
  int arrived = 0;
};

struct Engine::PendingReduce {
  int unit;
  std::optional<Work> work;
  // HybridShard: the shard group's reduce-scatter, which `work` (the all-reduce across the
  // groups) waits for on the device. Waited for too: a stream's wait does not carry the
  // producer's failure (Stream::wait_event), so an all-reduce of a shard that a lost peer
  // never filled would complete, and its garbage would be stepped.
  std::optional<Work> scatter;
  at::Tensor input;   // what is being reduce-scattered (owned until the work completes)
  at::Tensor output;  // this rank's reduced shard, in the reduce dtype
  bool input_is_full_grad = false;
  // A bucket of a replicated group (Note [Replicated strategies]): its index, and where
  // the reduced values go when they were not reduced in place (copied, or added to a
  // gradient an earlier backward left).
  int segment = -1;
  at::Tensor target;
  // A communication hook's collectives and what finishes them; under ShardOptimizerState
  // the hook averages the whole bucket (`input`), and this rank's slice of it is then
  // the output.
  std::vector<Work> hook_works;
  std::function<void()> hook_finish;
  std::int64_t slice_offset = 0, slice_numel = -1;
  std::shared_ptr<CommHook> hook;  // kept alive for hook_finish
  // HybridShard with a hook: the shard group's average (`output`) is still to be averaged
  // over the groups by the hook (Note [Hooks across shard groups]).
  bool hook_across_groups = false;
  bool add = false;
  // Note [Bounded staleness]: the reduction of an earlier step whose average this one
  // delivers in place of its own.
  std::unique_ptr<PendingReduce> stale;
};

// Note [Bounded staleness]: one bucket's reductions waiting to be applied, oldest first,
// and the staleness + 1 buffers their copies of the gradient take turns in (so that no step
// allocates, or faults in, a gradient's worth of memory).
struct Engine::Delayed {
  std::deque<std::unique_ptr<PendingReduce>> queue;
  std::vector<at::Tensor> inputs, outputs;
  std::int64_t count = 0;  // copies made so far
};

// Note [Copies beside compute]
// Under CPU offload on a GPU the copies between the host and the device run on two
// streams of their own, one per direction, so that they overlap the compute stream's
// kernels and each other (the bus carries both directions at once) instead of queuing
// between them:
//  - to the device, a gather's copy-in (the updated fp32 shard, converted on the device):
//    the copy stream first waits for what the compute stream has queued so far (the
//    gathered buffer was allocated there, and a kernel queued before may still use its
//    memory), then copies, converts and issues the gather, so that the compute stream's
//    wait for the gather (Engine::unshard) also waits for the copy;
//  - to the host, a reduced gradient: the copy stream waits for the compute stream (the
//    reduction is done there, or waited for there), and the device buffer is marked as
//    used by the copy stream, so that the caching allocator does not hand it out again
//    before the copy has read it.
// The end of backward waits for both copy streams and the compute stream before the host
// reads a gradient or the optimizer writes a master (Engine::land_offloaded_grads). A gather
// outside backward (an evaluation forward between backward and the step, or
// summon_full_params) queues copies from the host's masters that nothing waits for on the
// host (on the copy-in stream for the sharded strategies, on the compute stream where the
// replicated ones refresh their parameters): the optimizer's step and the checkpoint loads
// first wait for both streams (FullyShardBase::wait_for_shard_reads), or the host would
// write a master while its copy to the device is still queued, and the evaluation would see
// a mix of two steps' weights.
class CopyStream {
 public:
  explicit CopyStream(c10::Device device)
      : impl_(device.type()), device_(device), stream_(impl_.getStreamFromGlobalPool(device, false)) {}

  const c10::Stream& stream() const { return stream_; }
  // This stream waits for the work queued so far on the device's current stream.
  void follow_current() const {
    c10::Event queued(device_.type());
    queued.record(impl_.getStream(device_));
    queued.block(stream_);
  }
  // The caching allocator does not reuse t's memory before this stream's work queued up
  // to t's release is done.
  void keep_until_read(const at::Tensor& t) const {
    impl_.recordDataPtrOnStream(t.storage().data_ptr(), stream_);
  }
  void synchronize() const { stream_.synchronize(); }
  // An event after the work queued on this stream so far.
  std::shared_ptr<c10::Event> record() const {
    auto done = std::make_shared<c10::Event>(device_.type());
    done->record(stream_);
    return done;
  }

 private:
  c10::impl::VirtualGuardImpl impl_;
  c10::Device device_;
  c10::Stream stream_;
};

namespace detail {

// Adds a reduced shard into a shard gradient, or makes it the gradient when there is none.
inline void accumulate(at::Tensor& grad, at::Tensor reduced) {
  if (grad.defined()) {
    grad.add_(reduced);
  } else {
    grad = std::move(reduced);
  }
}

// Runs after AccumulateGrad has added a parameter's gradient into its flat view.
class AccumulatedHook final : public torch::autograd::FunctionPostHook {
 public:
  AccumulatedHook(Engine* engine, int unit, int param) : engine_(engine), unit_(unit), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    // AccumulateGrad runs, and its hooks fire, also for an undefined gradient: a parameter
    // a recomputed unit's second run left unused (Note [Parameters without gradients]).
    engine_->on_grad_accumulated(unit_, param_, !inputs.empty() && inputs[0].defined());
    return outputs;
  }

 private:
  Engine* engine_;
  int unit_;
  int param_;
};

// Adds gradients that did not land in their flat views (they reached a parameter before
// its unit's backward began, or before its bucket had a gradient buffer) into the flat
// gradient, and points the parameter's .grad() at its view.
inline void fold_strays(FlatParamGroup& g, int first_slot, int end_slot) {
  at::NoGradGuard no_grad;
  for (int i = first_slot; i < end_slot; ++i) {
    auto& slot = g.slots()[i];
    const at::Tensor grad = slot.param.grad();
    if (!grad.defined()) continue;
    auto view = g.slot_grad(slot);
    if (!view.defined()) {
      g.allocate_segment_grad(g.segment_of_slot(slot));
      view = g.slot_grad(slot);
    }
    if (grad.data_ptr() == view.data_ptr()) continue;
    view.add_(grad.reshape({-1}));
    slot.param.mutable_grad() = view.view(slot.shape);
  }
}

// Every rank's master slices of `g` laid out as its flat buffer (fp32, padded_numel
// elements), where the master lives: gathered over `comm` (the group's shard ranks) a
// segment at a time on the communicator's device; an offloaded master's segments cross to
// it and their gathers back to the host. The master itself when one rank holds it all.
// Collective.
at::Tensor gather_master_values(FlatParamGroup& g, Communicator& comm);

// Moves the frozen parameters (requires_grad off) out of `params`, keeping both in order,
// and returns them (Note [Partly frozen units], Note [Frozen parameters in the replicated
// strategies]).
inline std::vector<std::pair<std::string, at::Tensor>> take_frozen(
    std::vector<std::pair<std::string, at::Tensor>>& params) {
  const auto trained_end = std::stable_partition(params.begin(), params.end(),
                                                 [](const auto& p) { return p.second.requires_grad(); });
  std::vector<std::pair<std::string, at::Tensor>> frozen(std::make_move_iterator(trained_end),
                                                         std::make_move_iterator(params.end()));
  params.erase(trained_end, params.end());
  return frozen;
}

}  // namespace detail
}  // namespace flatshard::sharding
