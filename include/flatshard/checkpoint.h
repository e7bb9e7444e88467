// Checkpoints: full state dicts that Python's torch.load reads, written atomically.
//
//   auto state = flatshard::checkpoint::full_state_dict(fsdp, *model);   // a collective
//   if (world.rank() == 0) flatshard::checkpoint::save_tensors(state, "model.pt");
//   # python: torch.load("model.pt", weights_only=True) -> {name: tensor}
//
// A file is written to a temporary name beside it, flushed to disk (fsync), renamed
// over the target and the directory synced: after a crash the path holds either the
// old complete file or the new complete one. See docs/checkpoints.md.
#pragma once

#include <map>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "flatshard/ddp.h"
#include "flatshard/errors.h"
#include "flatshard/fully_shard.h"
#include "flatshard/optim.h"

namespace flatshard::checkpoint {

// Saving or loading failed: the path, the system's reason and what to do. A failed
// save leaves the previous file at the path untouched.
class CheckpointError : public Error {
 public:
  CheckpointError(std::string path, const std::string& message) : Error(message), path_(std::move(path)) {}
  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
};

// The model's parameters (under their own names) and buffers, at full size and in the
// parameters' dtype, on rank `to` (every rank when to == -1; empty elsewhere). A
// collective: every rank calls it.
std::map<std::string, at::Tensor> full_state_dict(FullyShardBase& fsdp, torch::nn::Module& model, int to = 0);
std::map<std::string, at::Tensor> full_state_dict(DDPBase& ddp, torch::nn::Module& model, int to = 0);

// The optimizer's state over FullyShard's shards, consolidated: "<parameter>.<state>"
// (exp_avg, exp_avg_sq, momentum_buffer) at the parameter's shape, plus "step", on rank
// `to` (every rank when to == -1; empty elsewhere). A collective.
std::map<std::string, at::Tensor> full_optimizer_state_dict(FullyShardBase& fsdp,
                                                            const optim::ShardOptimizer& optimizer,
                                                            int to = 0);

// A dict of tensors in the format of torch.save, written atomically.
void save_tensors(const std::map<std::string, at::Tensor>& tensors, const std::string& path);
// Reads what save_tensors (or Python's torch.save of a dict of tensors) wrote.
std::map<std::string, at::Tensor> load_tensors(const std::string& path);

}  // namespace flatshard::checkpoint
