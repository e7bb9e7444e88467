#include "sharding/ddp_engine.h"

#include "flatshard/shard.h"
#include "optim/clip.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <mutex>
#include <numeric>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "flatshard/errors.h"
#include "flatshard/shard.h"
#include "sharding/buckets.h"
#include "sharding/model_check.h"
#include "src/logging.h"

namespace flatshard::sharding {
namespace {

class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(DdpEngine* engine, int param) : engine_(engine), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    engine_->on_grad_ready(param_);
    return outputs;
  }

 private:
  DdpEngine* engine_;
  int param_;
};

// A tensor over `flat`'s storage that autograd does not treat as a view: torch::optim's
// zero_grad() detaches gradients in place, which a view refuses.
at::Tensor alias(const at::Tensor& flat, std::int64_t offset, at::IntArrayRef shape) {
  return at::empty({0}, flat.options())
      .set_(flat.storage(), flat.storage_offset() + offset, shape, c10::contiguous_strides(shape));
}

std::string describe(const std::string& name, const at::Tensor& t) {
  return fmt::format("'{}' {} {}", name, c10::toString(t.scalar_type()), fmt::join(t.sizes(), "x"));
}

}  // namespace

DdpEngine::DdpEngine(std::shared_ptr<torch::nn::Module> model, const World& world, const DDPOptions& options,
                     bool reduce_in_backward)
    : model_(std::move(model)),
      rank_(world.rank()),
      world_size_(world.world_size()),
      options_(options),
      reduce_in_backward_(reduce_in_backward) {
  if (options_.first_bucket_bytes <= 0 || options_.bucket_bytes <= 0) {
    throw InvalidArgument(
        fmt::format("flatshard::DistributedDataParallel (rank {}/{}): bucket sizes must be "
                    "positive",
                    rank_, world_size_));
  }
  std::string first_param;
  for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    const bool placed = t.device().is_cpu() || t.device().is_cuda();
    if (!placed || !at::isFloatingType(t.scalar_type()) || (!first_param.empty() && t.device() != device_)) {
      throw InvalidArgument(fmt::format(
          "flatshard::DistributedDataParallel (rank {}/{}): parameter {} is on {}: DDP needs floating "
          "parameters, all on the CPU or all on one CUDA device{}; move the model there (model->to(device)), "
          "keep integer tensors as buffers",
          rank_, world_size_, describe(item.key(), t), t.device().str(),
          first_param.empty() ? "" : fmt::format(" ('{}' is on {})", first_param, device_.str())));
    }
    if (first_param.empty()) {
      first_param = item.key();
      device_ = t.device();
    }
  }
  // The collectives move tensors of the parameters' device: TCP rings on the CPU; on
  // CUDA, NCCL on the communicator's high-priority streams.
  CommunicatorOptions comm_options = options_.comm;
  comm_options.device = device_;
  comm_ = Communicator::create(world, comm_options);
  for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    DdpParam p;
    p.name = item.key();
    p.param = item.value();
    p.shape = item.value().sizes().vec();
    p.numel = item.value().numel();
    params_.push_back(std::move(p));
  }
  for (const auto& b : model_->buffers(/*recurse=*/true)) buffers_.push_back(b);
  compute_dtype_ = options_.mixed_precision.param.value_or(
      params_.empty() ? at::kFloat : params_.front().param.scalar_type());
  check_same_model_everywhere(world, *model_, "flatshard::DistributedDataParallel");

  // Every rank starts from rank 0's parameters and buffers.
  {
    at::NoGradGuard no_grad;
    for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
      comm_->broadcast(item.value().detach(), 0).wait();
    }
    for (auto& b : buffers_) comm_->broadcast(b, 0).wait();
  }
  for (auto& p : params_) {
    if (mixed()) p.master = p.param.detach().to(at::kFloat).clone();
  }
  // Reverse registration order: roughly the order backward produces gradients.
  std::vector<int> order(params_.size());
  std::iota(order.rbegin(), order.rend(), 0);
  build_buckets(order);
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    // Taken after build_buckets set the compute dtype (set_data with a new dtype
    // replaces a parameter's AccumulateGrad node).
    params_[i].accumulator = torch::autograd::impl::grad_accumulator(params_[i].param);
    params_[i].accumulator->add_post_hook(std::make_unique<ReadyHook>(this, i));
  }
  log::at(log::Level::Info, "DistributedDataParallel: {} parameters in {} buckets", params_.size(),
          buckets_.size());
}

