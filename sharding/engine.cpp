#include "sharding/engine.h"

#include "sharding/buckets.h"
#include "sharding/model_check.h"
#include "sharding/unit_discovery.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "flatshard/errors.h"
#include "flatshard/optim.h"
#include "optim/clip.h"
#include "src/errors.h"
#include "src/logging.h"

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
  bool pre_backward_done = false;
  bool post_backward_done = false;
  int pending_grads = 0;      // parameters whose gradient has not been accumulated yet
  int forward_position = -1;  // index in forward_order_
};

struct Engine::PendingReduce {
  int unit;
  std::optional<Work> work;
  at::Tensor input;   // what is being reduce-scattered (owned until the work completes)
  at::Tensor output;  // this rank's reduced shard, in the reduce dtype
  bool input_is_full_grad = false;
  // A bucket of a replicated group (Note [Replicated strategies]): its index, and where
  // the reduced values go when they were not reduced in place (copied, or added to a
  // gradient an earlier backward left).
  int segment = -1;
  at::Tensor target;
  bool add = false;
};

namespace {

// Adds a reduced shard into a shard gradient, or makes it the gradient when there is none.
void accumulate(at::Tensor& grad, at::Tensor reduced) {
  if (grad.defined()) {
    grad.add_(reduced);
  } else {
    grad = std::move(reduced);
  }
}

// A unit built into shards (build.h) joins this engine only if it was built for the
// same ranks, dtype and placement, and nobody wrote to its parameters since. Its slots
// take their names under the root module (`names`).
void adopt_built(FlatParamGroup& g, int rank, int world_size, const ShardGroup& shard, at::ScalarType compute,
                 const FlatParamGroup::Placement& placement,
                 const std::unordered_map<const c10::TensorImpl*, std::string>& names) {
  const std::string who = fmt::format("flatshard::FullyShard (rank {}/{})", rank, world_size);
  auto describe = [](int r, int n, at::ScalarType dtype, c10::Device device, bool offload) {
    return fmt::format("shard {} of {}, {} on {}{}", r, n, c10::toString(dtype), device.str(),
                       offload ? ", offloaded" : "");
  };
  const bool offload = placement.offload;
  if (g.world_size() != shard.size || g.rank() != shard.rank || g.compute_dtype() != compute ||
      g.device() != placement.compute || g.offloaded() != offload) {
    throw InvalidArgument(fmt::format(
        "{}: {} was built into shards for {}, but this FullyShard runs {}; pass the same World and "
        "FullyShardOptions to BuildIntoShards and to FullyShard",
        who, g.name(), describe(g.rank(), g.world_size(), g.compute_dtype(), g.device(), g.offloaded()),
        describe(shard.rank, shard.size, compute, placement.compute, offload)));
  }
  for (auto& slot : g.slots()) {
    auto it = names.find(slot.param.unsafeGetTensorImpl());
    FLATSHARD_ASSERT(it != names.end(), "built parameter not found in the model");
    slot.name = it->second;
    if (slot.param._version() != slot.version) {
      throw InvalidArgument(fmt::format(
          "{}: parameter '{}' was written after its unit was built into shards (an initialisation in a "
          "parent's constructor?), and that write was lost: initialise parameters in their unit's "
          "constructor, or build the model without BuildIntoShards",
          who, slot.name));
    }
  }
}

class Driver final : public UnitHooks {
 public:
  Driver(Engine* engine, int unit) : engine_(engine), unit_(unit) {}
  void pre_forward() override { engine_->pre_forward(unit_); }
  std::vector<at::Tensor> post_forward(std::vector<at::Tensor> outputs) override {
    return engine_->post_forward(unit_, std::move(outputs));
  }

