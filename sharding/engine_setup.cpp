// The engine's construction: units discovered and flattened (or adopted when built into
// shards), checked across ranks, communicators made; and what it exports (shards, layout).
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "flatshard/errors.h"
#include "sharding/engine_parts.h"
#include "sharding/model_check.h"
#include "sharding/unit_discovery.h"
#include "src/errors.h"
#include "src/logging.h"

namespace flatshard::sharding {
namespace {

using detail::AccumulatedHook;

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

// Note [Built units frozen afterwards]
// A unit built into shards (build.h) is laid out as one group while it is built, before
// its user can freeze anything. Frozen afterwards in part (LoRA on a model built into
// shards), it is taken apart when it is adopted so that it gets the layout of a whole
// build (Note [Partly frozen units] in sharding/engine.cpp): its fp32 master slices are
// gathered across the shard group into its full values, its parameters take them back
// for a moment, and the unit is flattened as a unit built whole is, into its trained
// group and its frozen part. A rank holds one such unit at full size (fp32) at a time,
// as it did while building. Collective: every rank has the same units frozen alike
// (check_same_model_everywhere has compared them).
bool mixes_frozen_and_trained(const FlatParamGroup& g) {
  bool frozen = false, trained = false;
  for (const auto& slot : g.slots()) (slot.param.requires_grad() ? trained : frozen) = true;
  return frozen && trained;
}

std::vector<std::pair<std::string, at::Tensor>> unbuild(FlatParamGroup& g, Communicator& shard_comm) {
  const at::Tensor values = detail::gather_master_values(g, shard_comm);
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (auto& slot : g.slots()) {
    slot.param.set_data(values.narrow(0, slot.offset, slot.numel).view(slot.shape));
    params.emplace_back(slot.name, slot.param);
  }
  return params;
}

// Note [One wrapper per model]
// A wrapper takes over its model's parameters: their values move into flat buffers it
// owns, and under the sharded strategies the parameters are left as empty views between
// gathers. A second wrapper on the same model would flatten parameters another wrapper
// drives (or, once that one is gone, parameters it laid out for itself) and train garbage.
// So every model a wrapper was built on is remembered (weakly: a model that is destroyed
// leaves the list) from the moment the wrapper starts laying it out, and a second wrapper
// is refused whether the first is alive, destroyed, or failed midway (its constructor
// threw after the layout began, leaving the parameters placeholders). A wrapper refused
// before that moment (bad options, models that differ across ranks) leaves no trace: the
// model can be wrapped again.
enum class WrapperState { Alive, Destroyed, Failed };
struct WrappedModel {
  std::weak_ptr<torch::nn::Module> model;
  WrapperState state = WrapperState::Alive;
};
std::mutex wrapped_mutex;
std::vector<WrappedModel> wrapped_models;

void set_wrapper_state(const std::shared_ptr<torch::nn::Module>& model, WrapperState state) {
  std::lock_guard<std::mutex> lock(wrapped_mutex);
  for (auto& w : wrapped_models) {
    if (w.model.lock() == model) {
      w.state = state;
      return;
    }
  }
  wrapped_models.push_back({model, state});
}

// Marks the model as Failed unless the constructor that made it reaches its end.
class LayoutInProgress {
 public:
  explicit LayoutInProgress(std::shared_ptr<torch::nn::Module> model) : model_(std::move(model)) {
    set_wrapper_state(model_, WrapperState::Alive);
  }
  ~LayoutInProgress() {
    if (!done_) set_wrapper_state(model_, WrapperState::Failed);
  }
  void done() { done_ = true; }

