#include "sharding/flat_param.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/variable.h>

#include "src/errors.h"

namespace flatshard::sharding {
namespace {

void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == 0) return;
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

void allocate_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const std::size_t need = static_cast<std::size_t>((t.storage_offset() + t.numel()) * t.element_size());
  if (s->nbytes() >= need) return;
  FLATSHARD_ASSERT(s->allocator() != nullptr, "flat buffer storage has no allocator");
  s->set_data_ptr_noswap(s->allocator()->allocate(need));
  s->set_nbytes(need);
}

// A tensor of `numel` elements whose storage holds no bytes yet (allocate_storage gives
// it some).
at::Tensor unallocated(std::int64_t numel, const at::TensorOptions& options) {
  auto t = at::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  return t;
}

}  // namespace

FlatParamGroup::FlatParamGroup(std::string name, std::vector<std::pair<std::string, at::Tensor>> params,
                               int world_size, int rank, at::ScalarType compute_dtype,
                               const Placement& placement)
    : name_(std::move(name)),
      rank_(rank),
      compute_dtype_(compute_dtype),
      offload_(placement.offload),
      element_size_(static_cast<std::int64_t>(c10::elementSize(compute_dtype))) {
  for (auto& [pname, p] : params) {
    ParamSlot slot;
    slot.name = pname;
    slot.param = p;
    slot.shape = p.sizes().vec();
    slot.offset = numel_;
    slot.numel = p.numel();
    numel_ += p.numel();
    slots_.push_back(std::move(slot));
  }
  // Shards of a multiple of 16 bytes in the compute dtype (fp32 masters then are too).
  padded_numel_ = flatshard::padded_numel(numel_, world_size, std::max<std::int64_t>(1, 16 / element_size_));
  shard_numel_ = padded_numel_ / world_size;

  // Only this rank's slice is ever flattened: each parameter's overlap with the shard is
  // copied straight into the master, so no full-size buffer exists while a unit is taken
  // over (a unit built on the host reaches the device as its shard only).
  auto master_options =
      at::TensorOptions().dtype(at::kFloat).device(offload_ ? c10::kCPU : placement.compute);
  if (offload_ && placement.compute.is_cuda()) master_options = master_options.pinned_memory(true);
  master_ = at::zeros({shard_numel_}, master_options);
  {
    at::NoGradGuard no_grad;
    const std::int64_t begin = rank_ * shard_numel_, end = begin + shard_numel_;
    for (auto& s : slots_) {
      const std::int64_t lo = std::max(begin, s.offset), hi = std::min(end, s.offset + s.numel);
      if (lo >= hi) continue;
      master_.narrow(0, lo - begin, hi - lo)
          .copy_(s.param.detach().reshape({-1}).narrow(0, lo - s.offset, hi - lo));
    }
  }
  const auto compute_options = at::TensorOptions().dtype(compute_dtype_).device(placement.compute);
  full_ = unallocated(padded_numel_, compute_options);
  full_grad_ = unallocated(padded_numel_, compute_options);

  // The parameters take the compute dtype (and their shape, which autograd records for
  // the gradient) before their AccumulateGrad nodes are taken: a later set_data that
  // changed the dtype would replace those nodes. Then they give up their values.
  const auto one = at::empty({1}, compute_options);
  for (auto& s : slots_) {
    if (!s.param.requires_grad()) continue;
    s.param.set_data(one.expand(s.shape));
    s.accumulator = torch::autograd::impl::grad_accumulator(s.param);
  }
  use_empty_views();
  for (auto& s : slots_) s.version = s.param._version();
}

bool FlatParamGroup::full_allocated() const { return full_.storage().nbytes() > 0; }
bool FlatParamGroup::full_grad_allocated() const { return full_grad_.storage().nbytes() > 0; }
void FlatParamGroup::allocate_full() { allocate_storage(full_); }
void FlatParamGroup::free_full() { free_storage(full_); }

void FlatParamGroup::copy_master_to_slot() {
  at::NoGradGuard no_grad;
  auto slot = full_slot();
  if (!offload_ || compute_dtype_ == at::kFloat) {
    slot.copy_(master_, /*non_blocking=*/master_.is_pinned());
    return;
  }
  // fp32 to the device first (a page-locked source copies asynchronously), then convert
  // there: a converting copy from the host would convert on the host and block.
  auto staged = at::empty({shard_numel_}, at::TensorOptions().dtype(at::kFloat).device(full_.device()));
  staged.copy_(master_, /*non_blocking=*/master_.is_pinned());
  slot.copy_(staged);
}

void FlatParamGroup::allocate_full_grad() {
  if (full_grad_allocated()) return;
  allocate_storage(full_grad_);
  full_grad_.zero_();
}

void FlatParamGroup::free_full_grad() { free_storage(full_grad_); }

void FlatParamGroup::use_full_views() {
  for (auto& s : slots_) s.param.set_data(full_.narrow(0, s.offset, s.numel).view(s.shape));
}

void FlatParamGroup::use_empty_views() {
  for (auto& s : slots_) s.param.set_data(at::empty({0}, full_.options()));
}

void FlatParamGroup::use_grad_views() {
  for (auto& s : slots_) {
    if (s.param.requires_grad())
      s.param.mutable_grad() = full_grad_.narrow(0, s.offset, s.numel).view(s.shape);
  }
}

void FlatParamGroup::drop_param_grads() {
  for (auto& s : slots_) s.param.mutable_grad().reset();
}

}  // namespace flatshard::sharding
