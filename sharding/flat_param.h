// One unit's parameters as a flat buffer (see Note [Flat parameter layout]).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include "flatshard/shard.h"

namespace flatshard::sharding {

// Note [Flat parameter layout]
// A group's parameters are concatenated, in the order given, into one flat buffer made
// of segments: a unit is one segment; the replicated strategies cut the whole model into
// several (DDP's gradient buckets), each reduced by its own collective. A segment's
// parameters are padded so that it splits into world_size equal slices of a multiple of
// 16 bytes; rank r owns slice r of every segment, and its master shard is those slices,
// one after the other (for one segment: [r * shard_numel, (r+1) * shard_numel) of the
// buffer). The padding is zero and stays zero (its gradient is zero).
//
// The module keeps its own parameter objects. Their data is swapped with set_data():
// views into `full` while the unit is gathered, empty tensors while it is sharded. The
// bytes of `full` are freed by resetting its storage's data pointer, so that views
// autograd saved for backward do not keep them alive; the storage object stays, and
// the next gather writes into it again.
struct ParamSlot {
  int id = 0;        // its index in the group as it was made (relayout keeps it)
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

// One segment of a group's flat buffer (Note [Flat parameter layout]).
struct FlatSegment {
  int first_slot = 0, end_slot = 0;  // its parameters: slots [first_slot, end_slot)
  std::int64_t offset = 0;           // in the flat buffer, elements
  std::int64_t numel = 0;            // its parameters' elements
  std::int64_t padded_numel = 0;     // world_size slices
  std::int64_t slice = 0;            // padded_numel / world_size
  std::int64_t master_offset = 0;    // where this rank's slice sits in the master shard
};

// Note [Reused host buffers]
// The CPU allocator hands big blocks back to the kernel when they are freed (glibc maps
// blocks above its threshold and unmaps them on free, and trims the top of its heap), so
// a buffer allocated and freed every step is faulted in again, 4 KiB page by page, every
// step: on the 33.6M-parameter GPT at 2 ranks, per rank per step, 28,000 page faults under
// ZeRO-1 (its bucket gradients and the shard gradients that zero_grad frees), 30,000
// under ZeRO-2 and 10,000 under full shard (gathered parameters, flat gradients, shard
// gradients): up to 15% of the communication-bound step. Two remedies, which add at most
// a bucket or a unit to the step's peak:
// - Host groups take those buffers from a pool. A freed block serves the next request it
//   fits (up to a quarter larger): within a forward or a backward, unit k's gathered
//   buffer becomes unit k+1's, bucket k's gradient bucket k+2's, and the last ones freed
//   in a step become the first ones taken in the next. The pool keeps at most two of the
//   engine's largest buffers (under shard-grad-op, every unit's gathered buffer, which it
//   holds from forward to the end of backward anyway), so what it keeps is taken again
//   before the step's peak at the start of backward (Note [Where the peak is] in
//   src/plan). Shard gradients are not kept: zero_grad frees them before the forward.
// - A block the pool cannot serve is allocated with advice to back it with 2 MiB pages
//   (MADV_HUGEPAGE, where transparent huge pages are enabled or on madvise): one fault
//   per 2 MiB instead of 512. The shard gradients take this path.
// On CUDA the caching allocator does all this already: device groups have no pool.
class BufferPool {
 public:
  explicit BufferPool(std::size_t limit) : limit_(limit) {}
  // A block of at least `bytes`, from the pool or from `allocator`; its size in *block_bytes.
  c10::DataPtr take(std::size_t bytes, c10::Allocator* allocator, std::size_t* block_bytes);
  // Keeps a block of `bytes` for a later take().
  void give(c10::DataPtr block, std::size_t bytes);
  std::size_t cached_bytes() const;

 private:
  struct Block {
    c10::DataPtr data;
    std::size_t bytes;
  };
  mutable std::mutex mutex_;
  std::deque<Block> free_;  // oldest first
  std::size_t cached_ = 0;
  std::size_t limit_;
};

class FlatParamGroup {
 public:
  // Where a group keeps what. The parameters may arrive on another device (the host):
  // they move to `compute` when the group takes them over.
  struct Placement {
    c10::Device compute{c10::kCPU};  // gathered buffer, flat gradient, the parameters' views
    bool offload = false;            // master shard and its gradient in host memory (CPU offload)
    // The parameters stay gathered for the group's life (the replicated strategies): the
    // flat buffer is allocated once and never freed. The master shard then aliases it when
    // one rank holds the whole group in fp32 on the compute device (DDP without mixed
    // precision: the optimizer steps the parameters themselves).
    bool persistent = false;
    // Under offload with a bf16 compute dtype: keep the master's bf16 copy (Note [The bf16
    // copy of an offloaded master]).
    bool bf16_copy = false;
  };