 private:
  std::shared_ptr<torch::nn::Module> model_;
  bool done_ = false;
};

// What Note [Same values on every rank] compares:// What Note [Same values on every rank] compares: each
// unit's parameters (those not built into shards, which were compared as they were built), then the model's
// buffers.
std::vector<NamedValues> values_to_compare(torch::nn::Module& model, const std::vector<UnitBase*>& declared,
                                           const std::unordered_map<const c10::TensorImpl*, int>& owner,
                                           const std::vector<std::shared_ptr<FlatParamGroup>>& built) {
  std::unordered_map<const torch::nn::Module*, std::string> path_of;  // a unit's place in the model
  for (const auto& item : model.named_modules()) path_of[item.value().get()] = item.key();
  std::vector<NamedValues> units(built.size());
  for (std::size_t i = 0; i < declared.size(); ++i) {
    const auto modules = declared[i]->unit_modules();
    const auto it = modules.size() == 1 ? path_of.find(modules.front()) : path_of.end();
    units[i + 1].name =
        it != path_of.end() ? fmt::format("unit '{}'", it->second) : fmt::format("unit #{}", i + 1);
  }
  units[0].name = "the root unit (parameters outside every unit)";
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto* impl = item.value().unsafeGetTensorImpl();
    const auto it = owner.find(impl);
    if (it == owner.end() || !seen.insert(impl).second || built[it->second]) continue;
    const int unit = it->second;
    units[unit].tensors.push_back(item.value());
  }
  std::vector<NamedValues> out;
  for (auto& entry : units) {
    if (!entry.tensors.empty()) out.push_back(std::move(entry));
  }
  NamedValues buffers{"the model's buffers", {}};
  for (const auto& b : model.buffers(/*recurse=*/true)) {
    if (b.defined()) buffers.tensors.push_back(b);
  }
  if (!buffers.tensors.empty()) out.push_back(std::move(buffers));
  return out;
}

// Under the replicated strategies the declared units are not scheduled (the model is one
// group of buckets); they keep only the cast of their inputs (Note [Casting forward inputs]).
class InputCast final : public UnitHooks {
 public:
  explicit InputCast(const Engine* engine) : engine_(engine) {}
  void pre_forward() override {}
  std::vector<at::Tensor> post_forward(std::vector<at::Tensor> outputs) override { return outputs; }
  std::optional<at::ScalarType> input_dtype() const override { return engine_->input_dtype(); }

 private:
  const Engine* engine_;
};

class Driver final : public UnitHooks {
 public:
  Driver(Engine* engine, int unit) : engine_(engine), unit_(unit) {}
  void pre_forward() override { engine_->pre_forward(unit_); }
  std::optional<at::ScalarType> input_dtype() const override { return engine_->input_dtype(); }
  bool watches_inputs() const override { return engine_->watches_inputs(unit_); }
  void watch_inputs(const std::vector<at::Tensor>& inputs) override { engine_->watch_inputs(unit_, inputs); }
  std::vector<at::Tensor> post_forward(std::vector<at::Tensor> outputs) override {
    return engine_->post_forward(unit_, std::move(outputs));
  }

 private:
  Engine* engine_;
  int unit_;
};

}  // namespace

