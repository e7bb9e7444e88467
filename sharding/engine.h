// The sharding engine: units, their flat groups, and the schedule of gathers,
// reshards and gradient reductions around forward and backward.
#pragma once

#include <algorithm>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "flatshard/comm_hooks.h"
#include "flatshard/communicator.h"
#include "flatshard/fully_shard.h"
#include "flatshard/stream.h"
#include "sharding/flat_param.h"

namespace flatshard::optim {
class ShardOptimizer;
}

namespace flatshard::sharding {

class CopyStream;  // engine_parts.h

// Note [One wrapper per model] (engine_setup.cpp): throws InvalidArgument when `model` was
// already wrapped (its wrapper alive, destroyed, or failed midway). Before anything else.
void refuse_a_second_wrapper(const std::shared_ptr<torch::nn::Module>& model, const World& world);

class Engine {
 public:
  torch::nn::Module& model() { return *model_; }
  Engine(std::shared_ptr<torch::nn::Module> model, const World& world, const FullyShardOptions& options);
  ~Engine();

  // Hooks (from UnitHooks drivers, the root wrapper and autograd).
  void pre_forward(int unit);
  std::vector<at::Tensor> post_forward(int unit, std::vector<at::Tensor> outputs);
  void pre_backward(int unit);
  // Note [Partly frozen units]: the tensors a unit's forward gets.
  bool watches_inputs(int unit) const;
  void watch_inputs(int unit, const std::vector<at::Tensor>& inputs);
  // `param`: the parameter's index in its group's slots when the group was made.
  void on_grad_accumulated(int unit, int param, bool arrived);  // arrived: the gradient is defined

  std::vector<at::Tensor> shards() const;
  std::vector<ShardLayout> layout() const;
  std::int64_t layout_version() const { return layout_version_; }
  const std::vector<char>& params_with_grad(std::size_t shard) const;
  // Note [Gathers behind the step]
  void segment_stepped(std::size_t shard, std::size_t segment);
  at::Tensor bf16_copy_for_step(std::size_t shard);
  void wait_for_shard_reads();  // FullyShardBase::wait_for_shard_reads
  void bf16_copy_written(std::size_t shard);
  double clip_grad_norm(double max_norm, double norm_type);
  // Note [Step in backward]; nullptr: step after backward, as usual.
  void set_step_in_backward(optim::ShardOptimizer* optimizer);
  bool steps_in_backward() const { return step_in_backward_ != nullptr; }
  // NoSync guards nest: syncing resumes when the outermost ends (as DDP's no_sync restores
  // the state it found).
  void set_no_sync(bool on) {
    no_sync_depth_ = on ? no_sync_depth_ + 1 : std::max(0, no_sync_depth_ - 1);
    no_sync_ = no_sync_depth_ > 0;
  }
  // Note [Communication hooks]
  void set_comm_hook(std::shared_ptr<CommHook> hook);
  const std::shared_ptr<CommHook>& comm_hook() const { return comm_hook_; }
  std::int64_t synced_backwards() const { return synced_backwards_; }
  // Also drops the averages waiting under staleness (Note [Bounded staleness]).
  void restore_synced_backwards(std::int64_t count);
  void zero_grad();
  bool backward_failed() const;  // Note [A backward that failed]
  void gather_all();
  void reshard_all();
  ShardMemory memory() const;
  int peak_gathered_units() const { return peak_gathered_units_; }
  std::int64_t skipped_steps() const { return skipped_steps_; }
  void reset_peaks();
  // The root and the declared units (Note [Partly frozen units]: not their frozen parts).
  int num_units() const;
  // The root unit's gathered bytes (root), or the largest other unit's.
  std::int64_t unit_bytes(bool root) const;
  Communicator& comm() { return *comm_; }
  // Bytes this rank has sent over every communicator of the engine.
  std::uint64_t bytes_sent() const;
  // Note [Communication wait], over every communicator of the engine.
  void time_communication_waits(bool on);
  CommunicationWait communication_wait();
  PeerWait communication_wait_for_peers();
  void reset_communication_wait();
  const ShardGroup& shard_group() const { return shard_; }
  Strategy strategy() const { return options_.strategy; }
  NonFiniteGrads nonfinite_grads() const { return options_.nonfinite_grads; }
  at::ScalarType param_dtype() const;
  // Note [Casting forward inputs]: MixedPrecision::param under cast_forward_inputs.
  std::optional<at::ScalarType> input_dtype() const {
    return options_.mixed_precision.cast_forward_inputs ? options_.mixed_precision.param : std::nullopt;
  }
  std::optional<at::ScalarType> output_dtype() const { return options_.mixed_precision.output; }
  // The replicated strategies' buckets (see FullyShardBase).
  std::vector<std::vector<std::string>> bucket_layout() const;
  std::vector<std::string> bucket_order() const;
  void restore_bucket_order(const std::vector<std::string>& names);
  static constexpr int kRoot = 0;
  // The options' choice, or the strategy's default (every strategy but ShardGradOp).
  static bool reshards_after_forward(const FullyShardOptions& options) {
    return !replicates(options.strategy) &&
           options.reshard_after_forward.value_or(options.strategy != Strategy::ShardGradOp);
  }
  // Note [Replicated strategies]: parameters kept gathered in one group of buckets.
  static bool replicates(Strategy s) { return s == Strategy::NoShard || s == Strategy::ShardOptimizerState; }

