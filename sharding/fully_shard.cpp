#include "flatshard/fully_shard.h"
#include "sharding/unit_discovery.h"

#include <fmt/format.h>

#include "flatshard/errors.h"
#include "flatshard/memory.h"
#include "sharding/engine.h"

namespace flatshard {

ShardGroup shard_group(const World& world, const FullyShardOptions& options) {
  const int n = world.world_size();
  ShardGroup g;
  g.size = n;
  g.rank = world.rank();
  if (options.strategy == Strategy::NoShard) return ShardGroup{1, 0, n, world.rank()};
  if (options.strategy != Strategy::HybridShard) return g;
  const int size = options.shard_group_size > 0 ? options.shard_group_size : world.local_world_size();
  if (options.shard_group_size < 0 || size < 1 || n % size != 0) {
    throw InvalidArgument(fmt::format(
        "flatshard::FullyShard (rank {}/{}): HybridShard needs a shard group size that divides the world "
        "size {}, got {}{}; set FullyShardOptions::shard_group_size (for example the ranks per machine)",
        world.rank(), n, n, options.shard_group_size,
        options.shard_group_size == 0 ? fmt::format(" (0: the local world size, {})", size) : ""));
  }
  g.size = size;
  g.rank = world.rank() % size;
  g.replicas = n / size;
  g.replica = world.rank() / size;
  return g;
}

namespace {

// Whether the compute device is a GPU: options.device, else where the parameters are.
bool on_gpu(torch::nn::Module& model, const FullyShardOptions& options) {
  if (options.device) return !options.device->is_cpu();
  for (const auto& p : model.parameters()) return !p.device().is_cpu();
  return false;
}

// Whether the model was built on the host to be placed on a GPU by options.device: the
// device then never holds it whole.
bool built_on_host(torch::nn::Module& model, const FullyShardOptions& options) {
  if (!options.device || options.device->is_cpu()) return false;
  for (const auto& p : model.parameters()) return p.device().is_cpu();
  return false;
}

}  // namespace

FullyShardBase::FullyShardBase(std::shared_ptr<torch::nn::Module> model, const World& world,
                               const FullyShardOptions& options)
    : world_(world) {
  sharding::refuse_a_second_wrapper(model, world);  // before the planner reads the model
  // The planner's figures are those of full shard or shard-grad-op within the group.
  Strategy mode = options.strategy;
  if (mode == Strategy::HybridShard || mode == Strategy::FullShard)
    mode = sharding::Engine::reshards_after_forward(options) ? Strategy::FullShard : Strategy::ShardGradOp;
  const auto dtype = options.mixed_precision.param;
  sharding::check_memory_budget(
      *model, world, mode, dtype && *dtype != at::kFloat ? 2 : 4, options.memory_budget, "FullyShard",
      options.strategy == Strategy::HybridShard ? flatshard::shard_group(world, options).size : 0,
      options.cpu_offload, on_gpu(*model, options), built_on_host(*model, options),
      options.find_unused_parameters);
  engine_ = std::make_unique<sharding::Engine>(std::move(model), world, options);
}

FullyShardBase::~FullyShardBase() = default;

std::vector<at::Tensor> FullyShardBase::shards() const { return engine_->shards(); }
std::vector<ShardLayout> FullyShardBase::layout() const { return engine_->layout(); }
std::int64_t FullyShardBase::layout_version() const { return engine_->layout_version(); }
void FullyShardBase::segment_stepped(std::size_t shard, std::size_t segment) {
  engine_->segment_stepped(shard, segment);
}
at::Tensor FullyShardBase::bf16_copy_for_step(std::size_t shard) {
  return engine_->bf16_copy_for_step(shard);
}
void FullyShardBase::bf16_copy_written(std::size_t shard) { engine_->bf16_copy_written(shard); }
void FullyShardBase::wait_for_shard_reads() { engine_->wait_for_shard_reads(); }
const std::vector<char>& FullyShardBase::params_with_grad(std::size_t shard) const {
  return engine_->params_with_grad(shard);
}
double FullyShardBase::clip_grad_norm(double max_norm, double norm_type) {
  return engine_->clip_grad_norm(max_norm, norm_type);
}
void FullyShardBase::zero_grad() { engine_->zero_grad(); }
bool FullyShardBase::backward_failed() const { return engine_->backward_failed(); }
void FullyShardBase::step_in_backward(optim::ShardOptimizer* optimizer) {
  engine_->set_step_in_backward(optimizer);
}
bool FullyShardBase::steps_in_backward() const { return engine_->steps_in_backward(); }
void FullyShardBase::register_comm_hook(std::shared_ptr<CommHook> hook) {
  engine_->set_comm_hook(std::move(hook));
}
const std::shared_ptr<CommHook>& FullyShardBase::comm_hook() const { return engine_->comm_hook(); }
std::int64_t FullyShardBase::synced_backwards() const { return engine_->synced_backwards(); }
void FullyShardBase::restore_synced_backwards(std::int64_t count) {
  engine_->restore_synced_backwards(count);
}
ShardMemory FullyShardBase::memory() const { return engine_->memory(); }
int FullyShardBase::peak_gathered_units() const { return engine_->peak_gathered_units(); }
void FullyShardBase::reset_peaks() { engine_->reset_peaks(); }

void FullyShardBase::time_communication_waits(bool on) { engine_->time_communication_waits(on); }
CommunicationWait FullyShardBase::communication_wait() { return engine_->communication_wait(); }
PeerWait FullyShardBase::communication_wait_for_peers() { return engine_->communication_wait_for_peers(); }
void FullyShardBase::reset_communication_wait() { engine_->reset_communication_wait(); }
std::int64_t FullyShardBase::skipped_steps() const { return engine_->skipped_steps(); }
NonFiniteGrads FullyShardBase::nonfinite_grads() const { return engine_->nonfinite_grads(); }
int FullyShardBase::num_units() const { return engine_->num_units(); }
std::int64_t FullyShardBase::largest_unit_bytes() const { return engine_->unit_bytes(false); }
std::int64_t FullyShardBase::root_unit_bytes() const { return engine_->unit_bytes(true); }
Communicator& FullyShardBase::comm() { return engine_->comm(); }
std::uint64_t FullyShardBase::bytes_sent() const { return engine_->bytes_sent(); }
ShardGroup FullyShardBase::shard_group() const { return engine_->shard_group(); }
Strategy FullyShardBase::strategy() const { return engine_->strategy(); }
at::ScalarType FullyShardBase::param_dtype() const { return engine_->param_dtype(); }
torch::nn::Module& FullyShardBase::root_module() { return engine_->model(); }
std::vector<std::vector<std::string>> FullyShardBase::bucket_layout() const {
  return engine_->bucket_layout();
}
std::vector<std::string> FullyShardBase::bucket_order() const { return engine_->bucket_order(); }
void FullyShardBase::restore_bucket_order(const std::vector<std::string>& names) {
  engine_->restore_bucket_order(names);
}

void FullyShardBase::root_pre_forward() { engine_->pre_forward(sharding::Engine::kRoot); }

std::vector<at::Tensor> FullyShardBase::root_post_forward(std::vector<at::Tensor> outputs) {
  outputs = engine_->post_forward(sharding::Engine::kRoot, std::move(outputs));
  if (const auto dtype = engine_->output_dtype()) {
    for (auto& t : outputs) t = detail::cast_floating(t, *dtype);
  }
  return outputs;
}

std::optional<at::ScalarType> FullyShardBase::input_dtype() const { return engine_->input_dtype(); }

FullyShardBase::NoSync::NoSync(FullyShardBase& owner) : owner_(owner) { owner_.engine_->set_no_sync(true); }
FullyShardBase::NoSync::~NoSync() { owner_.engine_->set_no_sync(false); }

FullyShardBase::FullParams::FullParams(FullyShardBase& owner) : owner_(owner) {
  owner_.engine_->gather_all();
}
FullyShardBase::FullParams::~FullParams() { owner_.engine_->reshard_all(); }

std::string FullyShardBase::memory_report(std::int64_t optimizer_state_bytes) const {
  const ShardMemory m = memory();
  auto mib = [](std::int64_t b) { return static_cast<double>(b) / (1 << 20); };
  std::string line = fmt::format(
      "rank {}/{} memory (MiB): param shards {:.2f} | grad shards {:.2f} | unsharded params {:.2f} (peak "
      "{:.2f}) | "
      "unsharded grads {:.2f} (peak {:.2f}) | peak gathered units {}",
      world_.rank(), world_.world_size(), mib(m.param_shard_bytes), mib(m.grad_shard_bytes),
      mib(m.unsharded_param_bytes), mib(m.peak_unsharded_param_bytes), mib(m.unsharded_grad_bytes),
      mib(m.peak_unsharded_grad_bytes), peak_gathered_units());
  if (m.bf16_copy_bytes > 0)
    line += fmt::format(" | bf16 copies of param shards {:.2f}", mib(m.bf16_copy_bytes));
  if (optimizer_state_bytes >= 0)
    line += fmt::format(" | optimizer states {:.2f}", mib(optimizer_state_bytes));
  const auto a = memory::allocator_stats();
  if (a.installed)
    line += fmt::format(" | allocator {:.2f} (peak {:.2f})", mib(a.current_bytes), mib(a.peak_bytes));
  return line;
}

}  // namespace flatshard
