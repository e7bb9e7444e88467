#include "sharding/flat_param.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/variable.h>

#include "optim/step_kernels.h"
#include "src/comm/in_flight.h"
#include "src/errors.h"
#include "src/memory/pinned_host.h"

namespace flatshard::sharding {
namespace {

// A tensor of `numel` elements whose storage holds no bytes yet (allocate_storage gives
// it some).
at::Tensor unallocated(std::int64_t numel, const at::TensorOptions& options) {
  auto t = at::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  return t;
}

// A tensor over `flat`'s storage that autograd does not treat as a view (a master shard
// aliasing the flat buffer must be a leaf the optimizer can give a gradient).
at::Tensor alias_of(const at::Tensor& flat) {
  return at::empty({0}, flat.options()).set_(flat.storage(), flat.storage_offset(), {flat.numel()}, {1});
}

// Asks the kernel to back the block's whole 2 MiB pages with huge pages when they are
// first touched: one fault per 2 MiB instead of 512 (Note [Reused host buffers]).
void advise_huge_pages(void* data, std::size_t bytes) {
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
  if (data == nullptr || bytes < 2 * kHuge) return;
  const auto begin = (reinterpret_cast<std::uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const auto end = (reinterpret_cast<std::uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // advice only
}

}  // namespace

c10::DataPtr BufferPool::take(std::size_t bytes, c10::Allocator* allocator, std::size_t* block_bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->bytes >= bytes && it->bytes <= bytes + bytes / 4 &&
          (best == free_.end() || it->bytes < best->bytes))
        best = it;
    }
    if (best != free_.end()) {
      c10::DataPtr data = std::move(best->data);
      *block_bytes = best->bytes;
      cached_ -= best->bytes;
      free_.erase(best);
      return data;
    }
  }
  *block_bytes = bytes;
  c10::DataPtr data = allocator->allocate(bytes);
  advise_huge_pages(data.get(), bytes);
  return data;
}

void BufferPool::give(c10::DataPtr block, std::size_t bytes) {
  if (block.get() == nullptr || bytes > limit_) return;  // freed here
  std::lock_guard<std::mutex> lock(mutex_);
  cached_ += bytes;
  free_.push_back(Block{std::move(block), bytes});
  while (cached_ > limit_) {
    cached_ -= free_.front().bytes;
    free_.pop_front();  // back to the allocator
  }
}

std::size_t BufferPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cached_;
}

void FlatParamGroup::allocate_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const std::size_t need = static_cast<std::size_t>((t.storage_offset() + t.numel()) * t.element_size());
  if (s->nbytes() >= need) return;
  FLATSHARD_ASSERT(s->allocator() != nullptr, "flat buffer storage has no allocator");
  std::size_t bytes = need;
  // The storage takes the block's whole size, so that it goes back to the pool whole.
  s->set_data_ptr_noswap(pool_ && t.is_cpu() ? pool_->take(need, s->allocator(), &bytes)
                                             : s->allocator()->allocate(need));
  s->set_nbytes(bytes);
}

void FlatParamGroup::free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const std::size_t bytes = s->nbytes();
  if (bytes == 0) return;
  const bool poison = comm::poison_freed();  // Note [Buffers a collective touches]
  if (poison && t.is_cpu()) std::memset(s->mutable_data(), 0xFF, bytes);
  c10::DataPtr old = s->set_data_ptr(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
  if (pool_ && t.is_cpu()) {
    pool_->give(std::move(old), bytes);
  } else if (!t.is_cpu()) {
    comm::InFlightBuffers::instance().retire(std::move(old), bytes, poison);
  }
}

at::Tensor FlatParamGroup::pooled_empty(std::int64_t numel, at::ScalarType dtype) {
  const auto options = full_.options().dtype(dtype);
  if (!pool_ || !full_.is_cpu()) return at::empty({numel}, options);
  at::Tensor t = unallocated(numel, options);
  allocate_storage(t);
  return t;
}

at::Tensor FlatParamGroup::zeros(std::int64_t numel) { return pooled_empty(numel, compute_dtype_).zero_(); }