DdpEngine::~DdpEngine() {
  for (auto& b : buckets_) {
    try {
      if (b.work) b.work->wait();
    } catch (const std::exception&) {
    }
  }
}

void DdpEngine::build_buckets(const std::vector<int>& order) {
  std::vector<std::int64_t> bytes(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i)
    bytes[i] = params_[i].numel * static_cast<std::int64_t>(c10::elementSize(compute_dtype_));
  const auto assignment = assign_buckets(bytes, order, options_.first_bucket_bytes, options_.bucket_bytes);
  std::vector<DdpBucket> fresh(assignment.size());
  at::NoGradGuard no_grad;
  for (std::size_t b = 0; b < assignment.size(); ++b) {
    DdpBucket& bucket = fresh[b];
    bucket.params = assignment[b];
    for (int i : bucket.params) bucket.numel += params_[i].numel;
    bucket.padded_numel = (bucket.numel + world_size_ - 1) / world_size_ * world_size_;
    const auto options = at::TensorOptions().dtype(compute_dtype_).device(device_);
    bucket.flat = at::zeros({bucket.padded_numel}, options);
    bucket.grad = at::zeros({bucket.padded_numel}, options);
    if (mixed()) {
      bucket.master = at::zeros({bucket.padded_numel}, options.dtype(at::kFloat));
      bucket.master_grad = at::zeros({bucket.padded_numel}, options.dtype(at::kFloat));
    }
    std::int64_t offset = 0;
    for (int i : bucket.params) {
      DdpParam& p = params_[i];
      auto view = [&](const at::Tensor& flat) { return flat.narrow(0, offset, p.numel).view(p.shape); };
      view(bucket.flat).copy_(mixed() ? p.master : p.param.detach());
      const at::Tensor& old_grad = mixed() ? p.master.grad() : p.param.grad();
      if (old_grad.defined()) view(mixed() ? bucket.master_grad : bucket.grad).copy_(old_grad);
      if (mixed()) {
        view(bucket.master).copy_(p.master);
        p.master.set_data(view(bucket.master));
        p.master.mutable_grad() = alias(bucket.master_grad, offset, p.shape);
      }
      p.param.set_data(view(bucket.flat));
      p.param.mutable_grad() = alias(bucket.grad, offset, p.shape);
      p.bucket = static_cast<int>(b);
      p.offset = offset;
      offset += p.numel;
    }
  }
  buckets_ = std::move(fresh);
  ++layout_version_;
}

std::vector<at::Tensor> DdpEngine::optimizer_params() const {
  std::vector<at::Tensor> out;
  for (const auto& p : params_) out.push_back(mixed() ? p.master : p.param);
  return out;
}

void DdpEngine::pre_forward() {
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    if (mixed()) bucket.flat.copy_(bucket.master);  // the optimizer updated the masters
    bucket.pending = static_cast<int>(bucket.params.size());
    bucket.launched = false;
  }
  adopt_grads();
  next_launch_ = 0;
  if (options_.broadcast_buffers && world_size_ > 1) {
    for (auto& b : buffers_) comm_->broadcast(b, 0).wait();
  }
}