  // Takes over `params` (name, parameter) in this order: copies this rank's slice of
  // their values into the master shard, and leaves them empty (the group starts sharded;
  // their old values are freed unless someone else holds them), or, when persistent, views
  // of the gathered buffer. `compute_dtype` is the dtype of the gathered buffer and
  // gradients. `segment_sizes`: parameters per segment, in order (empty: one segment).
  FlatParamGroup(std::string name, std::vector<std::pair<std::string, at::Tensor>> params, int world_size,
                 int rank, at::ScalarType compute_dtype, const Placement& placement,
                 const std::vector<int>& segment_sizes = {});

  const std::string& name() const { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }
  int world_size() const { return static_cast<int>(padded_numel_ / shard_numel_); }
  int rank() const { return rank_; }
  c10::Device device() const { return full_.device(); }
  std::vector<ParamSlot>& slots() { return slots_; }
  const std::vector<ParamSlot>& slots() const { return slots_; }
  // Whether any parameter requires grad (has an accumulator): a group that trains nothing
  // gets no gradient buffer and no reduction (Note [Frozen units] in sharding/engine.cpp).
  bool trains() const {
    for (const auto& s : slots_) {
      if (s.accumulator) return true;
    }
    return false;
  }
  // Drops the accumulators of parameters frozen (requires_grad off) since the group was
  // made: a unit built into shards takes them while its parameters all still require grad.
  void forget_frozen() {
    for (auto& s : slots_) {
      if (!s.param.requires_grad()) s.accumulator.reset();
    }
  }
  const std::vector<FlatSegment>& segments() const { return segments_; }
  bool persistent() const { return persistent_; }
  // The master shard is the flat buffer itself (see Placement::persistent).
  bool master_aliases_full() const { return aliased_; }
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
  // Segment s's flat gradient. A persistent group whose master does not alias the buffer
  // keeps one gradient buffer per segment, allocated when the segment's first gradient
  // arrives (allocate_segment_grad) and freed as soon as the segment is reduced
  // (free_segment_grad): the model's whole gradient never exists at once.
  at::Tensor segment_grad(int s) const {
    return segmented_grads_ ? segment_grads_[s] : segment_of(full_grad_, s);
  }
  // A slot's flat gradient (wherever its segment keeps it; undefined while it has none).
  at::Tensor slot_grad(const ParamSlot& slot) const;
  bool segment_grad_allocated(int s) const { return !segmented_grads_ || segment_grads_[s].defined(); }
  // Allocates segment s's gradient (zeroed) if it has none, and points its parameters'
  // .grad() into it.
  void allocate_segment_grad(int s);
  void free_segment_grad(int s);
  int segment_of_slot(const ParamSlot& slot) const;
  // Bytes of flat gradient allocated now.
  std::int64_t full_grad_bytes() const;
  // Segment s of `full` (or of `full_grad`), this rank's slice of it, and where that
  // slice sits in the master shard (or in any tensor laid out like it).
  at::Tensor segment_of(const at::Tensor& flat, int s) const {
    return flat.narrow(0, segments_[s].offset, segments_[s].padded_numel);
  }
  at::Tensor slot_of(const at::Tensor& flat, int s) const {
    return flat.narrow(0, segments_[s].offset + rank_ * segments_[s].slice, segments_[s].slice);
  }
  at::Tensor master_part(const at::Tensor& shard, int s) const {
    return shard.narrow(0, segments_[s].master_offset, segments_[s].slice);
  }
  // This rank's slot of `full` (a group of one segment).
  at::Tensor full_slot() const { return slot_of(full_, 0); }
  // The master shard is kept in host memory (page-locked when the compute device is a
  // GPU) and crosses to the compute device through staging copies (CPU offload). On a
  // CPU compute device the same path runs, host to host.
  bool offloaded() const { return offload_; }
  // Offloaded next to a GPU: the master and its gradient are page-locked, and copies to and
  // from them do not block the host.
  bool pinned() const { return pinned_; }
  // Writes the master shard into this rank's slots of `full` (converting to the compute
  // dtype), on the current stream; from offloaded masters without blocking the host, and
  // from the master's bf16 copy while that is current. Nothing to do when the master
  // aliases `full`. `segment` >= 0: that segment's slot only.
  void copy_master_to_slot(int segment = -1);
  // Note [The bf16 copy of an offloaded master]: an offloaded group with a bf16 compute
  // dtype (and Placement::bf16_copy) keeps the master rounded to bf16 in host memory.
  // bf16_copy_for_step() makes it current (allocating it, or converting the master when
  // the master changed since) and returns it for the optimizer to write as it steps (an
  // undefined tensor for a group without one); bf16_copy_written() says the optimizer
  // wrote master and copy alike. Current while the master's version is what it was then.
  at::Tensor bf16_copy_for_step();
  void bf16_copy_written();
  bool bf16_copy_current() const;
  std::int64_t bf16_copy_bytes() const { return bf16_copy_.defined() ? bf16_copy_.nbytes() : 0; }
  // An uninitialized fp32 tensor of shard_numel elements where the master shard lives,
  // for its gradient: host memory (page-locked with the master) under offload, else the
  // compute device (from the pool on the host).
  at::Tensor empty_master_grad();
  // Persistent groups: lays the parameters out again in `order` (slot indices) with new
  // segments, keeping their values, the unreduced gradient and the master shard's
  // identity (the optimizer's tensor; its gradient is dropped). `master_values`: every
  // rank's master slices in the old layout (fp32, padded_numel; unused when the master
  // aliases the buffer), from which this rank's new slices are cut. DDP's bucket rebuild.
  void relayout(const std::vector<int>& order, const std::vector<int>& segment_sizes,
                const at::Tensor& master_values);