void FlatParamGroup::release(at::Tensor t) {
  if (pool_ && t.defined() && t.is_cpu() && t.use_count() == 1 && t.storage().use_count() == 1 &&
      t.storage().resizable()) {
    free_storage(t);
  }
}

FlatParamGroup::FlatParamGroup(std::string name, std::vector<std::pair<std::string, at::Tensor>> params,
                               int world_size, int rank, at::ScalarType compute_dtype,
                               const Placement& placement, const std::vector<int>& segment_sizes)
    : name_(std::move(name)),
      rank_(rank),
      compute_dtype_(compute_dtype),
      offload_(placement.offload),
      element_size_(static_cast<std::int64_t>(c10::elementSize(compute_dtype))),
      persistent_(placement.persistent) {
  for (auto& [pname, p] : params) {
    ParamSlot slot;
    slot.id = static_cast<int>(slots_.size());
    slot.name = pname;
    slot.param = p;
    slot.shape = p.sizes().vec();
    slot.numel = p.numel();
    slots_.push_back(std::move(slot));
  }
  lay_out(segment_sizes, world_size);
  aliased_ = persistent_ && world_size == 1 && compute_dtype_ == at::kFloat && !offload_;
  segmented_grads_ = persistent_ && !aliased_;
  segment_grads_.resize(segments_.size());

  const auto compute_options = at::TensorOptions().dtype(compute_dtype_).device(placement.compute);
  full_ = unallocated(padded_numel_, compute_options);
  full_grad_ = unallocated(padded_numel_, compute_options);
  const auto master_options =
      at::TensorOptions().dtype(at::kFloat).device(offload_ ? c10::kCPU : placement.compute);
  pinned_ = offload_ && placement.compute.is_cuda();
  keeps_bf16_copy_ = offload_ && placement.bf16_copy && compute_dtype_ == at::kBFloat16;
  {
    at::NoGradGuard no_grad;
    if (persistent_) {
      // Gathered for good: the whole model's values go into the buffer.
      allocate_storage(full_);
      full_.zero_();
      for (auto& s : slots_) full_.narrow(0, s.offset, s.numel).copy_(s.param.detach().reshape({-1}));
    }
    if (aliased_) {
      master_ = alias_of(full_);
    } else {
      // Only this rank's slices are flattened: each parameter's overlap with them is
      // copied straight into the master (from the parameter, not from a converted buffer:
      // fp32 masters keep every bit), so no full-size buffer exists while a unit is taken
      // over (a unit built on the host reaches the device as its shard only).
      master_ = master_sized(master_options).zero_();
      for (std::size_t k = 0; k < segments_.size(); ++k) {
        const FlatSegment& seg = segments_[k];
        const std::int64_t begin = seg.offset + rank_ * seg.slice, end = begin + seg.slice;
        for (int i = seg.first_slot; i < seg.end_slot; ++i) {
          const ParamSlot& s = slots_[i];
          const std::int64_t lo = std::max(begin, s.offset), hi = std::min(end, s.offset + s.numel);
          if (lo >= hi) continue;
          master_.narrow(0, seg.master_offset + lo - begin, hi - lo)
              .copy_(s.param.detach().reshape({-1}).narrow(0, lo - s.offset, hi - lo));
        }
      }
    }
  }

  // The parameters take the compute dtype (and their shape, which autograd records for
  // the gradient) before their AccumulateGrad nodes are taken: a later set_data that
  // changed the dtype would replace those nodes. Then they give up their values (or
  // become views of the buffer for good).
  const auto one = at::empty({1}, compute_options);
  for (auto& s : slots_) {
    if (!s.param.requires_grad()) continue;
    s.param.set_data(one.expand(s.shape));
    s.accumulator = torch::autograd::impl::grad_accumulator(s.param);
  }
  if (persistent_) {
    use_full_views();
  } else {
    use_empty_views();
  }
  for (auto& s : slots_) s.version = s.param._version();
}

