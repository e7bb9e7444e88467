// BuildIntoShards: units shard themselves as they are built (build.h).
#include "flatshard/build.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "flatshard/communicator.h"
#include "flatshard/errors.h"
#include "flatshard/memory.h"
#include "sharding/build_checks.h"
#include "sharding/flat_param.h"
#include "sharding/model_check.h"
#include "sharding/unit_discovery.h"

namespace flatshard {

struct BuildIntoShards::State {
  World world;
  FullyShardOptions options;
  std::unique_ptr<Communicator> comm;  // for the fingerprints; none for a single process
  BuildReport report;
  bool failed = false;  // a unit was refused: the model under construction is gone
};

namespace {

thread_local BuildIntoShards::State* active = nullptr;

double mib(std::int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// The unit's type as its user wrote it ("Block" for a Unit<Block>).
std::string type_of(UnitBase& unit) {
  const auto modules = unit.unit_modules();
  if (modules.size() != 1) return fmt::format("a group of {} modules", modules.size());
  std::string name = modules.front()->name();
  const std::string wrapper = "flatshard::UnitImpl<";
  if (name.rfind(wrapper, 0) == 0 && name.back() == '>')
    name = name.substr(wrapper.size(), name.size() - wrapper.size() - 1);
  const auto colon = name.rfind("::");
  if (colon != std::string::npos) name = name.substr(colon + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

// The unit's own parameters, by name relative to it: those of its modules, minus those of
// units nested in it (already built into shards of their own) and tied repeats.
std::vector<std::pair<std::string, at::Tensor>> own_parameters(UnitBase& unit) {
  std::set<const c10::TensorImpl*> nested;
  for (torch::nn::Module* m : unit.unit_modules()) {
    for (const auto& item : m->named_modules("", /*include_self=*/false)) {
      auto* provider = dynamic_cast<UnitProvider*>(item.value().get());
      if (!provider) continue;
      for (UnitBase* inner : provider->provided_units()) {
        if (!inner->built_shard()) continue;
        for (auto& slot : inner->built_shard()->slots()) nested.insert(slot.param.unsafeGetTensorImpl());
      }
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<const c10::TensorImpl*> seen;
  const auto modules = unit.unit_modules();
  for (std::size_t k = 0; k < modules.size(); ++k) {
    for (const auto& item : modules[k]->named_parameters(/*recurse=*/true)) {
      const auto* impl = item.value().unsafeGetTensorImpl();
      if (nested.count(impl) || !seen.insert(impl).second) continue;
      out.emplace_back(modules.size() == 1 ? item.key() : fmt::format("{}.{}", k, item.key()), item.value());
    }
  }
  return out;
}

// What every rank must agree on for one unit: its structure and its values.
struct Fingerprint {
  std::int64_t numel = 0;
  std::uint64_t structure = 0;
  std::uint64_t values = 0;
};

Fingerprint fingerprint(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  Fingerprint f;
  f.structure = 0x5EED;
  f.values = 0x5EED;
  for (const auto& [name, p] : params) {
    const std::string line =
        fmt::format("{} {} {}", name, c10::toString(p.scalar_type()), fmt::join(p.sizes(), "x"));
    f.structure = sharding::hash_bytes(f.structure, line.data(), line.size());
    f.numel += p.numel();
    const auto bytes = p.detach().to(c10::kCPU).contiguous();
    f.values = sharding::hash_bytes(f.values, bytes.data_ptr(), static_cast<std::size_t>(bytes.nbytes()));
  }
  return f;
}

// Every rank's fingerprint of the same unit; throws on every rank when they differ.
void compare_across_ranks(BuildIntoShards::State& s, const Fingerprint& mine, const std::string& unit) {
  const int n = s.world.world_size(), rank = s.world.rank();
  if (!s.comm) return;
  auto all = at::zeros({3 * n}, at::TensorOptions().dtype(at::kLong));
  auto slot = all.narrow(0, 3 * rank, 3);
  slot[0] = mine.numel;
  slot[1] = static_cast<std::int64_t>(mine.structure);
  slot[2] = static_cast<std::int64_t>(mine.values);
  s.comm->all_gather(all, slot).wait();
  const auto* v = all.data_ptr<std::int64_t>();
  std::map<std::pair<std::int64_t, std::int64_t>, std::vector<int>> builds;  // (structure, values) -> ranks
  for (int r = 0; r < n; ++r) builds[{v[3 * r + 1], v[3 * r + 2]}].push_back(r);
  if (builds.size() == 1) return;
  bool same_structure = true;
  for (int r = 1; r < n; ++r) same_structure = same_structure && v[3 * r + 1] == v[1];
  std::vector<std::string> sides;
  for (const auto& [key, ranks] : builds) {
    sides.push_back(fmt::format("rank{} {} ({} elements)", ranks.size() > 1 ? "s" : "",
                                fmt::join(ranks, ", "), v[3 * ranks.front()]));
  }
  throw InvalidArgument(fmt::format(
      "flatshard::BuildIntoShards (rank {}/{}): {} was built differently across ranks: {} each built one "
      "version. {} Nothing of it was sharded or trained.",
      rank, n, unit, fmt::join(sides, " / "),
      same_structure ? "Its shapes agree but its values differ: seed every rank alike (torch::manual_seed "
                       "with the same value) before building."
                     : "Its parameters' names or shapes differ: build the same model config on every rank."));
}

}  // namespace

namespace sharding {

std::optional<Misfit> unit_does_not_fit(const UnitFit& f) {
  if (f.budget > 0 && f.unit_bytes + f.shard_bytes_before > f.budget) {
    return Misfit{
        fmt::format(
            "{} holds {:.1f} MiB of parameters at full size{}, more than the memory budget of {:.1f} MiB: {}",
            f.unit, mib(f.unit_bytes),
            f.shard_bytes_before > 0
                ? fmt::format(" besides {:.1f} MiB of shards built before it", mib(f.shard_bytes_before))
                : std::string(),
            mib(f.budget),
            f.unit_bytes > f.budget
                ? "even this unit alone does not fit. Split it into smaller units or raise the budget."
                : "use more ranks (smaller shards), split the unit, or raise the budget."),
        f.unit_bytes + f.shard_bytes_before, f.budget};
  }
  if (f.device_bytes > 0 && f.gathered_bytes > f.device_bytes) {
    return Misfit{
        fmt::format("{} needs {:.1f} MiB on {} while gathered with its gradient, more than the device's "
                    "{:.1f} MiB. Split it into smaller units, or gather it in a smaller dtype "
                    "(mixed_precision.param).",
                    f.unit, mib(f.gathered_bytes), f.device, mib(f.device_bytes)),
        f.gathered_bytes, f.device_bytes};
  }
  return std::nullopt;
}

}  // namespace sharding

BuildIntoShards::BuildIntoShards(const World& world, const FullyShardOptions& options)
    : state_(std::make_unique<State>()) {
  if (active != nullptr) {
    throw InvalidArgument(fmt::format(
        "flatshard::BuildIntoShards (rank {}/{}): another BuildIntoShards is active on this thread; end it "
        "(let it go out of scope) before starting a new one",
        world.rank(), world.world_size()));
  }
  state_->world = world;
  state_->options = options;
  if (world.world_size() > 1) {
    CommunicatorOptions o;
    o.timeout = options.comm.timeout;
    o.name = options.comm.name + "/build";
    state_->comm = Communicator::create(world, o);
  }
  active = state_.get();
}

BuildIntoShards::~BuildIntoShards() { active = nullptr; }

BuildReport BuildIntoShards::report() const { return state_->report; }

namespace detail {

namespace {

void shard_unit(BuildIntoShards::State* s, UnitBase& unit) {
  const int rank = s->world.rank(), n = s->world.world_size();
  auto params = own_parameters(unit);
  const std::string name =
      fmt::format("unit #{} ({}{})", s->report.units + 1, type_of(unit),
                  params.empty() ? "" : ", first parameter '" + params.front().first + "'");
  const std::string who = fmt::format("flatshard::BuildIntoShards (rank {}/{})", rank, n);
  if (s->failed) {
    throw InvalidArgument(
        fmt::format("{}: a unit of this build was refused, so the model it belonged to is "
                    "gone; end this BuildIntoShards and start another to build again",
                    who));
  }
  // Every rank reaches this point for the same unit: agree on it before anything can
  // throw on one rank alone.
  compare_across_ranks(*s, fingerprint(params), name);
  if (params.empty()) return;

  std::int64_t unit_bytes = 0, numel = 0;
  for (const auto& [pname, p] : params) {
    if (!at::isFloatingType(p.scalar_type()))
      throw InvalidArgument(
          fmt::format("{}: parameter '{}' of {} has dtype {}; only floating parameters can be sharded", who,
                      pname, name, c10::toString(p.scalar_type())));
    if (p.device() != params.front().second.device())
      throw InvalidArgument(fmt::format("{}: parameters of {} sit on {} and {}; build a unit on one device",
                                        who, name, p.device().str(), params.front().second.device().str()));
    unit_bytes += p.numel() * static_cast<std::int64_t>(p.element_size());
    numel += p.numel();
  }
  const c10::Device device = s->options.device.value_or(params.front().second.device());
  if (!device.is_cpu() && !device.is_cuda())
    throw InvalidArgument(
        fmt::format("{}: device {} is neither the CPU nor a CUDA device", who, device.str()));
  const at::ScalarType compute =
      s->options.mixed_precision.param.value_or(params.front().second.scalar_type());

  sharding::FlatParamGroup::Placement placement;
  placement.compute = device;
  placement.offload = s->options.cpu_offload;
  placement.bf16_copy = s->options.offload_bf16_copy;
  const std::int64_t elem = static_cast<std::int64_t>(c10::elementSize(compute));
  sharding::UnitFit fit;
  fit.unit = name;
  fit.unit_bytes = unit_bytes;
  fit.shard_bytes_before = s->report.shard_bytes;
  fit.budget = s->options.memory_budget.bytes;
  // Shards over the shard group (the world, or HybridShard's group).
  const ShardGroup shard = shard_group(s->world, s->options);
  fit.gathered_bytes = 2 * padded_numel(numel, shard.size, std::max<std::int64_t>(1, 16 / elem)) * elem;
  fit.device = device.str();
  fit.device_bytes = sharding::require_usable_device(device, who, name + " was not sharded");
  if (auto misfit = sharding::unit_does_not_fit(fit)) {
    throw MemoryBudgetError(misfit->need, misfit->limit,
                            fmt::format("{}: {} The model was not built; end this BuildIntoShards and start "
                                        "another to build again.",
                                        who, misfit->why));
  }

  auto group = std::make_shared<sharding::FlatParamGroup>(name, std::move(params), shard.size, shard.rank,
                                                          compute, placement);
  // Buffers (running statistics) follow to the device, as the wrapper would move them.
  for (torch::nn::Module* m : unit.unit_modules()) {
    for (auto& b : m->buffers(/*recurse=*/true)) {
      if (b.defined() && b.device() != device) b.set_data(b.to(device));
    }
  }
  s->report.units += 1;
  s->report.shard_bytes += group->shard_numel() * 4;
  if (unit_bytes > s->report.largest_unit_bytes) {
    s->report.largest_unit_bytes = unit_bytes;
    s->report.largest_unit = name;
  }
  unit.set_built_shard(std::move(group));
}

}  // namespace

void unit_constructed(UnitBase& unit) {
  BuildIntoShards::State* s = active;
  if (s == nullptr) return;
  try {
    shard_unit(s, unit);
  } catch (...) {
    s->failed = true;  // the unit's constructor throws: the model it belonged to unwinds
    throw;
  }
}

}  // namespace detail

void UnitBase::check_runnable() const {
  if (!built_) return;
  throw InvalidArgument(
      fmt::format("flatshard: {} was built into shards (BuildIntoShards) and holds only this rank's shard; "
                  "wrap the model "
                  "in flatshard::FullyShard before running it",
                  built_->name()));
}

}  // namespace flatshard
