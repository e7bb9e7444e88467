// The DDP engine: flat gradient buckets, launched in order as they fill during
// backward; shared with ZeroRedundancyOptimizer, which steps each bucket's slice.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/function.h>

#include "flatshard/ddp.h"
#include "flatshard/shard.h"

namespace flatshard::sharding {

struct DdpParam {
  std::string name;
  at::Tensor param;   // the module's own parameter
  at::Tensor master;  // fp32 master (mixed precision), else undefined
  std::shared_ptr<torch::autograd::Node> accumulator;
  std::vector<std::int64_t> shape;
  std::int64_t numel = 0;
  int bucket = -1;
  std::int64_t offset = 0;  // in its bucket, elements
  bool used = false;        // got a gradient in this backward
};

struct DdpBucket {
  std::vector<int> params;  // indices into DdpEngine::params()
  std::int64_t numel = 0;
  // numel rounded up to a multiple of the world size (zeros after numel), so that every
  // rank's slice has the same size: NCCL gathers and scatters only equal slices.
  std::int64_t padded_numel = 0;
  at::Tensor flat;         // compute dtype: the parameters are views of it
  at::Tensor grad;         // compute dtype: the parameters' .grad() are views of it
  at::Tensor master;       // fp32 masters (mixed precision)
  at::Tensor master_grad;  // their gradients
  int pending = 0;         // parameters whose gradient has not arrived this backward
  bool launched = false;
  std::optional<Work> work;
  at::Tensor reduce_buffer;  // what is being reduced, when it is not `grad`
};

class DdpEngine {
 public:
  // reduce_in_backward: false for ZeroRedundancyOptimizer without DDP, which reduces
  // in step() (the hooks then do nothing).
  DdpEngine(std::shared_ptr<torch::nn::Module> model, const World& world, const DDPOptions& options,
            bool reduce_in_backward = true);
  ~DdpEngine();

  void pre_forward();
  // Points every .grad() back at its bucket slice (see the .cpp).
  void adopt_grads();
  void on_grad_ready(int param);
  void set_no_sync(bool on) { no_sync_ = on; }
  void set_reduce(GradReduce reduce) { reduce_ = reduce; }
  GradReduce reduce() const { return reduce_; }

  std::vector<at::Tensor> optimizer_params() const;
  torch::nn::Module& model() { return *model_; }
  std::vector<DdpParam>& params() { return params_; }
  std::vector<DdpBucket>& buckets() { return buckets_; }
  // Fp32 values the optimizer steps (masters under mixed precision, else the flat
  // parameters) and their gradients, per bucket.
  at::Tensor step_values(int bucket) { return mixed() ? buckets_[bucket].master : buckets_[bucket].flat; }
  at::Tensor step_grads(int bucket) { return mixed() ? buckets_[bucket].master_grad : buckets_[bucket].grad; }
  bool mixed() const { return compute_dtype_ != at::kFloat; }
  // Runs every bucket's reduction now (for ZeroRedundancyOptimizer without a backward
  // through DDP's hooks) and waits.
  void reduce_all_now();
  Communicator& comm() { return *comm_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  c10::Device device() const { return device_; }
  // This rank's slice of bucket b (ZeroRedundancyOptimizer's share; equal on every rank).
  ShardRange slice(int bucket) const;
  // The parameter order the buckets were rebuilt in after the first synced backward
  // (parameter indices; empty before it), and restoring it before any backward (a run
  // resumed from a checkpoint then steps in the same buckets as the run that saved it).
  std::vector<int> rebuilt_order() const;
  void restore_order(const std::vector<int>& order);
  // Called after the first synced backward rebuilt the buckets (their layout changed).
  std::uint64_t layout_version() const { return layout_version_; }
  std::int64_t skipped_steps() const { return skipped_steps_; }
  // True once after a backward whose gradients were dropped for NaN/Inf (the
  // ZeroRedundancyOptimizer then skips its step).
  bool take_dropped() { return std::exchange(dropped_, false); }

 private:
  void build_buckets(const std::vector<int>& order);
  void launch(int bucket);
  void finish(int bucket);
  void end_of_backward();

  std::shared_ptr<torch::nn::Module> model_;
  int rank_, world_size_;
  DDPOptions options_;
  std::unique_ptr<Communicator> comm_;
  c10::Device device_{c10::kCPU};  // of every parameter, the buckets and the collectives
  at::ScalarType compute_dtype_ = at::kFloat;
  std::vector<DdpParam> params_;  // parameters that require grad, in registration order
  std::vector<at::Tensor> buffers_;
  std::vector<DdpBucket> buckets_;
  int next_launch_ = 0;  // buckets launch in index order on every rank
  bool backward_active_ = false;
  bool no_sync_ = false;
  GradReduce reduce_ = GradReduce::AllReduce;
  bool reduce_in_backward_ = true;
  bool rebuilt_ = false;      // bucket order rebuilt from the first backward's arrival order
  std::vector<int> arrival_;  // parameter indices in the order their gradients arrived
  std::uint64_t layout_version_ = 0;
  std::int64_t synced_backwards_ = 0;
  std::int64_t skipped_steps_ = 0;
  bool dropped_ = false;
};

}  // namespace flatshard::sharding