  bool full_allocated() const;
  bool full_grad_allocated() const;
  void allocate_full();
  void free_full();
  void allocate_full_grad();  // zeroed
  void free_full_grad();
  std::int64_t full_bytes() const { return padded_numel_ * element_size_; }

  // Host groups: gathered buffers and flat gradients come from and return to `pool`
  // (Note [Reused host buffers]).
  void set_pool(std::shared_ptr<BufferPool> pool) { pool_ = std::move(pool); }
  // An uninitialized tensor on the group's device, from the pool on the host.
  at::Tensor pooled_empty(std::int64_t numel, at::ScalarType dtype);
  // Gives `t`'s storage to the pool if nothing else holds it (a caller may still hold a
  // gradient: then it is left to the allocator).
  void release(at::Tensor t);

  // Parameters become views of `full` (it must be allocated) / empty tensors.
  void use_full_views();
  void use_empty_views();
  // Each parameter's .grad() becomes its view of `full_grad` (of its segment's gradient,
  // when that has one), so AccumulateGrad adds in place; or is dropped.
  void use_grad_views();
  void drop_param_grads();
  // The master shard's gradient becomes the flat gradient itself (master_aliases_full()).
  void alias_master_grad();

 private:
  // Offsets and segments for the slots in their current order; the sizes follow.
  void lay_out(const std::vector<int>& segment_sizes, int world_size);
  // `t`'s storage gets (gives up) its bytes, through the pool when there is one.
  void allocate_storage(const at::Tensor& t);
  void free_storage(const at::Tensor& t);
  at::Tensor zeros(std::int64_t numel);  // compute dtype and device
  // An uninitialized master-sized fp32 tensor with `options` (the master's place), or,
  // next to a GPU under offload, page-locked at its size (Note [Page-locked at its size]).
  at::Tensor master_sized(const at::TensorOptions& options) const;

  std::shared_ptr<BufferPool> pool_;

  std::string name_;
  std::vector<ParamSlot> slots_;
  int rank_;
  at::ScalarType compute_dtype_;
  bool offload_;
  bool pinned_ = false;    // offloaded next to a GPU: host states are page-locked
  at::Tensor grad_block_;  // pinned_: the block empty_master_grad hands out while free
  bool keeps_bf16_copy_ = false;
  at::Tensor bf16_copy_;                 // host (page-locked when pinned_), shard_numel bf16
  std::int64_t bf16_copy_version_ = -1;  // the master's version it was made at (-1: none)
  std::int64_t element_size_;
  std::int64_t numel_ = 0;
  std::int64_t padded_numel_ = 0;
  std::int64_t shard_numel_ = 0;
  std::vector<FlatSegment> segments_;
  bool persistent_ = false;
  bool aliased_ = false;
  bool segmented_grads_ = false;
  std::vector<at::Tensor> segment_grads_;  // segmented_grads_: per segment, undefined when freed
  at::Tensor master_;
  at::Tensor full_;
  at::Tensor full_grad_;
};

}  // namespace flatshard::sharding