 private:
  Engine* engine_;
  int unit_;
};

// Runs after AccumulateGrad has added a parameter's gradient into its flat view.
class AccumulatedHook final : public torch::autograd::FunctionPostHook {
 public:
  AccumulatedHook(Engine* engine, int unit, int param) : engine_(engine), unit_(unit), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    engine_->on_grad_accumulated(unit_, param_);
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
void fold_strays(FlatParamGroup& g, int first_slot, int end_slot) {
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

}  // namespace

Engine::Engine(std::shared_ptr<torch::nn::Module> model, const World& world, const FullyShardOptions& options)
    : model_(std::move(model)),
      rank_(world.rank()),
      world_size_(world.world_size()),
      options_(options),
      reshard_after_forward_(reshards_after_forward(options)),
      shard_(flatshard::shard_group(world, options)) {
  replicated_ = replicates(options_.strategy);
  if (options_.prefetch < 0) {
    throw InvalidArgument(fmt::format("flatshard::FullyShard (rank {}/{}): prefetch must be >= 0, got {}",
                                      rank_, world_size_, options_.prefetch));
  }
  const auto membership = discover_units(*model_);
  const auto& declared = membership.declared;
  const auto& owner = membership.owner;
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> params(declared.size() + 1);
  // Units built into shards (build.h) arrive with their groups: adopted, not flattened.
  std::vector<std::shared_ptr<FlatParamGroup>> built(declared.size() + 1);
  std::unordered_map<const c10::TensorImpl*, std::string> built_names;
  for (std::size_t i = 0; i < declared.size(); ++i) {
    built[i + 1] = declared[i]->built_shard();
    if (!built[i + 1]) continue;
    if (replicated_) {
      throw InvalidArgument(fmt::format(
          "flatshard::FullyShard (rank {}/{}): the model was built into shards (BuildIntoShards; {} holds "
          "only this rank's shard), and strategy {} keeps a whole replica on every rank. Use FullShard, "
          "ShardGradOp or HybridShard, or build the model without BuildIntoShards",
          rank_, world_size_, built[i + 1]->name(), to_string(options_.strategy)));
    }
    for (auto& slot : built[i + 1]->slots()) built_names[slot.param.unsafeGetTensorImpl()] = slot.name;
  }
  std::set<const c10::TensorImpl*> seen;
  at::ScalarType model_dtype = at::kFloat;
  std::string first_param;
  c10::Device model_device{c10::kCPU};
  for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
    const auto* impl = item.value().unsafeGetTensorImpl();
    if (!seen.insert(impl).second) continue;  // registered twice (tied): once is enough
    if (auto it = built_names.find(impl); it != built_names.end()) {
      it->second = item.key();
      continue;
    }
    if (built[owner.at(impl)]) {
      throw InvalidArgument(fmt::format(
          "flatshard::FullyShard (rank {}/{}): parameter '{}' belongs to {}, which was built into shards, "
          "but was not part of it then (registered after the unit was built?); register every parameter "
          "in its unit's constructor",
          rank_, world_size_, item.key(), built[owner.at(impl)]->name()));
    }
    const c10::Device device = item.value().device();
    if (!device.is_cpu() && !device.is_cuda()) {
      throw InvalidArgument(
          fmt::format("flatshard::FullyShard (rank {}/{}): parameter '{}' is on {}; FullyShard shards "
                      "CPU or CUDA parameters",
                      rank_, world_size_, item.key(), device.str()));
    }
    if (!first_param.empty() && device != model_device) {
      throw InvalidArgument(fmt::format(
          "flatshard::FullyShard (rank {}/{}): parameter '{}' is on {} but '{}' is on {}; move the "
          "whole model to one device (model->to(device)) before wrapping it",
          rank_, world_size_, item.key(), device.str(), first_param, model_device.str()));
    }
    if (first_param.empty()) {
      first_param = item.key();
      model_device = device;
    }
    if (!at::isFloatingType(item.value().scalar_type())) {
      throw InvalidArgument(
          fmt::format("flatshard::FullyShard (rank {}/{}): parameter '{}' has dtype {}; only "
                      "floating parameters can be sharded",
                      rank_, world_size_, item.key(), c10::toString(item.value().scalar_type())));
    }
    model_dtype = item.value().scalar_type();
    // The replicated strategies keep every parameter in the root's group.
    params[replicated_ ? 0 : owner.at(impl)].emplace_back(item.key(), item.value());
  }
  const auto first_built =
      std::find_if(built.begin(), built.end(), [](const auto& b) { return b != nullptr; });
  if (first_param.empty() && first_built != built.end()) {  // every parameter was built into shards
    model_dtype = (*first_built)->compute_dtype();
    model_device = (*first_built)->device();
  }
  const at::ScalarType compute = options_.mixed_precision.param.value_or(model_dtype);
  device_ = options_.device.value_or(model_device);
  if (!device_.is_cpu() && !device_.is_cuda()) {
    throw InvalidArgument(
        fmt::format("flatshard::FullyShard (rank {}/{}): device {} is neither the CPU nor a "
                    "CUDA device",
                    rank_, world_size_, device_.str()));
  }
  if (!first_param.empty() && model_device != device_ && !model_device.is_cpu()) {
    throw InvalidArgument(fmt::format(
        "flatshard::FullyShard (rank {}/{}): the model is on {} and options.device is {}; build the model on "
        "the host (the CPU) to have it sharded onto {}, or leave options.device unset",
        rank_, world_size_, model_device.str(), device_.str(), device_.str()));
  }
  FlatParamGroup::Placement placement;
  placement.compute = device_;
  placement.offload = options_.cpu_offload;
  for (const auto& g : built) {
    if (g) adopt_built(*g, rank_, world_size_, shard_, compute, placement, built_names);
  }
  // The scheduler's collectives move tensors of the compute device: TCP rings on the
  // CPU; on CUDA, NCCL on the communicator's high-priority streams.
  CommunicatorOptions comm_options = options_.comm;
  comm_options.device = device_;
  comm_ = Communicator::create(world, comm_options);
  {
    std::vector<std::string> units{"root unit"};
    for (std::size_t i = 0; i < declared.size(); ++i) {
      std::int64_t numel = 0;
      for (const auto& item : params[i + 1]) numel += item.second.numel();
      const auto& b = built[i + 1];
      units.push_back(fmt::format("unit {} of {} parameters, {} elements", i + 1,
                                  b ? b->slots().size() : params[i + 1].size(), b ? b->numel() : numel));
    }
    check_same_model_everywhere(
        world, *model_, "flatshard::FullyShard",
        {fmt::format("strategy {}, shard groups of {} ranks, reshard after forward {}, prefetch {}",
                     to_string(options_.strategy), shard_.size, reshard_after_forward_, options_.prefetch),
         fmt::format("units: {}", fmt::join(units, "; ")),
         fmt::format("compute dtype {}", c10::toString(compute))});
  }
  if (shard_.size < world_size_ && !replicated_) {
    // Note [Shard groups]: group k is ranks [k G, (k + 1) G); replica set j is the ranks
    // j, G + j, 2 G + j, ... that hold shard j. Made after the check above (a rank with
    // other groups would wait in rendezvous), by every rank in the same order.
    std::vector<int> group, replicas;
    for (int r = 0; r < shard_.size; ++r) group.push_back(shard_.replica * shard_.size + r);
    for (int k = 0; k < shard_.replicas; ++k) replicas.push_back(k * shard_.size + shard_.rank);
    CommunicatorOptions shard_options = comm_options, replica_options = comm_options;
    shard_options.name += "/shard";
    replica_options.name += "/replica";
    shard_comm_ = Communicator::create(subworld(world, group, shard_options.name), shard_options);
    replica_comm_ = Communicator::create(subworld(world, replicas, replica_options.name), replica_options);
  }