void FlatParamGroup::lay_out(const std::vector<int>& segment_sizes, int world_size) {
  std::vector<int> sizes = segment_sizes;
  if (sizes.empty()) sizes.push_back(static_cast<int>(slots_.size()));
  segments_.clear();
  numel_ = padded_numel_ = shard_numel_ = 0;
  int next = 0;
  for (int count : sizes) {
    FlatSegment seg;
    seg.first_slot = next;
    seg.end_slot = next + count;
    seg.offset = padded_numel_;
    for (int i = seg.first_slot; i < seg.end_slot; ++i) {
      slots_[i].offset = seg.offset + seg.numel;
      seg.numel += slots_[i].numel;
    }
    // Slices of a multiple of 16 bytes in the compute dtype (fp32 masters then are too).
    seg.padded_numel =
        flatshard::padded_numel(seg.numel, world_size, std::max<std::int64_t>(1, 16 / element_size_));
    seg.slice = seg.padded_numel / world_size;
    seg.master_offset = shard_numel_;
    numel_ += seg.numel;
    padded_numel_ += seg.padded_numel;
    shard_numel_ += seg.slice;
    next = seg.end_slot;
    segments_.push_back(seg);
  }
  FLATSHARD_ASSERT(next == static_cast<int>(slots_.size()), "segment sizes do not cover the group");
}

// One buffer at a time is laid out again (gradients, master, parameters), so that old and
// new copies of only one of them exist together.
void FlatParamGroup::relayout(const std::vector<int>& order, const std::vector<int>& segment_sizes,
                              const at::Tensor& master_values) {
  FLATSHARD_ASSERT(persistent_ && order.size() == slots_.size(),
                   "relayout of a group that is not persistent");
  at::NoGradGuard no_grad;
  const int world_size = this->world_size();
  const bool grads = full_grad_allocated();
  std::vector<at::Tensor> old_grads;  // each slot's gradient, in the old order (undefined: none)
  if (grads) {
    for (const auto& slot : slots_) old_grads.push_back(slot_grad(slot));
  }
  drop_param_grads();
  master_.mutable_grad().reset();
  bf16_copy_ = at::Tensor();  // the shard is laid out again; a new copy is made at the next step
  bf16_copy_version_ = -1;
  std::vector<ParamSlot> old = std::move(slots_);
  slots_.clear();
  for (int i : order) slots_.push_back(old[i]);
  lay_out(segment_sizes, world_size);

  full_grad_ = unallocated(padded_numel_, full_.options());
  segment_grads_.assign(segments_.size(), at::Tensor());
  if (grads) {
    allocate_full_grad();
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      if (old_grads[order[k]].defined()) slot_grad(slots_[k]).copy_(old_grads[order[k]]);
    }
    old_grads.clear();  // the old gradient buffers go now
    use_grad_views();
  }
  if (!aliased_) {
    // This rank's new slices, cut straight from the whole model's values in the old
    // layout (no permuted copy of the model is made).
    grad_block_ = at::Tensor();  // the shard's size may change
    auto shard = master_sized(master_.options()).zero_();
    for (const FlatSegment& seg : segments_) {
      const std::int64_t begin = seg.offset + rank_ * seg.slice, end = begin + seg.slice;
      for (int i = seg.first_slot; i < seg.end_slot; ++i) {
        const ParamSlot& slot = slots_[i];
        const std::int64_t lo = std::max(begin, slot.offset), hi = std::min(end, slot.offset + slot.numel);
        if (lo >= hi) continue;
        const std::int64_t before = old[order[i]].offset;
        shard.narrow(0, seg.master_offset + lo - begin, hi - lo)
            .copy_(master_values.narrow(0, before + lo - slot.offset, hi - lo));
      }
    }
    master_.set_data(shard);
  }
  auto full = at::zeros({padded_numel_}, full_.options());
  for (std::size_t k = 0; k < slots_.size(); ++k) {
    const ParamSlot& before = old[order[k]];
    full.narrow(0, slots_[k].offset, slots_[k].numel).copy_(full_.narrow(0, before.offset, before.numel));
  }
  full_.set_(full.storage(), 0, {padded_numel_}, {1});
  if (aliased_) master_.set_(full_.storage(), 0, {padded_numel_}, {1});
  use_full_views();
}