 private:
  struct Unit;
  struct InputWatch;
  struct PendingReduce;

  void unshard(int unit);
  void issue_gather(int unit);
  void reshard(int unit);
  void prefetch(int unit);
  void post_backward(int unit);
  void output_grad_ready(int unit, const std::shared_ptr<InputWatch>& forward);
  void input_grad_ready(int unit, InputWatch& forward);
  bool inputs_done(const Unit& u) const;
  void post_backward_if_done(int unit);
  // Note [Reductions in one order]
  bool orders_reductions() const;
  void reduce_in_order();
  // Note [Units a backward did not reach]
  void reduce_units_not_reached();
  void agree_on_units_reached();
  void reduce(int unit);
  void finish_pending_reduce();     // every one, waiting for each
  void finish_completed_reduces();  // those that have completed, without waiting
  void finish_first_reduce();
  // Note [Replicated strategies]
  // `unit_of`: each parameter's declared unit (0: none), for Note [Buckets keep units together].
  void make_replicated_group(std::vector<std::pair<std::string, at::Tensor>> params, at::ScalarType compute,
                             const FlatParamGroup::Placement& placement,
                             const std::unordered_map<const c10::TensorImpl*, int>& unit_of);
  std::vector<int> bucket_order_from_arrivals() const;
  std::vector<int> bucket_sizes(const std::vector<int>& ids) const;
  void launch_ready_segments();
  void reduce_segment(int segment);
  void start_bucket_reduction(PendingReduce& pending, int segment);
  void start_hook(PendingReduce& pending, int segment);
  void average_across_groups(PendingReduce& pending);
  void start_hook_across_groups(PendingReduce& pending);
  void finish_reduces_starting_hooks();
  // Note [Bounded staleness], Note [Decentralized training]
  void check_communication_options() const;
  void delay(PendingReduce& pending, int segment);
  void start_neighbor_exchange();
  void average_with_neighbors();
  void complete(PendingReduce& pending);
  // Waits for `pending`'s collectives (and its stale one's), using none of their results.
  static void wait_for_collectives(const PendingReduce& pending);
  static bool completed(const PendingReduce& pending);
  void rebuild_buckets(std::vector<int> order);
  void end_of_replicated_backward();
  void check_nonfinite();
  void check_frozen_unchanged() const;  // Note [Freezing after wrapping]
  void find_params_with_grad();
  FlatParamGroup& group_of_shard(std::size_t shard);  // shards()[shard]'s group
  void refresh_replicas();
  at::Tensor land(FlatParamGroup& g, const at::Tensor& reduced);
  void copy_to_host(const at::Tensor& host, const at::Tensor& reduced, bool pinned);
  void land_offloaded_grads();
  void wait_for_device_and_copies();  // the compute stream and the offload copies' streams
  // Note [Offloaded steps beside backward]
  void step_beside_backward(int unit, at::Tensor landing);
  void finish_steps_beside_backward();
  void end_of_backward();
  void abandon_backward();  // Note [A backward that failed]
  void abandon_if_its_graph_is_gone();
  void step_now(int unit);
  std::vector<Communicator*> communicators() const;  // the engine's, every one
  void account();
  int gathered_non_root_units() const;