  if (replicated_) {
    make_replicated_group(std::move(params[0]), compute, placement);
    return;
  }
  for (std::size_t i = 0; i <= declared.size(); ++i) {
    auto unit = std::make_unique<Unit>();
    const int index = static_cast<int>(units_.size());
    unit->name = i == 0 ? "root" : fmt::format("unit{}", i);
    if (built[i]) {
      const std::string& first = built[i]->slots().front().name;
      unit->name = first.substr(0, first.rfind('.'));
      built[i]->set_name(unit->name);
      unit->group = std::move(built[i]);
      declared[i - 1]->set_built_shard(nullptr);
    } else if (!params[i].empty()) {
      unit->name = i == 0 ? "root" : params[i].front().first.substr(0, params[i].front().first.rfind('.'));
      unit->group = std::make_shared<FlatParamGroup>(unit->name, std::move(params[i]), shard_.size,
                                                     shard_.rank, compute, placement);
    }
    if (unit->group) {
      for (auto& slot : unit->group->slots()) {
        if (slot.accumulator)
          slot.accumulator->add_post_hook(std::make_unique<AccumulatedHook>(this, index, slot.id));
      }
    }
    if (i > 0) {
      unit->declared = declared[i - 1];
      unit->driver = std::make_unique<Driver>(this, index);
      unit->declared->attach(unit->driver.get());
    }
    units_.push_back(std::move(unit));
  }
  // Buffers (running statistics, masks) are replicated: they go to the compute device.
  for (auto& b : model_->buffers(/*recurse=*/true)) {
    if (b.defined() && b.device() != device_) b.set_data(b.to(device_));
  }
  for (auto& u : units_) {
    if (u->group) memory_.param_shard_bytes += u->group->shard_numel() * 4;
  }
  log::at(log::Level::Info, "FullyShard: {} units, {} parameters", units_.size(), owner.size());
}

// Note [Replicated strategies]
// NoShard (DDP) and ShardOptimizerState (ZeRO-1) are the engine's strategies whose
// parameters stay gathered: the whole model is one persistent group (no unit is
// gathered or freed), cut into segments that are DDP's buckets: the first up to
// first_bucket_bytes, the rest up to bucket_bytes, in reverse registration order. Every
// rank starts from rank 0's values. A bucket's gradient is reduced as soon as all its
// parameters' gradients have arrived, in bucket order on every rank, one reduction in
// flight (Note [One reduce-scatter in flight]): by all-reduce under NoShard (each rank is
// a shard group of one), by reduce-scatter under ShardOptimizerState (each rank receives
// its slice of the bucket, which is its part of the master shard). The first synced
// backward records the order gradients arrive in, reduces nothing until it ends, and
// then lays the group out again in rank 0's arrival order (DDP's rebuild). After a synced
// backward the optimizer steps the master shard; before the next forward (or
// summon_full_params) the parameters are refreshed from it: copied, and under
// ShardOptimizerState all-gathered bucket by bucket. Without mixed precision, NoShard's
// master shard is the flat buffer and its gradient the flat gradient: nothing is copied.
void Engine::make_replicated_group(std::vector<std::pair<std::string, at::Tensor>> params,
                                   at::ScalarType compute, const FlatParamGroup::Placement& given) {
  if (options_.first_bucket_bytes <= 0 || options_.bucket_bytes <= 0) {
    throw InvalidArgument(
        fmt::format("flatshard::FullyShard (rank {}/{}): bucket sizes must be positive, got "
                    "{} and {}",
                    rank_, world_size_, options_.first_bucket_bytes, options_.bucket_bytes));
  }
  if (options_.cpu_offload) {
    throw InvalidArgument(fmt::format(
        "flatshard::FullyShard (rank {}/{}): cpu_offload needs a sharded strategy (FullShard, ShardGradOp or "
        "HybridShard); {} keeps the parameters gathered on the device",
        rank_, world_size_, to_string(options_.strategy)));
  }
  for (auto& b : model_->buffers(/*recurse=*/true)) {
    if (b.defined() && b.device() != device_) b.set_data(b.to(device_));
  }
  if (world_size_ > 1) {
    // Every rank starts from rank 0's parameters and buffers (a model built on the host
    // crosses to the compute device for it).
    at::NoGradGuard no_grad;
    for (auto& [name, p] : params) {
      auto t = p.detach().to(device_);
      comm_->broadcast(t, 0).wait();
      if (t.data_ptr() != p.data_ptr()) p.detach().copy_(t);
    }
    for (auto& b : model_->buffers(/*recurse=*/true)) comm_->broadcast(b, 0).wait();
  }
  // Reverse registration order: roughly the order backward produces gradients.
  std::reverse(params.begin(), params.end());
  for (const auto& [name, p] : params) {
    param_names_.push_back(name);
    param_bytes_.push_back(p.numel() * static_cast<std::int64_t>(c10::elementSize(compute)));
  }
  std::vector<int> ids(params.size());
  std::iota(ids.begin(), ids.end(), 0);
  const auto sizes = bucket_sizes(ids);
  FlatParamGroup::Placement placement = given;
  placement.persistent = true;
  auto unit = std::make_unique<Unit>();
  unit->name = "root";
  if (!params.empty()) {
    unit->group = std::make_shared<FlatParamGroup>("model", std::move(params), shard_.size, shard_.rank,
                                                   compute, placement, sizes);
    for (auto& slot : unit->group->slots()) {
      if (slot.accumulator)
        slot.accumulator->add_post_hook(std::make_unique<AccumulatedHook>(this, kRoot, slot.id));
    }
    unit->gathered = true;
    memory_.param_shard_bytes += unit->group->shard_numel() * 4;
    master_version_ = unit->group->master()._version();
  }
  units_.push_back(std::move(unit));
  segment_of_param_.assign(param_names_.size(), 0);
  used_.assign(param_names_.size(), false);
  if (units_[kRoot]->group) {
    const auto& g = *units_[kRoot]->group;
    for (int k = 0; k < static_cast<int>(g.segments().size()); ++k) {
      for (int i = g.segments()[k].first_slot; i < g.segments()[k].end_slot; ++i)
        segment_of_param_[g.slots()[i].id] = k;
    }
    pending_.assign(g.segments().size(), 0);
  }
  log::at(log::Level::Info, "FullyShard ({}): {} parameters in {} buckets", to_string(options_.strategy),
          param_names_.size(), pending_.size());
}

std::vector<int> Engine::bucket_sizes(const std::vector<int>& ids) const {
  std::vector<int> sizes;
  for (const auto& bucket :
       assign_buckets(param_bytes_, ids, options_.first_bucket_bytes, options_.bucket_bytes))
    sizes.push_back(static_cast<int>(bucket.size()));
  return sizes;
}

Engine::~Engine() {
  try {
    finish_pending_reduce();
    for (auto& u : units_) {
      if (u->gather) u->gather->wait();
    }
  } catch (const std::exception& e) {
    log::at(log::Level::Warn, "FullyShard: a collective failed during teardown: {}", e.what());
  }
  for (auto& u : units_) {
    if (u->declared) u->declared->attach(nullptr);
  }
}

std::vector<at::Tensor> Engine::shards() const {
  std::vector<at::Tensor> out;
  for (const auto& u : units_) {
    if (u->group) out.push_back(u->group->master());
  }
  return out;
}

std::vector<ShardLayout> Engine::layout() const {
  std::vector<ShardLayout> out;
  for (const auto& u : units_) {
    if (!u->group) continue;
    ShardLayout l;
    l.padded_numel = u->group->padded_numel();
    l.shard_numel = u->group->shard_numel();
    for (const auto& seg : u->group->segments())
      l.segments.push_back({seg.offset, seg.padded_numel, seg.slice, seg.master_offset});
    for (const auto& slot : u->group->slots())
      l.params.push_back({slot.name, slot.shape, slot.offset, slot.numel});
    out.push_back(std::move(l));
  }
  return out;
}

// --- gathers --------------------------------------------------------------------

void Engine::issue_gather(int index) {
  Unit& u = *units_[index];
  FlatParamGroup& g = *u.group;
  g.allocate_full();
  g.copy_master_to_slot();  // the local shard goes into its slot: the gather is in place
  CollectiveOptions opts;
  opts.stream = StreamRole::AllGather;
  u.gather = shard_comm().all_gather(g.full(), g.full_slot(), opts);
  account();
}

void Engine::unshard(int index) {
  Unit& u = *units_[index];
  if (!u.group || u.gathered) return;
  if (!u.gather) issue_gather(index);
  u.gather->wait();
  u.gather.reset();
  u.group->use_full_views();
  u.gathered = true;
}

void Engine::reshard(int index) {
  Unit& u = *units_[index];
  if (!u.group || u.group->persistent()) return;
  if (u.gather) {  // a prefetch nobody used: let it land before freeing its buffer
    u.gather->wait();
    u.gather.reset();
  }
  if (u.gathered) u.group->use_empty_views();
  u.group->free_full();
  u.gathered = false;
}

int Engine::gathered_non_root_units() const {
  int n = 0;
  for (std::size_t i = 1; i < units_.size(); ++i) {
    if (units_[i]->group && units_[i]->group->full_allocated()) ++n;
  }
  return n;
}

// Note [Prefetch bound]
// A prefetch is issued only while fewer than prefetch + 1 non-root units are gathered,
// so with resharding after forward at most prefetch + 1 units besides the root hold
// gathered buffers at any time. A gather the schedule needs now is never skipped.
void Engine::prefetch(int index) {
  Unit& u = *units_[index];
  if (!u.group || u.gathered || u.gather) return;
  if (reshard_after_forward_ && gathered_non_root_units() >= options_.prefetch + 1) return;
  issue_gather(index);
}

// --- forward --------------------------------------------------------------------

void Engine::pre_forward(int index) {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  Unit& u = *units_[index];
  if (replicated_) {
    refresh_replicas();
    if (options_.broadcast_buffers && world_size_ > 1) {
      for (auto& b : model_->buffers(/*recurse=*/true)) comm_->broadcast(b, 0).wait();
    }
    return;
  }
  if (!order_recorded_ && index != kRoot && u.forward_position < 0) {
    u.forward_position = static_cast<int>(forward_order_.size());
    forward_order_.push_back(index);
  }
  unshard(index);
  if (order_recorded_ && u.forward_position >= 0) {
    for (int k = 1; k <= options_.prefetch; ++k) {
      const int next = u.forward_position + k;
      if (next < static_cast<int>(forward_order_.size())) prefetch(forward_order_[next]);
    }
  }
}

std::vector<at::Tensor> Engine::post_forward(int index, std::vector<at::Tensor> outputs) {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  if (index == kRoot) order_recorded_ = true;
  if (!at::GradMode::is_enabled()) {  // no backward will come: free now
    if (index != kRoot) reshard(index);
    return outputs;
  }
  if (reshard_after_forward_ && index != kRoot) reshard(index);
  for (auto& t : outputs) {
    if (t.defined() && t.requires_grad()) {
      t.register_hook([this, index](const at::Tensor&) { pre_backward(index); });
    }
  }
  return outputs;
}

// --- backward -------------------------------------------------------------------

void Engine::pre_backward(int index) {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  if (!backward_active_) {
    backward_active_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { end_of_backward(); });
  }
  Unit& u = *units_[index];
  if (u.pre_backward_done) return;  // several outputs: once per backward
  u.pre_backward_done = true;
  if (!u.group) return;
  if (u.group->persistent()) {
    FlatParamGroup& g = *u.group;
    // NoShard without mixed precision keeps its gradient in the flat gradient: it starts
    // from zero unless an earlier backward's is still there (no zero_grad, or no_sync).
    if (g.master_aliases_full()) {
      if (g.full_grad_allocated() && !accumulating_ && !g.master().grad().defined()) g.full_grad().zero_();
      g.allocate_full_grad();
    }
    // Buckets' gradient buffers are allocated as their first gradients arrive.
    g.use_grad_views();
    account();
    std::fill(pending_.begin(), pending_.end(), 0);
    for (auto& slot : g.slots()) {
      if (slot.accumulator) ++pending_[segment_of_param_[slot.id]];
    }
    std::fill(used_.begin(), used_.end(), false);
    next_segment_ = 0;
    fresh_grad_ = false;
    return;
  }
  unshard(index);
  u.group->allocate_full_grad();  // kept, not zeroed, while accumulating under no_sync
  u.group->use_grad_views();
  account();
  u.pending_grads = 0;
  for (auto& slot : u.group->slots()) u.pending_grads += slot.accumulator ? 1 : 0;
  if (u.forward_position >= 0) {
    for (int k = 1; k <= options_.prefetch; ++k) {
      const int prev = u.forward_position - k;
      if (prev >= 0) prefetch(forward_order_[prev]);
    }
  }
}

