// One unit's parameters as a flat buffer (see Note [Flat parameter layout]).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include "flatshard/shard.h"

namespace flatshard::sharding {

// Note [Flat parameter layout]
// A unit's parameters are concatenated, in registration order, into one flat buffer of
// `padded_numel` elements: numel rounded up so that it splits into world_size equal
// shards of a multiple of 16 bytes. Rank r owns [r * shard_numel, (r+1) * shard_numel).
// The padding is zero and stays zero (its gradient is zero).
//
// The module keeps its own parameter objects. Their data is swapped with set_data():
// views into `full` while the unit is gathered, empty tensors while it is sharded. The
// bytes of `full` are freed by resetting its storage's data pointer, so that views
// autograd saved for backward do not keep them alive; the storage object stays, and
// the next gather writes into it again.
struct ParamSlot {
  std::string name;  // the name under the root module
  at::Tensor param;  // the module's own parameter (same TensorImpl)
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;  // in the flat buffer, elements
  std::int64_t numel = 0;
  // The parameter's AccumulateGrad node: autograd holds it weakly; we keep it alive so
  // that our post-hook survives while the parameter is resharded.
  std::shared_ptr<torch::autograd::Node> accumulator;
  // The parameter's version counter once the group took it over: an in-place write to the
  // (empty) parameter afterwards changes it.
  std::int64_t version = 0;
};

class FlatParamGroup {
 public:
  // Where a group keeps what. The parameters may arrive on another device (the host):
  // they move to `compute` when the group takes them over.
  struct Placement {
    c10::Device compute{c10::kCPU};  // gathered buffer, flat gradient, the parameters' views
    bool offload = false;            // master shard and its gradient in host memory (CPU offload)
  };

  // Takes over `params` (name, parameter) in this order: copies this rank's slice of
  // their values into the master shard, and leaves them empty (the group starts sharded;
  // their old values are freed unless someone else holds them). `compute_dtype` is the
  // dtype of the gathered buffer and gradients.
  FlatParamGroup(std::string name, std::vector<std::pair<std::string, at::Tensor>> params, int world_size,
                 int rank, at::ScalarType compute_dtype, const Placement& placement);

  const std::string& name() const { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }
  int world_size() const { return static_cast<int>(padded_numel_ / shard_numel_); }
  int rank() const { return rank_; }
  c10::Device device() const { return full_.device(); }
  std::vector<ParamSlot>& slots() { return slots_; }
  std::int64_t numel() const { return numel_; }
  std::int64_t padded_numel() const { return padded_numel_; }
  std::int64_t shard_numel() const { return shard_numel_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }

  // fp32, shard_numel elements: what the optimizer updates. .grad() is the fp32 shard
  // gradient.
  at::Tensor& master() { return master_; }
  // compute dtype, padded_numel elements; bytes present only while allocated.
  at::Tensor& full() { return full_; }
  at::Tensor& full_grad() { return full_grad_; }
  // This rank's slot of `full`.
  at::Tensor full_slot() const { return full_.narrow(0, rank_ * shard_numel_, shard_numel_); }
  // The master shard is kept in host memory (page-locked when the compute device is a
  // GPU) and crosses to the compute device through staging copies (CPU offload). On a
  // CPU compute device the same path runs, host to host.
  bool offloaded() const { return offload_; }
  // Writes the master shard into this rank's slot of `full` (converting to the compute
  // dtype), on the current stream; from offloaded masters without blocking the host.
  void copy_master_to_slot();

  bool full_allocated() const;
  bool full_grad_allocated() const;
  void allocate_full();
  void free_full();
  void allocate_full_grad();  // zeroed
  void free_full_grad();
  std::int64_t full_bytes() const { return padded_numel_ * element_size_; }

  // Parameters become views of `full` (it must be allocated) / empty tensors.
  void use_full_views();
  void use_empty_views();
  // Each parameter's .grad() becomes its view of `full_grad`, so AccumulateGrad adds
  // in place; or is dropped.
  void use_grad_views();
  void drop_param_grads();

 private:
  std::string name_;
  std::vector<ParamSlot> slots_;
  int rank_;
  at::ScalarType compute_dtype_;
  bool offload_;
  std::int64_t element_size_;
  std::int64_t numel_ = 0;
  std::int64_t padded_numel_ = 0;
  std::int64_t shard_numel_ = 0;
  at::Tensor master_;
  at::Tensor full_;
  at::Tensor full_grad_;
};

}  // namespace flatshard::sharding