bool FlatParamGroup::full_allocated() const { return full_.storage().nbytes() > 0; }
bool FlatParamGroup::full_grad_allocated() const {
  if (!segmented_grads_) return full_grad_.storage().nbytes() > 0;
  return std::any_of(segment_grads_.begin(), segment_grads_.end(),
                     [](const at::Tensor& t) { return t.defined(); });
}

std::int64_t FlatParamGroup::full_grad_bytes() const {
  std::int64_t bytes = static_cast<std::int64_t>(full_grad_.storage().nbytes());
  for (const auto& t : segment_grads_) bytes += t.defined() ? static_cast<std::int64_t>(t.nbytes()) : 0;
  return bytes;
}

int FlatParamGroup::segment_of_slot(const ParamSlot& slot) const {
  const auto it =
      std::upper_bound(segments_.begin(), segments_.end(), slot.offset,
                       [](std::int64_t offset, const FlatSegment& seg) { return offset < seg.offset; });
  return static_cast<int>(it - segments_.begin()) - 1;
}

at::Tensor FlatParamGroup::slot_grad(const ParamSlot& slot) const {
  if (!segmented_grads_) return full_grad_.narrow(0, slot.offset, slot.numel);
  const int s = segment_of_slot(slot);
  if (!segment_grads_[s].defined()) return at::Tensor();
  return segment_grads_[s].narrow(0, slot.offset - segments_[s].offset, slot.numel);
}

void FlatParamGroup::allocate_segment_grad(int s) {
  if (!segmented_grads_ || segment_grads_[s].defined()) return;
  segment_grads_[s] = zeros(segments_[s].padded_numel);
  for (int i = segments_[s].first_slot; i < segments_[s].end_slot; ++i) {
    auto& slot = slots_[i];
    if (slot.param.requires_grad() && !slot.param.grad().defined())
      slot.param.mutable_grad() = slot_grad(slot).view(slot.shape);
  }
}

void FlatParamGroup::free_segment_grad(int s) {
  if (!segmented_grads_) return;
  for (int i = segments_[s].first_slot; i < segments_[s].end_slot; ++i)
    slots_[i].param.mutable_grad().reset();
  release(std::move(segment_grads_[s]));
  segment_grads_[s] = at::Tensor();
}
void FlatParamGroup::allocate_full() { allocate_storage(full_); }
void FlatParamGroup::free_full() {
  if (!persistent_) free_storage(full_);
}

void FlatParamGroup::copy_master_to_slot(int segment) {
  if (aliased_) return;
  at::NoGradGuard no_grad;
  const int first = segment < 0 ? 0 : segment;
  const int end = segment < 0 ? static_cast<int>(segments_.size()) : segment + 1;
  const bool from_copy = bf16_copy_current();
  for (int k = first; k < end; ++k) {
    at::Tensor source = master_part(from_copy ? bf16_copy_ : master_, k);
    if (offload_ && !from_copy && compute_dtype_ != at::kFloat) {
      // fp32 to the device first (a page-locked source copies asynchronously), then convert
      // there: a converting copy from the host would convert on the host and block.
      auto staged = at::empty({source.numel()}, at::TensorOptions().dtype(at::kFloat).device(full_.device()));
      staged.copy_(source, /*non_blocking=*/pinned_);
      source = staged;
    }
    slot_of(full_, k).copy_(source, /*non_blocking=*/pinned_);
  }
}