void Engine::on_grad_accumulated(int index, int param) {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  Unit& u = *units_[index];
  if (!u.pre_backward_done) {
    // The gradient reached a parameter before its unit's outputs did (a parameter used
    // outside its unit's forward). It landed in a fresh tensor; post_backward adds it in.
    pre_backward(index);
  }
  if (!replicated_) {
    if (--u.pending_grads == 0) post_backward(index);
    return;
  }
  if (used_[param]) return;  // counted once per backward
  used_[param] = true;
  FlatParamGroup& g = *u.group;
  const int s = segment_of_param_[param];
  if (!g.segment_grad_allocated(s)) {
    // The bucket's first gradient (it landed in a tensor of its own): the bucket gets its
    // buffer now, and the rest of its gradients accumulate there in place.
    g.allocate_segment_grad(s);
    fold_strays(g, g.segments()[s].first_slot, g.segments()[s].end_slot);
  }
  if (!rebuilt_ && !arrival_recorded_) arrival_.push_back(param);
  --pending_[s];
  // The first synced backward reduces nothing until it has laid the buckets out again.
  if (!no_sync_ && rebuilt_) launch_ready_segments();
}

void Engine::launch_ready_segments() {
  while (next_segment_ < static_cast<int>(pending_.size()) && pending_[next_segment_] == 0)
    reduce_segment(next_segment_++);
}