  std::shared_ptr<torch::nn::Module> model_;
  int rank_;
  int world_size_;
  FullyShardOptions options_;
  bool reshard_after_forward_;
  std::unique_ptr<Communicator> comm_;  // every rank
  // Note [Shard groups]: the ranks a unit is sharded over, with their own communicator
  // when they are not the whole world (HybridShard), and the ranks holding the same
  // shard in the other groups (null when there is one group).
  ShardGroup shard_;
  std::unique_ptr<Communicator> shard_comm_;
  std::unique_ptr<Communicator> replica_comm_;
  Communicator& shard_comm() { return shard_comm_ ? *shard_comm_ : *comm_; }
  std::vector<std::unique_ptr<Unit>> units_;  // [0] is the root unit
  // The replicated strategies' declared units: hooks that only cast their inputs.
  std::vector<std::pair<UnitBase*, std::unique_ptr<UnitHooks>>> input_casts_;
  std::vector<int> forward_order_;     // non-root units in the order the first forward ran them
  std::vector<int> reduce_order_;      // Note [Reductions in one order]: every unit, in that order
  std::vector<int> deferred_reduces_;  // ... and those done in this backward, not yet reduced
  bool order_recorded_ = false;        // set after the first forward
  bool backward_active_ = false;       // between the first backward hook and the end callback
  // The units this backward gathered, in the order their gathers were issued (Note [Units a
  // backward did not reach]).
  std::vector<int> backward_gathers_;
  std::weak_ptr<void> backward_token_;  // ... held by its end callback (Note [A backward that failed])
  bool no_sync_ = false;
  int no_sync_depth_ = 0;          // NoSync guards alive
  c10::Device device_{c10::kCPU};  // the compute device: gathered units, collectives
  std::shared_ptr<BufferPool> host_buffers_;
  std::shared_ptr<CommHook> comm_hook_;  // null: the engine's own average
  std::vector<at::Tensor> buffers_;      // the model's buffers, on the compute device
  // Reductions issued and not yet finished, in issue order: at most one under the sharded
  // strategies (Note [One reduce-scatter in flight]); any number of buckets under the
  // replicated ones (Note [Queued bucket reductions]).
  std::deque<std::unique_ptr<PendingReduce>> in_flight_;
  // Note [Bounded staleness]: by bucket, the reductions of the last `staleness` synced
  // backwards, oldest first; whether this backward found none old enough to apply.
  struct Delayed;
  std::deque<Delayed> delayed_;  // a deque: Delayed does not move
  bool warming_up_ = false;
  // Note [Decentralized training]: the neighbours' parameters (the previous rank's, then
  // the next's), and their exchange while it runs.
  at::Tensor neighbors_;
  std::optional<Work> exchange_;
  // Reduced gradients copied (or being copied) to host memory under CPU offload
  // (Note [Offloaded gradients]): a unit's shard, which becomes or is added to its
  // master's gradient; or a bucket's slice, copied or added into `target`, its part of the
  // master's gradient (Note [Offloaded buckets]).
  // A bucket's entry without `landed` was copied straight into `target`: only the host's
  // wait for the device is left to do.
  struct Landing {
    int unit = 0;
    at::Tensor landed;
    at::Tensor target;
  };
  std::vector<Landing> landing_grads_;
  // Note [Copies beside compute]: under CPU offload on a GPU, the streams of the copies to
  // the device and to the host; null otherwise.
  std::unique_ptr<CopyStream> copy_in_, copy_out_;
  ShardMemory memory_;
  int peak_gathered_units_ = 0;
  std::int64_t synced_backwards_ = 0;
  std::int64_t backwards_ = 0;  // every backward that ended, under no_sync too (Note [Inputs by forward])
  std::int64_t skipped_steps_ = 0;
  optim::ShardOptimizer* step_in_backward_ = nullptr;
  // The replicated strategies (Note [Replicated strategies]).
  bool replicated_ = false;
  std::vector<std::string> param_names_;   // by parameter id (the group's first order)
  std::vector<std::int64_t> param_bytes_;  // in the compute dtype, by parameter id
  std::vector<int> segment_of_param_;      // by parameter id
  std::vector<bool> used_;                 // by parameter id: got a gradient this backward
  std::vector<int> pending_;               // by segment: gradients not yet accumulated
  int next_segment_ = 0;                   // segments are reduced in order on every rank
  std::vector<int> arrival_;               // parameter ids in the first backward's order
  std::vector<int> unit_of_param_;         // by parameter id: its declared unit (0: none)
  bool rebuilt_ = false;
  bool arrival_recorded_ = false;  // after the first backward
  bool accumulating_ = false;      // gradients of a backward under no_sync wait in the flat gradient
  bool fresh_grad_ = false;        // this backward made the master's gradient
  bool stale_ = false;             // the master shard changed since the parameters were refreshed
  std::int64_t master_version_ = 0;
  // Note [Gathers behind the step]: the all-gathers issued as the optimizer stepped each
  // bucket of the step under way.
  std::vector<Work> early_gathers_;
  // Note [Parameters without gradients]: by unit, by parameter id: got a gradient since
  // the gradients were last cleared; by shard, in layout order: which had, as of the last
  // synced backward (empty: every one).
  std::vector<std::vector<char>> got_grad_;
  std::vector<std::vector<char>> params_with_grad_;
  bool step_begins_ = true;           // the gradients were cleared: the next backward starts the record
  std::int64_t layout_version_ = 0;   // changes when layout() does
  std::vector<int> shard_of_unit_;    // unit -> index in shards(), -1 without parameters
  std::recursive_mutex hooks_mutex_;  // forward and backward hooks (see Engine::Unit)
  // Note [Offloaded steps beside backward]: the host thread that steps offloaded units
  // whose gradients have landed while backward goes on, and its steps not yet waited for.
  // Last, so that it is drained before anything it uses goes.
  std::unique_ptr<Stream> step_stream_;
  std::vector<Event> steps_beside_;
};

}  // namespace flatshard::sharding
