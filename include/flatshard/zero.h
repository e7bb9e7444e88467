// ZeroRedundancyOptimizer (ZeRO-1): each rank keeps optimizer state for a balanced 1/N
// of the parameters, steps that slice, and all-gathers the updated parameters.
//
// With DDP (gradients all-reduced, or reduce-scattered, by DDP's buckets during backward):
//   flatshard::DistributedDataParallel<Net> ddp(model, world);
//   flatshard::ZeroRedundancyOptimizer opt(ddp, flatshard::optim::AdamWOptions{.lr = 1e-3});
// Without DDP (the optimizer reduces the gradients itself, through the same buckets, in step()):
//   flatshard::ZeroRedundancyOptimizer opt(model.ptr(), world, flatshard::optim::AdamWOptions{});
//
// The slice of each bucket a rank owns is shard_range(bucket numel, N, rank), so every
// rank holds state for 1/N of every bucket (within one element).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "flatshard/ddp.h"
#include "flatshard/optim.h"

namespace flatshard {

using OptimizerOptions = std::variant<optim::SGDOptions, optim::AdamOptions, optim::AdamWOptions>;

struct ZeroOptions {
  // Reduce-scatter gradients instead of all-reducing them (ZeRO-2 semantics: each rank
  // receives only the gradient slices it steps).
  bool reduce_scatter = false;
  // Without DDP: the buckets' sizes and the communicator.
  std::int64_t first_bucket_bytes = std::int64_t{1} << 20;
  std::int64_t bucket_bytes = std::int64_t{25} << 20;
  CommunicatorOptions comm{std::chrono::minutes(5), "zero"};
};

namespace sharding {
class DdpEngine;
}
namespace checkpoint::detail {
struct Access;
}

class ZeroRedundancyOptimizer {
 public:
  ZeroRedundancyOptimizer(DDPBase& ddp, const OptimizerOptions& optimizer, const ZeroOptions& options = {});
  ZeroRedundancyOptimizer(std::shared_ptr<torch::nn::Module> model, const World& world,
                          const OptimizerOptions& optimizer, const ZeroOptions& options = {});
  ~ZeroRedundancyOptimizer();

  // Reduces gradients (without DDP), steps this rank's slices, all-gathers parameters.
  void step();
  // Zeroes the gradients in place (they stay views of the buckets).
  void zero_grad();
  // Global norm over every rank's owned gradient slices; scales them; returns the norm.
  // Without DDP it reduces the gradients first (step() then does not again).
  double clip_grad_norm(double max_norm);

  // Bytes of optimizer state on this rank.
  std::int64_t state_bytes() const;
  // Bytes of optimizer state the unsharded optimizer would hold.
  std::int64_t full_state_bytes() const;
  std::int64_t largest_bucket_bytes() const;

  // The full optimizer state, keyed "<parameter name>.<state>" (exp_avg, exp_avg_sq,
  // momentum_buffer) plus "step", on rank `to` (empty elsewhere). A collective.
  std::map<std::string, at::Tensor> consolidated_state_dict(int to = 0);

 private:
  friend struct checkpoint::detail::Access;
  void ensure_slices();
  void reduce_if_standalone();
  // Optimizer state in parameter registration order (every rank gets it whole), and
  // back into this rank's slices: carries state across a bucket rebuild.
  std::vector<std::pair<std::string, at::Tensor>> state_by_parameter();
  void load_state_by_parameter(const std::vector<std::pair<std::string, at::Tensor>>& state,
                               std::int64_t steps);

  std::unique_ptr<sharding::DdpEngine> owned_engine_;  // without DDP
  sharding::DdpEngine* engine_;
  OptimizerOptions optimizer_options_;
  ZeroOptions options_;
  bool standalone_;
  bool reduced_ = false;  // without DDP: this step's gradients are reduced already
  std::uint64_t layout_version_ = 0;
  std::vector<at::Tensor> slices_;  // per bucket: this rank's slice of the values it steps
  // The layout slices_ was cut from: per parameter (bucket, offset), per bucket numel.
  std::vector<std::pair<int, std::int64_t>> places_;
  std::vector<std::int64_t> bucket_numels_;
  std::unique_ptr<optim::ShardOptimizer> optimizer_;
};

}  // namespace flatshard