void Engine::reduce_segment(int s) {
  finish_pending_reduce();
  FlatParamGroup& g = *units_[kRoot]->group;
  const FlatSegment& seg = g.segments()[s];
  g.allocate_segment_grad(s);  // a bucket no parameter got a gradient in reduces zeros
  fold_strays(g, seg.first_slot, seg.end_slot);
  at::NoGradGuard no_grad;
  const at::ScalarType reduce_dtype = options_.mixed_precision.reduce.value_or(g.compute_dtype());
  const at::Tensor grads = g.segment_grad(s);
  auto pending = std::make_unique<PendingReduce>();
  pending->unit = kRoot;
  pending->segment = s;
  at::Tensor& master_grad = g.master().mutable_grad();
  if (!g.master_aliases_full() && !master_grad.defined()) {
    master_grad = at::empty({g.shard_numel()}, g.master().options());
    fresh_grad_ = true;
  }
  CollectiveOptions opts;
  if (shard_.size == 1) {
    // NoShard: every rank averages the whole bucket, in place.
    at::Tensor target = g.master_aliases_full() ? grads : g.master_part(master_grad, s);
    if (g.master_aliases_full() ? reduce_dtype == g.compute_dtype()
                                : fresh_grad_ && reduce_dtype == at::kFloat) {
      if (!target.is_same(grads)) target.copy_(grads);  // converted straight into the master's gradient
      pending->input = target;
    } else {
      pending->input = grads.to(reduce_dtype);
      pending->target = target;
      pending->add = !g.master_aliases_full() && !fresh_grad_;
    }
    pending->output = pending->input;
    opts.stream = StreamRole::AllReduce;
    if (shard_.replicas > 1) pending->work = comm_->all_reduce(pending->input, ReduceOp::Avg, opts);
  } else {
    // ShardOptimizerState: each rank receives its slice, its part of the master shard.
    pending->input = reduce_dtype == g.compute_dtype() ? grads : grads.to(reduce_dtype);
    if (fresh_grad_ && reduce_dtype == at::kFloat) {
      pending->output = g.master_part(master_grad, s);
    } else {
      pending->output = at::empty({seg.slice}, pending->input.options());
      pending->target = g.master_part(master_grad, s);
      pending->add = !fresh_grad_;
    }
    opts.stream = StreamRole::ReduceScatter;
    pending->work = comm_->reduce_scatter(pending->output, pending->input, ReduceOp::Avg, opts);
  }
  in_flight_ = std::move(pending);
}

void Engine::post_backward(int index) {
  Unit& u = *units_[index];
  if (u.post_backward_done || !u.pre_backward_done) return;
  u.post_backward_done = true;
  if (!u.group) return;
  FlatParamGroup& g = *u.group;
  {
    at::NoGradGuard no_grad;
    for (auto& slot : g.slots()) {
      const at::Tensor& grad = slot.param.grad();
      auto view = g.full_grad().narrow(0, slot.offset, slot.numel);
      if (grad.defined() && grad.data_ptr() != view.data_ptr()) view.add_(grad.reshape({-1}));
    }
  }
  g.drop_param_grads();
  if (!no_sync_) reduce(index);
  if (reshard_after_forward_ && index != kRoot) reshard(index);
}

