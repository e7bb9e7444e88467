#include "sharding/unit_discovery.h"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "flatshard/errors.h"
#include "flatshard/memory.h"

#include "flatshard/plan.h"
#include "sharding/flat_param.h"

namespace flatshard::sharding {

UnitMembership discover_units(torch::nn::Module& model) {
  UnitMembership m;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    if (auto* provider = dynamic_cast<UnitProvider*>(item.value().get())) {
      for (UnitBase* u : provider->provided_units()) m.declared.push_back(u);
    }
  }
  std::vector<std::set<const c10::TensorImpl*>> members(m.declared.size());
  for (std::size_t i = 0; i < m.declared.size(); ++i) {
    for (torch::nn::Module* sub : m.declared[i]->unit_modules()) {
      for (const auto& p : sub->parameters(/*recurse=*/true)) members[i].insert(p.unsafeGetTensorImpl());
    }
  }
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto* impl = item.value().unsafeGetTensorImpl();
    int best = 0;
    for (std::size_t i = 0; i < m.declared.size(); ++i) {
      if (members[i].count(impl) && (best == 0 || members[i].size() < members[best - 1].size())) {
        best = static_cast<int>(i) + 1;
      }
    }
    m.owner[impl] = best;
  }
  return m;
}

void check_ties_in_one_unit(torch::nn::Module& model, const UnitMembership& m, const std::string& who) {
  // Each module's innermost unit (0: the root), as discover_units picks a parameter's.
  std::unordered_map<const torch::nn::Module*, int> unit_of;
  std::vector<std::size_t> sizes(m.declared.size(), 0);
  for (std::size_t i = 0; i < m.declared.size(); ++i) {
    for (torch::nn::Module* sub : m.declared[i]->unit_modules()) sizes[i] += sub->parameters(true).size();
  }
  for (std::size_t i = 0; i < m.declared.size(); ++i) {
    for (torch::nn::Module* sub : m.declared[i]->unit_modules()) {
      for (const auto& inner : sub->modules(/*include_self=*/true)) {
        auto& u = unit_of[inner.get()];
        if (u == 0 || sizes[i] < sizes[static_cast<std::size_t>(u) - 1]) u = static_cast<int>(i) + 1;
      }
    }
  }
  const auto unit_name = [&](int u) {
    return u == 0 ? std::string("the root unit") : fmt::format("unit {}", u);
  };
  // Each tensor's first name and unit.
  std::unordered_map<const c10::TensorImpl*, std::pair<std::string, int>> first;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const auto it = unit_of.find(item.value().get());
    const int unit = it == unit_of.end() ? 0 : it->second;
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      const std::string name = item.key().empty() ? p.key() : item.key() + "." + p.key();
      const auto [at, fresh] = first.emplace(p.value().unsafeGetTensorImpl(), std::make_pair(name, unit));
      if (fresh || at->second.second == unit) continue;
      throw InvalidArgument(
          fmt::format("{}: '{}' and '{}' are one tensor (tied weights) in two units ({} and {}); each unit "
                      "gathers only its "
                      "own parameters, so a tied weight must sit in one unit: declare the modules that share "
                      "it inside one "
                      "unit (or leave both outside every unit, in the root), or untie them",
                      who, at->second.first, name, unit_name(at->second.second), unit_name(unit)));
    }
  }
}