// torch::optim's zero_grad() drops gradients, and a gradient made while they were
// dropped is a fresh tensor: fold it into its bucket slice and point .grad() back there.
void DdpEngine::adopt_grads() {
  at::NoGradGuard no_grad;
  for (auto& p : params_) {
    p.used = false;
    DdpBucket& bucket = buckets_[p.bucket];
    auto restore = [&](at::Tensor& owner, const at::Tensor& flat) {
      auto view = alias(flat, p.offset, p.shape);
      const at::Tensor& grad = owner.grad();
      if (grad.defined() && grad.data_ptr() == view.data_ptr()) return;
      if (grad.defined()) {
        view.copy_(grad);
      } else {
        view.zero_();
      }
      owner.mutable_grad() = view;
    };
    restore(p.param, bucket.grad);
    if (mixed()) restore(p.master, bucket.master_grad);
  }
}

void DdpEngine::on_grad_ready(int index) {
  if (!reduce_in_backward_) return;
  if (!backward_active_) {
    backward_active_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { end_of_backward(); });
  }
  DdpParam& p = params_[index];
  if (!rebuilt_ && !p.used) arrival_.push_back(index);
  if (p.used) return;  // counted once per backward
  p.used = true;
  if (no_sync_) return;
  DdpBucket& bucket = buckets_[p.bucket];
  if (--bucket.pending > 0) return;
  // Launch in bucket order, so that every rank issues the same all-reduces in the same
  // order whatever order its buckets filled in.
  while (next_launch_ < static_cast<int>(buckets_.size()) && buckets_[next_launch_].pending == 0)
    launch(next_launch_++);
}

void DdpEngine::launch(int index) {
  DdpBucket& bucket = buckets_[index];
  bucket.launched = true;
  const at::ScalarType reduce_dtype = options_.mixed_precision.reduce.value_or(compute_dtype_);
  if (reduce_dtype == compute_dtype_) {
    bucket.reduce_buffer = bucket.grad;
  } else if (mixed() && reduce_dtype == at::kFloat) {
    // Reduced in the masters' gradient itself: converted into it, then reduced in place.
    at::NoGradGuard no_grad;
    bucket.master_grad.copy_(bucket.grad);
    bucket.reduce_buffer = bucket.master_grad;
  } else {
    bucket.reduce_buffer = bucket.grad.to(reduce_dtype);
  }
  if (world_size_ == 1) return;  // the average over one rank is the gradient itself
  CollectiveOptions opts;
  opts.stream = StreamRole::AllReduce;
  // Until the buckets are rebuilt (end of the first backward) gradients are all-reduced:
  // the rebuild moves parameters between buckets, and a rank's reduced slice under the
  // old layout is not its slice under the new one.
  if (reduce_ == GradReduce::ReduceScatter && rebuilt_) {
    const auto slot = slice(index);
    bucket.work = comm_->reduce_scatter(bucket.reduce_buffer.narrow(0, slot.offset, slot.numel),
                                        bucket.reduce_buffer, ReduceOp::Avg, opts);
  } else {
    bucket.work = comm_->all_reduce(bucket.reduce_buffer, ReduceOp::Avg, opts);
  }
}

void DdpEngine::finish(int index) {
  DdpBucket& bucket = buckets_[index];
  if (!bucket.reduce_buffer.defined()) return;  // not launched
  if (bucket.work) {
    bucket.work->wait();
    bucket.work.reset();
  }
  at::NoGradGuard no_grad;
  if (mixed()) {
    // The masters' gradient is the gradient now; the compute-dtype buffer was consumed
    // (the optimizer never sees it, so nothing else would zero it).
    if (bucket.reduce_buffer.data_ptr() != bucket.master_grad.data_ptr())
      bucket.master_grad.copy_(bucket.reduce_buffer);
    bucket.grad.zero_();
  } else if (bucket.reduce_buffer.data_ptr() != bucket.grad.data_ptr()) {
    bucket.grad.copy_(bucket.reduce_buffer);
  }
  bucket.reduce_buffer = at::Tensor();
}