// Note [One reduce-scatter in flight]
// Before a unit's gradients are reduce-scattered, the previous unit's reduction is
// waited for and folded into its shard gradient, and its flat gradient is freed. So at
// most one reduction (and the flat gradient it reads) is outstanding, while the
// reduce-scatter stream still overlaps the backward compute of the next unit.
void Engine::reduce(int index) {
  finish_pending_reduce();
  FlatParamGroup& g = *units_[index]->group;
  const at::ScalarType reduce_dtype = options_.mixed_precision.reduce.value_or(g.compute_dtype());
  auto pending = std::make_unique<PendingReduce>();
  pending->unit = index;
  pending->input_is_full_grad = reduce_dtype == g.compute_dtype();
  pending->input = pending->input_is_full_grad ? g.full_grad() : g.full_grad().to(reduce_dtype);
  if (!pending->input_is_full_grad) g.free_full_grad();
  CollectiveOptions opts;
  opts.stream = StreamRole::ReduceScatter;
  std::optional<Work> scattered;
  if (shard_.size == 1) {
    // Over one rank the average is the gradient itself: no collective, and no copy when
    // the conversion to the reduce dtype already made one.
    pending->output = pending->input_is_full_grad ? g.full_grad().clone() : pending->input;
  } else {
    pending->output = at::empty({g.shard_numel()}, pending->input.options().dtype(reduce_dtype));
    scattered = shard_comm().reduce_scatter(pending->output, pending->input, ReduceOp::Avg, opts);
    pending->work = scattered;
  }
  if (replica_comm_) {
    // Note [Shard groups]: the group's average, averaged over the groups that hold the
    // same shard, is the world's average (the groups are the same size).
    CollectiveOptions across;
    across.stream = StreamRole::AllReduce;
    if (scattered) across.wait_for.push_back(scattered->event());
    pending->work = replica_comm_->all_reduce(pending->output, ReduceOp::Avg, across);
  }
  in_flight_ = std::move(pending);
}

void Engine::finish_pending_reduce() {
  if (!in_flight_) return;
  auto pending = std::move(in_flight_);
  if (pending->work) pending->work->wait();
  const int pending_segment = pending->segment;
  if (pending->segment >= 0) {  // a bucket of a replicated group
    FlatParamGroup& g = *units_[pending->unit]->group;
    if (pending->target.defined()) {
      at::NoGradGuard no_grad;
      if (pending->add) {
        pending->target.add_(pending->output);
      } else {
        pending->target.copy_(pending->output);
      }
    }
    pending.reset();
    g.free_segment_grad(pending_segment);
    return;
  }
  FlatParamGroup& g = *units_[pending->unit]->group;
  at::NoGradGuard no_grad;
  // The reduced shard is this reduction's own buffer: an fp32 one becomes the gradient.
  auto reduced = pending->output.to(at::kFloat);
  if (g.offloaded()) {
    // Note [Offloaded gradients]: the reduced shard is copied to page-locked host memory
    // on the compute stream without blocking the host; end_of_backward waits for the
    // device once and adds every landed shard into the host gradients.
    auto landing = at::empty({g.shard_numel()}, g.master().options().pinned_memory(g.master().is_pinned()));
    landing.copy_(reduced, /*non_blocking=*/landing.is_pinned());
    landing_grads_.emplace_back(pending->unit, std::move(landing));
  } else {
    accumulate(g.master().mutable_grad(), std::move(reduced));
    step_now(pending->unit);
  }
  if (pending->input_is_full_grad) g.free_full_grad();
}

void Engine::end_of_replicated_backward() {
  Unit& root = *units_[kRoot];
  root.pre_backward_done = false;
  if (!root.group) return;
  FlatParamGroup& g = *root.group;
  if (!rebuilt_) arrival_recorded_ = true;
  if (no_sync_) {
    fold_strays(g, 0, static_cast<int>(g.slots().size()));
    g.drop_param_grads();
    return;
  }
  std::vector<std::string> missing;
  for (const auto& slot : g.slots()) {
    if (slot.accumulator && !used_[slot.id]) missing.push_back(slot.name);
  }
  if (!missing.empty() && !options_.find_unused_parameters) {
    g.drop_param_grads();
    g.free_full_grad();
    throw InvalidArgument(fmt::format(
        "flatshard::FullyShard (rank {}/{}): {} parameter(s) got no gradient in this backward: {}. Set "
        "FullyShardOptions::find_unused_parameters = true if parameters may go unused, or make the loss "
        "depend on them.",
        rank_, world_size_, missing.size(), fmt::join(missing, ", ")));
  }
  if (!rebuilt_) {
    // Rank 0's arrival order (then the parameters that got no gradient), so that every
    // rank lays out the same buckets.
    std::vector<int> order = arrival_;
    std::set<int> seen(order.begin(), order.end());
    for (int id = 0; id < static_cast<int>(param_names_.size()); ++id) {
      if (!seen.count(id)) order.push_back(id);
    }
    rebuild_buckets(std::move(order));
  }
  // What is left: buckets holding unused parameters (their slices hold zeros).
  for (int k = next_segment_; k < static_cast<int>(pending_.size()); ++k) reduce_segment(k);
  next_segment_ = static_cast<int>(pending_.size());
  finish_pending_reduce();
  if (g.master_aliases_full()) {
    g.alias_master_grad();
  } else {
    g.free_full_grad();
  }
  g.drop_param_grads();
  stale_ = true;  // the optimizer steps the master shard next
  account();
}