void check_memory_budget(torch::nn::Module& model, const World& world, Strategy mode, int param_bytes,
                         const MemoryBudget& budget, const char* who, int shard_group_size, bool cpu_offload,
                         bool on_gpu, bool built_on_host, bool find_unused_parameters) {
  if (budget.bytes <= 0) return;
  plan::PlanOptions o;
  // On a GPU the budget is the device's, and offloaded states are the host's; on the CPU
  // both are the same memory.
  o.cpu_offload = cpu_offload && on_gpu;
  o.build_on_host = built_on_host && on_gpu;
  o.cpu_compute = !on_gpu;
  o.find_unused_parameters = find_unused_parameters;
  o.strategy = mode;
  o.world_size = world.world_size();
  o.shard_group_size = shard_group_size < world.world_size() ? shard_group_size : 0;
  o.param_bytes = param_bytes;
  o.optimizer_state_bytes = budget.optimizer_state_bytes;
  o.activation_bytes = budget.activation_bytes;
  for (UnitBase* unit : discover_units(model).declared)
    o.build_into_shards = o.build_into_shards || unit->built_shard();
  const auto shape = plan::shape_of(model);
  const auto need = plan::predict(shape, o);
  if (need.peak <= budget.bytes) return;
  const auto mib = [](std::int64_t b) { return static_cast<double>(b) / (1 << 20); };
  std::string offload_advice;
  if (on_gpu && !cpu_offload) {
    auto f = o;
    f.cpu_offload = true;
    const auto offloaded = plan::predict(shape, f);
    if (offloaded.peak <= budget.bytes) {
      offload_advice = fmt::format(
          "; with cpu_offload it needs {:.1f} MiB of device memory and {:.1f} MiB of host memory per rank",
          mib(offloaded.peak), mib(offloaded.host_peak()));
    }
  }
  o.strategy = Strategy::FullShard;
  o.build_into_shards = true;
  const auto full = plan::predict(shape, o);
  std::string advice;
  if (full.peak <= budget.bytes && (mode != Strategy::FullShard || need.construction > budget.bytes)) {
    advice = fmt::format(
        "FullyShard (full shard) with the model built into shards (BuildIntoShards) needs about {:.1f} MiB "
        "per "
        "rank at this world size: use it",
        mib(full.peak));
  } else {
    int ranks = world.world_size();
    while (ranks < (1 << 16) && plan::predict(shape,
                                              [&] {
                                                auto f = o;
                                                f.world_size = ranks;
                                                return f;
                                              }())
                                        .peak > budget.bytes)
      ranks *= 2;
    advice = ranks < (1 << 16) ? fmt::format("full shard fits at {} ranks", ranks)
                               : "no world size fits: raise the budget";
  }
  throw MemoryBudgetError(
      need.peak, budget.bytes,
      fmt::format(
          "flatshard::{} (rank {}/{}): training this model ({} parameters) in mode {} needs {:.1f} MiB "
          "per rank{}, more than the memory budget of {:.1f} MiB ({}). {}{}; or raise the budget.",
          who, world.rank(), world.world_size(), shape.total(), mode_name(mode), mib(need.peak),
          budget.activation_bytes > 0 ? "" : " before activations", mib(budget.bytes), need.describe(),
          advice, offload_advice));
}

std::int64_t require_usable_device(const c10::Device& device, const std::string& who,
                                   const std::string& not_done) {
  if (!device.is_cuda()) return 0;
  std::int64_t total = 0;
  try {
    total = memory::cuda_total_bytes(device.index() < 0 ? 0 : device.index());
  } catch (const std::exception&) {
    total = 0;  // no such device: said below
  }
  if (total > 0) return total;
  throw InvalidArgument(fmt::format(
      "{}: options.device is {}, but this process can use no such CUDA device (none visible, "
      "CUDA_VISIBLE_DEVICES leaves it out, its index is past the visible ones, or flatshard::cuda is not "
      "linked); {}. Give each rank a visible device (cuda:<local rank>, World::local_rank()), train on the "
      "CPU (leave options.device unset), or link flatshard::cuda",
      who, device.str(), not_done));
}

}  // namespace flatshard::sharding

namespace flatshard::plan {

ModelShape shape_of(torch::nn::Module& model) {
  const auto m = sharding::discover_units(model);
  ModelShape shape;
  shape.unit_numels.assign(m.declared.size(), 0);
  shape.unit_frozen.assign(m.declared.size(), 0);
  std::set<const c10::TensorImpl*> seen;
  // A unit built into shards (build.h) has empty parameters: its group knows their sizes.
  for (std::size_t i = 0; i < m.declared.size(); ++i) {
    if (const auto& g = m.declared[i]->built_shard()) {
      shape.unit_numels[i] = g->numel();
      for (auto& slot : g->slots()) {
        seen.insert(slot.param.unsafeGetTensorImpl());
        if (!slot.param.requires_grad()) shape.unit_frozen[i] += slot.numel;  // frozen since it was built
        shape.largest_param_numel = std::max(shape.largest_param_numel, slot.numel);
      }
    }
  }
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto* impl = item.value().unsafeGetTensorImpl();
    if (!seen.insert(impl).second) continue;
    const int unit = m.owner.at(impl);
    (unit == 0 ? shape.root_numel : shape.unit_numels[unit - 1]) += item.value().numel();
    if (!item.value().requires_grad())
      (unit == 0 ? shape.root_frozen : shape.unit_frozen[unit - 1]) += item.value().numel();
    shape.largest_param_numel = std::max(shape.largest_param_numel, item.value().numel());
  }
  return shape;
}

}  // namespace flatshard::plan