void DdpEngine::end_of_backward() {
  backward_active_ = false;
  if (no_sync_) return;
  std::vector<std::string> missing;
  for (auto& p : params_) {
    if (!p.used) missing.push_back(p.name);
  }
  if (!missing.empty() && !options_.find_unused_parameters) {
    throw InvalidArgument(
        fmt::format("flatshard::DistributedDataParallel (rank {}/{}): {} parameter(s) got no gradient in "
                    "this backward: {}. Set "
                    "DDPOptions::find_unused_parameters = true if parameters may go unused, or make the loss "
                    "depend on them.",
                    rank_, world_size_, missing.size(), fmt::join(missing, ", ")));
  }
  // Unused parameters (allowed): their slices hold zeros; launch what is left, in order.
  for (int b = next_launch_; b < static_cast<int>(buckets_.size()); ++b) launch(b);
  next_launch_ = static_cast<int>(buckets_.size());
  std::vector<int> globally_unused;
  if (options_.find_unused_parameters) {
    auto used = at::zeros({static_cast<std::int64_t>(params_.size())}, at::kInt);
    for (std::size_t i = 0; i < params_.size(); ++i) used[i] = params_[i].used ? 1 : 0;
    used = used.to(device_);
    comm_->all_reduce(used, ReduceOp::Sum).wait();
    used = used.cpu();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (used[i].item<int>() == 0) globally_unused.push_back(static_cast<int>(i));
    }
  }
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) finish(b);
  // No rank used these: no gradient, as in single-process training.
  for (int i : globally_unused) {
    params_[i].param.mutable_grad().reset();
    if (mixed()) params_[i].master.mutable_grad().reset();
  }
  if (!rebuilt_) {
    rebuilt_ = true;
    // Rank 0's arrival order, so that every rank builds the same buckets.
    std::vector<int> order = arrival_;
    std::set<int> seen(order.begin(), order.end());
    for (int i = static_cast<int>(params_.size()) - 1; i >= 0; --i) {
      if (!seen.count(i)) order.push_back(i);
    }
    auto shared = at::tensor(std::vector<std::int64_t>(order.begin(), order.end()), at::kLong).to(device_);
    comm_->broadcast(shared, 0).wait();
    shared = shared.cpu();
    order.assign(shared.data_ptr<std::int64_t>(), shared.data_ptr<std::int64_t>() + shared.numel());
    build_buckets(order);
    for (int i : globally_unused) {
      params_[i].param.mutable_grad().reset();
      if (mixed()) params_[i].master.mutable_grad().reset();
    }
  }
  ++synced_backwards_;
  if (options_.nonfinite_grads == NonFiniteGrads::Ignore) return;
  // All-reduced gradients are the same everywhere; reduce-scattered ones are valid in
  // this rank's slice only: check what this rank holds, then agree.
  std::vector<at::Tensor> grads;
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    const auto mine =
        reduce_ == GradReduce::ReduceScatter && rebuilt_ ? slice(b) : ShardRange{0, buckets_[b].numel};
    grads.push_back(step_grads(b).narrow(0, mine.offset, mine.numel));
  }
  const auto bad = optim::nonfinite_ranks(grads, *comm_);
  if (optim::handle_nonfinite(bad, static_cast<int>(options_.nonfinite_grads), synced_backwards_, rank_,
                              world_size_, "DistributedDataParallel")) {
    for (auto& p : params_) {
      p.param.mutable_grad().reset();
      if (mixed()) p.master.mutable_grad().reset();
    }
    dropped_ = true;
    ++skipped_steps_;
  }
}

ShardRange DdpEngine::slice(int bucket) const {
  return shard_range(buckets_[bucket].padded_numel, world_size_, rank_);
}

std::vector<int> DdpEngine::rebuilt_order() const {
  std::vector<int> order;
  if (!rebuilt_) return order;
  for (const auto& b : buckets_) order.insert(order.end(), b.params.begin(), b.params.end());
  return order;
}

void DdpEngine::restore_order(const std::vector<int>& order) {
  if (rebuilt_ || backward_active_) return;
  rebuilt_ = true;
  build_buckets(order);
}

void DdpEngine::reduce_all_now() {
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) launch(b);
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) finish(b);
}

}  // namespace flatshard::sharding