void Engine::rebuild_buckets(std::vector<int> order) {
  FlatParamGroup& g = *units_[kRoot]->group;
  if (world_size_ > 1) {
    auto shared = at::tensor(std::vector<std::int64_t>(order.begin(), order.end()), at::kLong).to(device_);
    comm_->broadcast(shared, 0).wait();
    shared = shared.cpu();
    order.assign(shared.data_ptr<std::int64_t>(), shared.data_ptr<std::int64_t>() + shared.numel());
  }
  std::vector<int> slot_of_id(g.slots().size());
  for (int k = 0; k < static_cast<int>(g.slots().size()); ++k) slot_of_id[g.slots()[k].id] = k;
  std::vector<int> slot_order;
  for (int id : order) slot_order.push_back(slot_of_id[id]);
  at::Tensor values;  // every rank's master slices, in the layout before
  if (!g.master_aliases_full()) {
    if (shard_.size == 1) {
      values = g.master().detach();  // one rank's slices are the whole buffer
    } else if (g.compute_dtype() == at::kFloat && !stale_ && g.master()._version() == master_version_) {
      values = g.full().detach();  // the parameters hold the masters' values, bit for bit
    } else {
      values = at::empty({g.padded_numel()}, g.master().options());
      for (int k = 0; k < static_cast<int>(g.segments().size()); ++k)
        comm_->all_gather(g.segment_of(values, k), g.master_part(g.master(), k)).wait();
    }
  }
  g.relayout(slot_order, bucket_sizes(order), values);
  for (int k = 0; k < static_cast<int>(g.segments().size()); ++k) {
    for (int i = g.segments()[k].first_slot; i < g.segments()[k].end_slot; ++i)
      segment_of_param_[g.slots()[i].id] = k;
  }
  pending_.assign(g.segments().size(), 0);
  next_segment_ = 0;
  master_version_ = g.master()._version();
  rebuilt_ = true;
}

void Engine::refresh_replicas() {
  const auto& group = units_[kRoot]->group;
  if (!group || (!stale_ && group->master()._version() == master_version_)) return;
  FlatParamGroup& g = *group;
  g.copy_master_to_slot();
  if (shard_.size > 1) {
    CollectiveOptions opts;
    opts.stream = StreamRole::AllGather;
    std::vector<Work> gathers;
    for (int k = 0; k < static_cast<int>(g.segments().size()); ++k)
      gathers.push_back(comm_->all_gather(g.segment_of(g.full(), k), g.slot_of(g.full(), k), opts));
    for (auto& w : gathers) w.wait();
  }
  stale_ = false;
  master_version_ = g.master()._version();
}

std::vector<std::vector<std::string>> Engine::bucket_layout() const {
  std::vector<std::vector<std::string>> out;
  if (!replicated_ || !units_[kRoot]->group) return out;
  const auto& g = *units_[kRoot]->group;
  for (const auto& seg : g.segments()) {
    out.emplace_back();
    for (int i = seg.first_slot; i < seg.end_slot; ++i) out.back().push_back(g.slots()[i].name);
  }
  return out;
}

std::vector<std::string> Engine::bucket_order() const {
  std::vector<std::string> out;
  if (!rebuilt_) return out;
  for (const auto& names : bucket_layout()) out.insert(out.end(), names.begin(), names.end());
  return out;
}

void Engine::restore_bucket_order(const std::vector<std::string>& names) {
  if (!replicated_ || !units_[kRoot]->group || rebuilt_ || backward_active_) return;
  // Whatever the saved order, the layout is fixed from here: state loaded into the master
  // shard must not move under a later rebuild.
  if (names.empty()) {
    rebuilt_ = true;
    return;
  }
  std::map<std::string, int> id_of;
  for (int id = 0; id < static_cast<int>(param_names_.size()); ++id) id_of[param_names_[id]] = id;
  std::vector<int> order;
  for (const auto& name : names) {
    auto it = id_of.find(name);
    if (it == id_of.end()) {  // another model's order: keep ours
      rebuilt_ = true;
      return;
    }
    order.push_back(it->second);
  }
  if (order.size() != param_names_.size()) {
    rebuilt_ = true;
    return;
  }
  rebuild_buckets(std::move(order));
}

void Engine::end_of_backward() {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  if (replicated_) {
    backward_active_ = false;
    end_of_replicated_backward();
    accumulating_ = no_sync_;
    if (no_sync_) return;
    ++synced_backwards_;
    check_nonfinite();
    return;
  }
  // Units whose hooks did not all fire (parameters that got no gradient this step).
  for (int i = num_units() - 1; i >= 0; --i) {
    if (units_[i]->pre_backward_done && !units_[i]->post_backward_done) post_backward(i);
  }
  finish_pending_reduce();
  land_offloaded_grads();
  for (int i = 0; i < num_units(); ++i) {
    reshard(i);
    units_[i]->pre_backward_done = false;
    units_[i]->post_backward_done = false;
  }
  backward_active_ = false;
  if (no_sync_) return;
  ++synced_backwards_;
  check_nonfinite();
}

void Engine::check_nonfinite() {
  if (options_.nonfinite_grads == NonFiniteGrads::Ignore) return;
  std::vector<at::Tensor> grads;
  for (auto& u : units_) {
    if (u->group) grads.push_back(u->group->master().grad());
  }
  const auto bad = optim::nonfinite_ranks(grads, *comm_);
  if (optim::handle_nonfinite(bad, static_cast<int>(options_.nonfinite_grads), synced_backwards_, rank_,
                              world_size_, "FullyShard")) {
    zero_grad();
    ++skipped_steps_;
  }
}