// Note [The bf16 copy of an offloaded master]
// Under offload every gather sends the master shard to the device (twice a step under
// full shard), where it is rounded to the compute dtype. With a bf16 compute dtype the
// rounding can as well happen on the host, once per step, as the optimizer writes the
// master: the CPU step kernels round each chunk they stepped while it is still in cache
// (optim/step_kernels.cpp), and the gathers copy 2 bytes per parameter instead of 4. The
// kernels round as c10::BFloat16 does, so the gathered weights are the same bits either
// way.
// The copy is current while the master's version counter is what it was when the copy
// was last made or written alongside the master. Every write to the master bumps it: an
// ATen in-place operation (a loaded checkpoint, a user's optimizer) does, and so do the
// optimizers over shards, which write through raw pointers and bump it themselves
// (ShardOptimizer::step_shard). A stale copy is never read: the gathers then send the
// fp32 master, and the next step's bf16_copy_for_step converts the whole master again.
// The copy is read by the gathers' asynchronous copies and written by the optimizer on
// the host, under the same ordering as the master itself: the end of backward waits for
// every copy to the device before the optimizer runs, and the step waits for the copies of
// gathers made since (Note [Copies beside compute]).
at::Tensor FlatParamGroup::bf16_copy_for_step() {
  if (!keeps_bf16_copy_) return {};
  if (bf16_copy_current()) return bf16_copy_;
  if (!bf16_copy_.defined()) {
    bf16_copy_ = pinned_ ? memory::PinnedHost::instance().empty(shard_numel_, at::kBFloat16)
                         : at::empty({shard_numel_}, at::TensorOptions().dtype(at::kBFloat16));
  }
  optim::kernels::to_bf16(master_.data_ptr<float>(), reinterpret_cast<std::uint16_t*>(bf16_copy_.data_ptr()),
                          shard_numel_);
  bf16_copy_version_ = master_._version();
  return bf16_copy_;
}

void FlatParamGroup::bf16_copy_written() {
  if (bf16_copy_.defined()) bf16_copy_version_ = master_._version();
}

bool FlatParamGroup::bf16_copy_current() const {
  return bf16_copy_.defined() && bf16_copy_version_ == master_._version();
}

at::Tensor FlatParamGroup::empty_master_grad() {
  if (!offload_) return pooled_empty(shard_numel_, at::kFloat);
  if (!pinned_) return master_sized(master_.options());
  // The gradient's block is the group's, taken again each step once the last gradient
  // made in it has been dropped (Note [Page-locked at its size]): page-locking is slow.
  if (!grad_block_.defined() || grad_block_.use_count() > 1 || grad_block_.storage().use_count() > 1) {
    grad_block_ = master_sized(master_.options());
  }
  return grad_block_;
}

// Note [Page-locked at its size]
at::Tensor FlatParamGroup::master_sized(const at::TensorOptions& options) const {
  if (pinned_) return memory::PinnedHost::instance().empty(shard_numel_, at::kFloat);
  return at::empty({shard_numel_}, options);
}

void FlatParamGroup::allocate_full_grad() {
  if (segmented_grads_) {
    for (std::size_t k = 0; k < segments_.size(); ++k) {
      if (!segment_grads_[k].defined()) segment_grads_[k] = zeros(segments_[k].padded_numel);
    }
    return;
  }
  if (full_grad_allocated()) return;
  allocate_storage(full_grad_);
  full_grad_.zero_();
}

void FlatParamGroup::free_full_grad() {
  free_storage(full_grad_);
  for (auto& t : segment_grads_) {
    release(std::move(t));
    t = at::Tensor();
  }
}

void FlatParamGroup::use_full_views() {
  for (auto& s : slots_) s.param.set_data(full_.narrow(0, s.offset, s.numel).view(s.shape));
}

void FlatParamGroup::use_empty_views() {
  for (auto& s : slots_) s.param.set_data(at::empty({0}, full_.options()));
}

void FlatParamGroup::use_grad_views() {
  for (auto& s : slots_) {
    if (!s.param.requires_grad()) continue;
    auto view = slot_grad(s);
    if (view.defined()) s.param.mutable_grad() = view.view(s.shape);
  }
}

void FlatParamGroup::alias_master_grad() {
  FLATSHARD_ASSERT(aliased_ && full_grad_allocated(), "the master's gradient is not the flat gradient");
  const at::Tensor& grad = master_.grad();
  if (grad.defined() && grad.data_ptr() == full_grad_.data_ptr()) return;
  master_.mutable_grad() = alias_of(full_grad_);
}

void FlatParamGroup::drop_param_grads() {
  for (auto& s : slots_) s.param.mutable_grad().reset();
}

}  // namespace flatshard::sharding
