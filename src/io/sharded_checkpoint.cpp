// Sharded checkpoints, the wrapper's side: what a rank holds, from the layout every
// strategy exports (FullyShardBase::layout() and shard_group(): each flat group's segments
// and this rank's slice of them), as segments of flat spaces, and the public save_sharded /
// load_sharded entry points. No strategy is named here. The files, their format and crash
// safety are shard_save.cpp and shard_load.cpp's.
#include <algorithm>
#include <functional>
#include <map>
#include <new>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "flatshard/checkpoint.h"
#include "flatshard/data.h"
#include "flatshard/shard.h"
#include "src/io/files.h"
#include "src/io/shard_files.h"

namespace flatshard::checkpoint {

namespace {

using namespace shards;

std::vector<Span> spans_of(const std::vector<Span>& params, const std::string& suffix) {
  auto out = params;
  for (auto& s : out) s.key += suffix;
  return out;
}

void add_buffers(Holding& h, torch::nn::Module& model) {
  for (const auto& item : model.named_buffers(/*recurse=*/true))
    h.buffers.emplace_back(item.key(), item.value());
}

// --- the modes ---------------------------------------------------------------------------

std::vector<Span> unit_spans(const ShardLayout& layout) {
  std::vector<Span> out;
  for (const auto& p : layout.params) out.push_back({p.name, p.shape, p.offset, p.numel});
  return out;
}

// The optimizer's groups (name, hyperparameters), the scheduler's and the scaler's state.
std::string training_state(const optim::ShardOptimizer* opt, const SaveOptions& options,
                           std::int64_t synced_backwards) {
  using json = nlohmann::json;
  json out = json::object();
  // The engine's count of synced backwards: communication hooks draw and start by it.
  out["synced_backwards"] = synced_backwards;
  if (opt) {
    json groups = json::array();
    for (std::size_t g = 0; g < opt->num_groups(); ++g) {
      json group = {{"name", opt->group_name(g)}, {"hyperparameters", opt->hyperparameters(g)}};
      if (const auto initial = opt->saved_initial_lr(g))
        group["initial_lr"] = *initial;  // Note [A schedule's base rate]
      groups.push_back(std::move(group));
    }
    out["param_groups"] = std::move(groups);
    if (!opt->kind().empty()) out["optimizer"] = opt->kind();
  }
  if (options.scheduler)
    out["scheduler"] = {{"steps", options.scheduler->steps()}, {"base_lrs", options.scheduler->base_lrs()}};
  if (options.scaler)
    out["scaler"] = {{"scale", options.scaler->scale()},
                     {"growth_tracker", options.scaler->growth_tracker()}};
  if (options.sampler) {
    const auto s = options.sampler->state();
    out["sampler"] = {{"epoch", s.epoch},
                      {"consumed", s.consumed},
                      {"dataset_size", s.dataset_size},
                      {"seed", std::to_string(s.seed)},
                      {"shuffle", s.shuffle}};
  }
  return out.empty() ? std::string() : out.dump();
}

// Whether the checkpoint's optimizer state fits `opt`: the same kind (Adam's and AdamW's
// state share their names) and the same groups. Checked before any value is read, so that a
// refusal leaves the model and the optimizer as they were.
void check_optimizer_fits(const Checkpoint& c, const optim::ShardOptimizer& opt) {
  using json = nlohmann::json;
  if (!c.has_optimizer || c.training.empty()) return;
  const json state = json::parse(c.training);
  if (!opt.kind().empty() && state.contains("optimizer") &&
      state.at("optimizer").get<std::string>() != opt.kind()) {
    throw CheckpointError(
        c.dir, fmt::format("the checkpoint at '{}' holds the state of {}; this optimizer is {}, which "
                           "applies weight decay otherwise: make the optimizer it was saved with, or "
                           "load without the optimizer to start one afresh",
                           c.dir, state.at("optimizer").get<std::string>(), opt.kind()));
  }
  if (!state.contains("param_groups")) return;
  std::vector<std::string> saved;
  for (const auto& g : state.at("param_groups")) saved.push_back(g.at("name").get<std::string>());
  std::vector<std::string> ours;
  for (std::size_t g = 0; g < opt.num_groups(); ++g) ours.push_back(opt.group_name(g));
  if (saved != ours) {
    throw CheckpointError(c.dir,
                          fmt::format("the checkpoint at '{}' was saved with parameter groups [{}]; "
                                      "this optimizer has [{}]: make the optimizer with the same groups",
                                      c.dir, fmt::join(saved, ", "), fmt::join(ours, ", ")));
  }
}

void restore_training_state(const Checkpoint& c, optim::ShardOptimizer* opt, const LoadOptions& options) {
  using json = nlohmann::json;
  const json state = c.training.empty() ? json::object() : json::parse(c.training);
  auto missing = [&](const char* what, const char* option) {
    throw CheckpointError(c.dir, fmt::format("the checkpoint at '{}' holds no {} state; load without {} (it "
                                             "starts fresh), or from a checkpoint saved with SaveOptions::{}",
                                             c.dir, what, option, option));
  };
  if (opt && c.has_optimizer && state.contains("param_groups")) {
    const auto& groups = state.at("param_groups");
    // Saved before initial rates were: the scheduler's base rates stand for them.
    const bool scheduled = state.contains("scheduler") && state.at("scheduler").contains("base_lrs");
    for (std::size_t g = 0; g < opt->num_groups(); ++g) {
      opt->set_hyperparameters(g, groups[g].at("hyperparameters").get<std::map<std::string, double>>());
      if (groups[g].contains("initial_lr")) {  // Note [A schedule's base rate]
        opt->set_initial_lr(g, groups[g].at("initial_lr").get<double>());
      } else if (scheduled && g < state.at("scheduler").at("base_lrs").size()) {
        opt->set_initial_lr(g, state.at("scheduler").at("base_lrs")[g].get<double>());
      }
    }
  }
  if (options.scheduler) {
    if (!state.contains("scheduler")) missing("learning-rate scheduler", "scheduler");
    options.scheduler->restore(state.at("scheduler").at("steps").get<std::int64_t>(),
                               state.at("scheduler").at("base_lrs").get<std::vector<double>>());
  }
  if (options.scaler) {
    if (!state.contains("scaler")) missing("gradient scaler", "scaler");
    options.scaler->restore(state.at("scaler").at("scale").get<double>(),
                            state.at("scaler").at("growth_tracker").get<std::int64_t>());
  }
}

// The sampler's position saved in `c`, checked against `sampler` (the same dataset size and
// seed, a position inside it) before anything is loaded: a refused checkpoint changes
// nothing.
data::DistributedSampler::State saved_sampler_state(const Checkpoint& c,
                                                    const data::DistributedSampler& sampler) {
  using json = nlohmann::json;
  try {
    const json state = c.training.empty() ? json::object() : json::parse(c.training);
    if (!state.contains("sampler")) {
      throw CheckpointError(c.dir,
                            fmt::format("the checkpoint at '{}' holds no data sampler state; load without "
                                        "LoadOptions::sampler (the data starts over), or from a checkpoint "
                                        "saved with SaveOptions::sampler",
                                        c.dir));
    }
    const auto& j = state.at("sampler");
    data::DistributedSampler::State s;
    s.epoch = j.at("epoch").get<std::int64_t>();
    s.consumed = j.at("consumed").get<std::int64_t>();
    s.dataset_size = j.at("dataset_size").get<std::int64_t>();
    s.seed = std::stoull(j.at("seed").get<std::string>());
    s.shuffle = j.at("shuffle").get<bool>();
    data::DistributedSampler probe = sampler;
    probe.restore(s);
    return s;
  } catch (const InvalidArgument& e) {
    throw CheckpointError(c.dir, fmt::format("the checkpoint at '{}': {}", c.dir, e.what()));
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError(c.dir,
                          fmt::format("the checkpoint at '{}' has a damaged sampler position ({}): load an "
                                      "earlier checkpoint",
                                      c.dir, e.what()));
  }
}

// The communication hook's state (error-feedback residuals, PowerSGD's Q): each rank's
// own, whole, under comm_hook.rank<r>.<name>, each tensor a flat space of its own.
void hold_hook_state(Holding& h, int rank, const std::map<std::string, at::Tensor>& state) {
  for (const auto& [name, t] : state) {
    at::Tensor flat = t.detach().reshape({-1});
    Span span{fmt::format("comm_hook.rank{}.{}", rank, name), t.sizes().vec(), 0, flat.numel()};
    h.segments.push_back({flat, 0, 0, flat.numel(), {span}, "hook"});
  }
}

// What a checkpoint holds of this rank's hook state, as empty tensors to read into. Only at
// the world size that saved it: the residuals are per rank.
std::map<std::string, at::Tensor> hook_state_to_load(const Checkpoint& c, int rank, int world_size) {
  std::map<std::string, at::Tensor> out;
  if (c.world_size != world_size) return out;
  const std::string prefix = fmt::format("comm_hook.rank{}.", rank);
  for (const auto& [key, e] : c.tensors) {
    if (e.kind == "hook" && key.rfind(prefix, 0) == 0)
      out[key.substr(prefix.size())] = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  }
  return out;
}

}  // namespace

namespace shards {

// FullyShard: shard i is this rank's slice of every segment of group i: segment k's slice
// starts at its offset + rank * slice in the group's flat space, rank being this rank's
// place in its shard group. Groups that hold the same shards (HybridShard's groups,
// NoShard's ranks) each write a share of them, and every group reads its own.
Holding hold_fully_shard(FullyShardBase& fsdp, optim::ShardOptimizer* opt, bool loading,
                         const std::vector<std::string>& load_states) {
  if (loading) fsdp.wait_for_shard_reads();  // the load writes the masters in place
  Holding h;
  h.mode = to_string(fsdp.strategy());
  const auto layout = fsdp.layout();
  const auto shards = fsdp.shards();
  const ShardGroup group = fsdp.shard_group();
  h.bucket_order = fsdp.bucket_order();
  auto hold = [&](const at::Tensor& shard, const ShardLayout& l, const std::vector<Span>& spans,
                  const std::string& kind) {
    for (const auto& seg : l.segments) {
      const std::int64_t begin = seg.offset + group.rank * seg.slice;
      const auto share = shard_range(seg.slice, group.replicas, group.replica);
      h.segments.push_back({shard.narrow(0, seg.shard_offset, seg.slice), begin, begin + share.offset,
                            begin + share.offset + share.numel, spans, kind});
    }
  };
  // A shard whose parameters are all frozen has no optimizer state (Note [Frozen units]),
  // and loading makes none for it.
  const auto named = fsdp.root_module().named_parameters(/*recurse=*/true);
  auto trains = [&](const ShardLayout& l) {
    return std::any_of(l.params.begin(), l.params.end(), [&](const ShardLayout::Param& p) {
      const at::Tensor* t = named.find(p.name);
      return t == nullptr || t->requires_grad();
    });
  };
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const auto spans = unit_spans(layout[i]);
    hold(shards[i].detach(), layout[i], spans, "param");
    if (!opt) continue;
    std::vector<std::pair<std::string, at::Tensor>> states;
    if (loading) {
      if (trains(layout[i])) {
        for (const auto& name : load_states) states.emplace_back(name, opt->mutable_state(i, name));
      }
    } else {
      states = opt->named_state(i);
    }
    for (const auto& [name, t] : states) {
      if (t.defined()) hold(t, layout[i], spans_of(spans, "." + name), "state");
    }
    for (const auto& s : spans) h.steps[s.key] = opt->steps(i, s.key);
  }
  if (opt) {
    h.state_names = opt->state_names();
    h.has_optimizer = loading || std::any_of(h.segments.begin(), h.segments.end(),
                                             [](const Segment& s) { return s.kind == "state"; });
  }
  add_buffers(h, fsdp.root_module());
  return h;
}

}  // namespace shards