void refuse_a_second_wrapper(const std::shared_ptr<torch::nn::Module>& model, const World& world) {
  std::lock_guard<std::mutex> lock(wrapped_mutex);
  wrapped_models.erase(std::remove_if(wrapped_models.begin(), wrapped_models.end(),
                                      [](const WrappedModel& w) { return w.model.expired(); }),
                       wrapped_models.end());
  for (const auto& w : wrapped_models) {
    if (w.model.lock() != model) continue;
    const char* first = w.state == WrapperState::Alive ? "that is still alive"
                        : w.state == WrapperState::Destroyed
                            ? "that has since been destroyed"
                            : "whose construction failed after it began laying the "
                              "parameters out";
    throw InvalidArgument(fmt::format(
        "flatshard::FullyShard (rank {}/{}): this model was already wrapped by a FullyShard {}. A model "
        "takes "
        "one wrapper: {}",
        world.rank(), world.world_size(), first,
        w.state == WrapperState::Alive
            ? "use the one it has (its forward, optimizer and checkpoints)"
            : "its parameters were laid out for that wrapper; build the model again (and load its values "
              "from a checkpoint with checkpoint::load_sharded on the new wrapper)"));
  }
}

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
  check_communication_options();
  for (const auto& [field, dtype] : {std::pair{"param", options_.mixed_precision.param},
                                     std::pair{"reduce", options_.mixed_precision.reduce},
                                     std::pair{"output", options_.mixed_precision.output}}) {
    if (dtype && !at::isFloatingType(*dtype)) {
      throw InvalidArgument(fmt::format(
          "flatshard::FullyShard (rank {}/{}): mixed_precision.{} is {}, not a floating-point dtype; use "
          "kBFloat16, kHalf or kFloat, or leave it unset",
          rank_, world_size_, field, c10::toString(*dtype)));
    }
  }
  const auto membership = discover_units(*model_);
  if (!replicated_) {
    check_ties_in_one_unit(*model_, membership,
                           fmt::format("flatshard::FullyShard (rank {}/{})", rank_, world_size_));
  }
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
  require_usable_device(device_, fmt::format("flatshard::FullyShard (rank {}/{})", rank_, world_size_),
                        "nothing was placed on it and the model is untouched");
  if (!first_param.empty() && model_device != device_ && !model_device.is_cpu()) {
    throw InvalidArgument(fmt::format(
        "flatshard::FullyShard (rank {}/{}): the model is on {} and options.device is {}; build the model on "
        "the host (the CPU) to have it sharded onto {}, or leave options.device unset",
        rank_, world_size_, model_device.str(), device_.str(), device_.str()));
  }
  FlatParamGroup::Placement placement;
  placement.compute = device_;
  placement.offload = options_.cpu_offload;
  placement.bf16_copy = options_.offload_bf16_copy;
  for (const auto& g : built) {
    if (g) adopt_built(*g, rank_, world_size_, shard_, compute, placement, built_names);
  }
  // The scheduler's collectives move tensors of the compute device: TCP rings on the
  // CPU; on CUDA, NCCL on the communicator's high-priority streams.
  CommunicatorOptions comm_options = options_.comm;
  comm_options.device = device_;
  comm_ = Communicator::create(world, comm_options);
  if (options_.cpu_offload && device_.is_cuda()) {  // Note [Copies beside compute]
    copy_in_ = std::make_unique<CopyStream>(device_);
    copy_out_ = std::make_unique<CopyStream>(device_);
  }
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
        {fmt::format("strategy {}, shard groups of {} ranks, reshard after forward {}, prefetch {}, "
                     "sync_module_states {}",
                     to_string(options_.strategy), shard_.size, reshard_after_forward_, options_.prefetch,
                     static_cast<int>(options_.sync_module_states)),
         fmt::format("units: {}", fmt::join(units, "; ")),
         fmt::format("compute dtype {}", c10::toString(compute))});
  }
  if (!replicated_) {  // the replicated strategies start from rank 0's values (make_replicated_group)
    reconcile_values(*comm_, values_to_compare(*model_, declared, owner, built), options_.sync_module_states,
                     "flatshard::FullyShard");
  }
  LayoutInProgress layout_in_progress(model_);  // Note [One wrapper per model]
  if (shard_.size < world_size_ && !replicated_) {
    // Note [Shard groups]: group k is ranks [k G, (k + 1) G); replica set j is the ranks
    // j, G + j, 2 G + j, ... that hold shard j. Made after the check above (a rank with
    // other groups would wait in rendezvous), by every rank in the same order. Each is named
    // by its index and its kind's count ("/shard1of2": group 1 of 2; "/replica0of4": the
    // ranks holding shard 0 of 4), so that the ranks' logs tell the groups' ops apart
    // (bench/wait_trace.py keys each op on its communicator's name), and a name always
    // means the same ranks of this world: a communicator's rendezvous counts the
    // communicators of its name made before it, which its ranks must agree on across
    // wrappers of other group sizes.
    std::vector<int> group, replicas;
    for (int r = 0; r < shard_.size; ++r) group.push_back(shard_.replica * shard_.size + r);
    for (int k = 0; k < shard_.replicas; ++k) replicas.push_back(k * shard_.size + shard_.rank);
    CommunicatorOptions shard_options = comm_options, replica_options = comm_options;
    shard_options.name += fmt::format("/shard{}of{}", shard_.replica, shard_.replicas);
    replica_options.name += fmt::format("/replica{}of{}", shard_.rank, shard_.size);
    shard_comm_ = Communicator::create(subworld(world, group, shard_options.name), shard_options);
    replica_comm_ = Communicator::create(subworld(world, replicas, replica_options.name), replica_options);
  }

  // Buffers (running statistics, masks) are replicated: they go to the compute device.
  for (auto& b : model_->buffers(/*recurse=*/true)) {
    if (!b.defined()) continue;
    if (b.device() != device_) b.set_data(b.to(device_));
    buffers_.push_back(b);
  }
  if (replicated_) {
    make_replicated_group(std::move(params[0]), compute, placement, owner);
    if (input_dtype()) {
      for (UnitBase* unit : declared) {
        input_casts_.emplace_back(unit, std::make_unique<InputCast>(this));
        unit->attach(input_casts_.back().second.get());
      }
    }
  }
  for (std::size_t i = 0; !replicated_ && i <= declared.size(); ++i) {
    auto unit = std::make_unique<Unit>();
    std::unique_ptr<Unit> frozen_part;  // Note [Partly frozen units]
    const int index = static_cast<int>(units_.size());
    unit->name = i == 0 ? "root" : fmt::format("unit{}", i);
    if (built[i] && mixes_frozen_and_trained(*built[i])) {  // Note [Built units frozen afterwards]
      params[i] = unbuild(*built[i], shard_comm());
      built[i].reset();
      declared[i - 1]->set_built_shard(nullptr);
    }
    if (built[i]) {
      const std::string& first = built[i]->slots().front().name;
      unit->name = first.substr(0, first.rfind('.'));
      built[i]->set_name(unit->name);
      unit->group = std::move(built[i]);
      declared[i - 1]->set_built_shard(nullptr);
    } else if (!params[i].empty()) {
      unit->name = i == 0 ? "root" : params[i].front().first.substr(0, params[i].front().first.rfind('.'));
      auto frozen = detail::take_frozen(params[i]);
      if (params[i].empty()) {
        std::swap(params[i], frozen);  // wholly frozen: one group (Note [Frozen units])
      } else if (!frozen.empty()) {    // Note [Partly frozen units]
        frozen_part = std::make_unique<Unit>();
        frozen_part->name = unit->name + " (frozen)";
        frozen_part->owner = index;
        frozen_part->group = std::make_shared<FlatParamGroup>(frozen_part->name, std::move(frozen),
                                                              shard_.size, shard_.rank, compute, placement);
        unit->frozen_part = index + 1;
      }
      unit->group = std::make_shared<FlatParamGroup>(unit->name, std::move(params[i]), shard_.size,
                                                     shard_.rank, compute, placement);
    }
    if (unit->group) {
      unit->group->forget_frozen();
      for (auto& slot : unit->group->slots()) {
        if (slot.accumulator)
          slot.accumulator->add_post_hook(std::make_unique<AccumulatedHook>(this, index, slot.id));
        else
          unit->waits_for_inputs = i > 0;
      }
    }
    if (frozen_part) unit->waits_for_inputs = i > 0;
    if (i > 0) {
      unit->declared = declared[i - 1];
      unit->driver = std::make_unique<Driver>(this, index);
      unit->declared->attach(unit->driver.get());
    }
    units_.push_back(std::move(unit));
    if (frozen_part) units_.push_back(std::move(frozen_part));
  }
  if (device_.is_cpu()) {
    // Note [Reused host buffers]: two of the largest buffers (a bucket's gradient under
    // the replicated strategies, a unit's gathered buffer under full shard); every unit's
    // gathered buffer under shard-grad-op, which holds them all from forward to the end of
    // backward anyway.
    std::int64_t largest = 0, gathered = 0;
    for (auto& u : units_) {
      if (!u->group) continue;
      const FlatParamGroup& g = *u->group;
      gathered += g.full_bytes();
      if (!replicated_) largest = std::max(largest, g.full_bytes());
      for (const FlatSegment& seg : g.segments())
        if (replicated_) largest = std::max(largest, seg.padded_numel * g.full_bytes() / g.padded_numel());
    }
    host_buffers_ = std::make_shared<BufferPool>(
        static_cast<std::size_t>(replicated_ || reshard_after_forward_ ? 2 * largest : gathered));
  }
  for (auto& u : units_) {
    if (u->group) u->group->set_pool(host_buffers_);
    if (u->group) memory_.param_shard_bytes += u->group->shard_numel() * 4;
    got_grad_.emplace_back(u->group ? u->group->slots().size() : 0, 0);
  }
  params_with_grad_.assign(shards().size(), {});
  layout_in_progress.done();
  log::at(log::Level::Info, "FullyShard: {} units, {} parameters", units_.size(), owner.size());
}