void Engine::land_offloaded_grads() {
  if (landing_grads_.empty()) return;
  // One host wait for the device-to-host copies queued on the compute stream.
  if (!device_.is_cpu()) c10::impl::VirtualGuardImpl(device_.type()).getStream(device_).synchronize();
  at::NoGradGuard no_grad;
  for (auto& [unit, landed] : landing_grads_) {
    accumulate(units_[unit]->group->master().mutable_grad(), landed);
    step_now(unit);
  }
  landing_grads_.clear();
}

// --- the rest -------------------------------------------------------------------

// Note [Step in backward]
// With an optimizer registered by step_in_backward, each unit's master shard steps as soon
// as its gradient shard is final (reduced, or landed on the host), and the gradient shard
// is freed at once: the fp32 gradients of all units never exist together. The arithmetic
// is the step's after backward (each shard steps independently); what it rules out is
// whatever needs every gradient first: clipping the global norm, and skipping a step for
// NaN/Inf.
void Engine::set_step_in_backward(optim::ShardOptimizer* optimizer) {
  step_in_backward_ = nullptr;
  shard_of_unit_.clear();
  if (!optimizer) return;
  const std::string who =
      fmt::format("flatshard::FullyShard::step_in_backward (rank {}/{})", rank_, world_size_);
  if (options_.nonfinite_grads != NonFiniteGrads::Ignore) {
    throw InvalidArgument(fmt::format(
        "{}: nonfinite_grads must be Ignore: a step in backward cannot be skipped once a unit has stepped",
        who));
  }
  if (replicated_) {
    throw InvalidArgument(fmt::format(
        "{}: strategy {} keeps the whole model's gradient until backward ends (its buckets are laid out "
        "again after the first); step in backward under FullShard, ShardGradOp or HybridShard",
        who, to_string(options_.strategy)));
  }
  const auto mine = shards();
  const auto& theirs = optimizer->shards();
  bool same = mine.size() == theirs.size();
  for (std::size_t i = 0; same && i < mine.size(); ++i) same = mine[i].is_same(theirs[i]);
  if (!same) {
    throw InvalidArgument(fmt::format(
        "{}: the optimizer does not step this FullyShard's shards (it has {}, this has {}); make it over "
        "fsdp.shards()",
        who, theirs.size(), mine.size()));
  }
  shard_of_unit_.assign(units_.size(), -1);
  int next = 0;
  for (std::size_t i = 0; i < units_.size(); ++i) {
    if (units_[i]->group) shard_of_unit_[i] = next++;
  }
  step_in_backward_ = optimizer;
}

void Engine::step_now(int unit) {
  if (!step_in_backward_ || shard_of_unit_[unit] < 0) return;
  at::NoGradGuard no_grad;
  step_in_backward_->step_shard(static_cast<std::size_t>(shard_of_unit_[unit]));
  units_[unit]->group->master().mutable_grad().reset();
}

double Engine::clip_grad_norm(double max_norm) {
  if (step_in_backward_) {
    throw InvalidArgument(
        fmt::format("flatshard::FullyShard::clip_grad_norm (rank {}/{}): the optimizer steps in backward "
                    "(step_in_backward), so no gradient is left to clip; clip without stepping in backward",
                    rank_, world_size_));
  }
  std::vector<at::Tensor> grads;
  for (auto& u : units_) {
    if (u->group) grads.push_back(u->group->master().grad());
  }
  // One group's shards make the whole model once (the other groups hold the same); a
  // group of one rank (NoShard) holds all of it.
  return optim::clip_by_global_norm(grads, max_norm, shard_.size > 1 ? &shard_comm() : nullptr);
}

void Engine::zero_grad() {
  for (auto& u : units_) {
    if (u->group) u->group->master().mutable_grad().reset();
  }
}

void Engine::gather_all() {
  if (replicated_) refresh_replicas();
  for (int i = 0; i < num_units(); ++i) unshard(i);
}

void Engine::reshard_all() {
  for (int i = 0; i < num_units(); ++i) reshard(i);
}

void Engine::account() {
  std::int64_t params = 0, grads = 0;
  for (auto& u : units_) {
    if (!u->group) continue;
    params += static_cast<std::int64_t>(u->group->full().storage().nbytes());
    grads += u->group->full_grad_bytes();
  }
  memory_.unsharded_param_bytes = params;
  memory_.unsharded_grad_bytes = grads;
  memory_.peak_unsharded_param_bytes = std::max(memory_.peak_unsharded_param_bytes, params);
  memory_.peak_unsharded_grad_bytes = std::max(memory_.peak_unsharded_grad_bytes, grads);
  peak_gathered_units_ = std::max(peak_gathered_units_, gathered_non_root_units());
}

ShardMemory Engine::memory() const {
  ShardMemory m = memory_;
  m.unsharded_param_bytes = 0;
  m.unsharded_grad_bytes = 0;
  m.grad_shard_bytes = 0;
  for (auto& u : units_) {
    if (!u->group) continue;
    m.unsharded_param_bytes += static_cast<std::int64_t>(u->group->full().storage().nbytes());
    m.unsharded_grad_bytes += u->group->full_grad_bytes();
    if (u->group->master().grad().defined()) m.grad_shard_bytes += u->group->master().grad().nbytes();
  }
  return m;
}

std::int64_t Engine::unit_bytes(bool root) const {
  std::int64_t bytes = 0;
  for (std::size_t i = root ? 0 : 1; i < (root ? 1 : units_.size()); ++i) {
    if (units_[i]->group) bytes = std::max(bytes, units_[i]->group->full_bytes());
  }
  return bytes;
}

void Engine::reset_peaks() {
  account();
  memory_.peak_unsharded_param_bytes = memory_.unsharded_param_bytes;
  memory_.peak_unsharded_grad_bytes = memory_.unsharded_grad_bytes;
  peak_gathered_units_ = gathered_non_root_units();
}

}  // namespace flatshard::sharding