// --- public entry points ---------------------------------------------------------------------

namespace shards {

Holding hold_for_save(FullyShardBase& fsdp, const optim::ShardOptimizer* optimizer,
                      const SaveOptions& options) {
  if (io::fault_injected("hold")) throw std::bad_alloc();  // Note [Injected checkpoint faults]
  auto h = hold_fully_shard(fsdp, const_cast<optim::ShardOptimizer*>(optimizer), false, {});
  if (fsdp.comm_hook()) hold_hook_state(h, fsdp.comm().rank(), fsdp.comm_hook()->state());
  h.training = training_state(optimizer, options, fsdp.synced_backwards());
  return h;
}

}  // namespace shards

CheckpointInfo save_sharded(const std::string& root, FullyShardBase& fsdp,
                            const optim::ShardOptimizer* optimizer, const SaveOptions& options) {
  Holding h;
  try {
    h = hold_for_save(fsdp, optimizer, options);
  } catch (const std::exception& e) {  // out of memory, say: the other ranks wait in the first agreement
    shards::agree(fsdp.comm(), root, shards::kStartingTheSave,
                  "reading this rank's shards to save: " + shards::reason_of(e));
  }
  return save(root, fsdp.comm(), h, options);
}

CheckpointInfo load_sharded(const std::string& path, FullyShardBase& fsdp, optim::ShardOptimizer* optimizer,
                            const LoadOptions& options) {
  std::map<std::string, at::Tensor> hook_state;  // read into, then given to the registered hook
  data::DistributedSampler::State sampler_state;
  const auto info = load(
      path, fsdp.comm(),
      [&](const Checkpoint& c) {
        if (options.sampler) sampler_state = saved_sampler_state(c, *options.sampler);
        if (optimizer) check_optimizer_fits(c, *optimizer);
        fsdp.restore_bucket_order(c.bucket_order);
        const auto states =
            optimizer ? states_to_load(c, optimizer->state_names()) : std::vector<std::string>{};
        auto h = hold_fully_shard(fsdp, optimizer && c.has_optimizer ? optimizer : nullptr, true, states);
        if (fsdp.comm_hook()) {
          hook_state = hook_state_to_load(c, fsdp.comm().rank(), fsdp.comm().world_size());
          hold_hook_state(h, fsdp.comm().rank(), hook_state);
        }
        return h;
      },
      [&](const Checkpoint& c) {
        if (!hook_state.empty()) fsdp.comm_hook()->load_state(hook_state);
        if (!c.training.empty()) {
          const auto training = nlohmann::json::parse(c.training);
          if (training.contains("synced_backwards"))
            fsdp.restore_synced_backwards(training.at("synced_backwards").get<std::int64_t>());
        }
        restore_training_state(c, optimizer, options);
        if (options.sampler) options.sampler->restore(sampler_state);
        if (!optimizer || !c.has_optimizer) return;
        const auto layout = fsdp.layout();
        for (std::size_t i = 0; i < layout.size(); ++i) {
          for (const auto& p : layout[i].params) optimizer->set_steps(i, p.name, steps_of(c, p.name));
        }
      });
  shards::masters_written(fsdp);
  return info;
}

}  // namespace flatshard::checkpoint