Engine::~Engine() {
  try {
    finish_steps_beside_backward();
    finish_pending_reduce();
    for (auto& w : early_gathers_) w.wait();
    for (auto& u : units_) {
      if (u->gather) u->gather->wait();
    }
  } catch (const std::exception& e) {
    log::at(log::Level::Warn, "FullyShard: a collective failed during teardown: {}", e.what());
  }
  for (auto& u : units_) {
    if (u->declared) u->declared->attach(nullptr);
  }
  for (auto& [unit, cast] : input_casts_) unit->attach(nullptr);
  set_wrapper_state(model_, WrapperState::Destroyed);
}

std::vector<at::Tensor> Engine::shards() const {
  std::vector<at::Tensor> out;
  for (const auto& u : units_) {
    if (u->group) out.push_back(u->group->master());
  }
  return out;
}

FlatParamGroup& Engine::group_of_shard(std::size_t shard) {
  std::size_t k = 0;  // shard i is the i-th unit that has a group (shards())
  for (const auto& u : units_) {
    if (u->group && k++ == shard) return *u->group;
  }
  throw InvalidArgument(fmt::format("flatshard::FullyShard: there is no shard {} (there are {})", shard, k));
}

at::Tensor Engine::bf16_copy_for_step(std::size_t shard) {
  return group_of_shard(shard).bf16_copy_for_step();
}
void Engine::bf16_copy_written(std::size_t shard) { group_of_shard(shard).bf16_copy_written(); }
void Engine::wait_for_shard_reads() {
  std::lock_guard<std::recursive_mutex> lock(hooks_mutex_);
  // Steps of a failed backward still running beside it would write the masters after this
  // returns (Note [A backward that failed]); a step refuses partial gradients before it
  // gets here, so this is a load's case.
  if (backward_failed()) abandon_backward();
  // The sharded strategies' gathers copy from the host shards on the copy-in stream; the
  // replicated ones refresh their parameters from the host masters on the compute stream
  // (refresh_replicas, gather_all): wait for both.
  if (copy_in_) wait_for_device_and_copies();
}

at::ScalarType Engine::param_dtype() const {
  for (const auto& u : units_) {
    if (u->group) return u->group->compute_dtype();
  }
  return options_.mixed_precision.param.value_or(at::kFloat);
}

const std::vector<char>& Engine::params_with_grad(std::size_t shard) const {
  return params_with_grad_.at(shard);
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

}  // namespace flatshard::sharding
