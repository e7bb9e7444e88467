#include <ATen/ATen.h>
#include <fmt/format.h>
#include "sharding/unit_discovery.h"

#include <cmath>

#include "flatshard/ddp.h"
#include "flatshard/errors.h"
#include "flatshard/memory.h"
#include "optim/clip.h"
#include "sharding/ddp_engine.h"
#include "sharding/flat_param.h"

namespace flatshard {

DDPBase::DDPBase(std::shared_ptr<torch::nn::Module> model, const World& world, const DDPOptions& options)
    : world_(world) {
  for (UnitBase* unit : sharding::discover_units(*model).declared) {
    if (!unit->built_shard()) continue;
    throw InvalidArgument(fmt::format(
        "flatshard::DistributedDataParallel (rank {}/{}): the model was built into shards (BuildIntoShards; "
        "{} holds only this rank's shard), and DDP{} keeps a whole replica on every rank. Wrap it in "
        "flatshard::FullyShard, or build it without BuildIntoShards",
        world.rank(), world.world_size(), unit->built_shard()->name(),
        options.sharded_optimizer ? " with ZeroRedundancyOptimizer" : ""));
  }
  const auto mode = options.sharded_optimizer ? plan::Mode::Zero1 : plan::Mode::DDP;
  const auto dtype = options.mixed_precision.param;
  sharding::check_memory_budget(*model, world, mode, dtype && *dtype != at::kFloat ? 2 : 4,
                                options.memory_budget, "DistributedDataParallel");
  engine_ = std::make_unique<sharding::DdpEngine>(std::move(model), world, options);
}

DDPBase::~DDPBase() = default;

std::vector<at::Tensor> DDPBase::optimizer_params() const { return engine_->optimizer_params(); }
void DDPBase::pre_forward() { engine_->pre_forward(); }
int DDPBase::num_buckets() const { return static_cast<int>(engine_->buckets().size()); }
Communicator& DDPBase::comm() { return engine_->comm(); }
std::int64_t DDPBase::skipped_steps() const { return engine_->skipped_steps(); }
torch::nn::Module& DDPBase::root_module() { return engine_->model(); }

DDPBase::NoSync::NoSync(DDPBase& owner) : owner_(owner) { owner_.engine_->set_no_sync(true); }
DDPBase::NoSync::~NoSync() { owner_.engine_->set_no_sync(false); }

std::vector<std::vector<std::string>> DDPBase::bucket_layout() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& b : engine_->buckets()) {
    out.emplace_back();
    for (int i : b.params) out.back().push_back(engine_->params()[i].name);
  }
  return out;
}

double DDPBase::clip_grad_norm(double max_norm) {
  std::vector<at::Tensor> grads;
  for (const auto& p : optimizer_params()) grads.push_back(p.grad());
  return optim::clip_by_global_norm(grads, max_norm, nullptr);  // all-reduced: the same on every rank
}

std::string DDPBase::memory_report() const {
  std::int64_t params = 0, grads = 0, masters = 0;
  for (const auto& b : engine_->buckets()) {
    params += b.flat.nbytes();
    grads += b.grad.nbytes();
    if (b.master.defined()) masters += b.master.nbytes() + b.master_grad.nbytes();
  }
  auto mib = [](std::int64_t b) { return static_cast<double>(b) / (1 << 20); };
  std::string line = fmt::format(
      "rank {}/{} memory (MiB): params {:.2f} | grads {:.2f} | fp32 masters+grads {:.2f} | "
      "{} buckets",
      world_.rank(), world_.world_size(), mib(params), mib(grads), mib(masters), engine_->buckets().size());
  const auto a = memory::allocator_stats();
  if (a.installed)
    line += fmt::format(" | allocator {:.2f} (peak {:.2f})", mib(a.current_bytes), mib(a.peak_bytes));
  return line;
}

}  // namespace flatshard
