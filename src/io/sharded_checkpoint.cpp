// Sharded checkpoints, the modes' side: what each mode holds (FullyShard's shards, DDP's
// buckets, ZeroRedundancyOptimizer's slices, torch::optim's per-parameter state) as
// segments of flat spaces, and the public save_sharded / load_sharded entry points. The
// files, their format and crash safety are shard_save.cpp and shard_load.cpp's.
#include <algorithm>
#include <functional>
#include <map>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "flatshard/checkpoint.h"
#include "flatshard/shard.h"
#include "flatshard/zero.h"
#include "sharding/ddp_engine.h"
#include "src/io/shard_files.h"

namespace flatshard::checkpoint {

namespace detail {
// ZeroRedundancyOptimizer's slices and optimizer (it befriends this).
struct Access {
  static sharding::DdpEngine& engine(ZeroRedundancyOptimizer& z) { return *z.engine_; }
  static optim::ShardOptimizer& optimizer(ZeroRedundancyOptimizer& z) {
    z.ensure_slices();
    return *z.optimizer_;
  }
};
}  // namespace detail

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

std::vector<Span> bucket_spans(sharding::DdpEngine& e, int b) {
  std::vector<Span> out;
  for (int i : e.buckets()[b].params) {
    const auto& p = e.params()[i];
    out.push_back({p.name, p.shape, p.offset, p.numel});
  }
  return out;
}

// FullyShard: shard i is this rank's slice of every segment of group i: segment k's slice
// starts at its offset + rank * slice in the group's flat space, rank being this rank's
// place in its shard group. Groups that hold the same shards (HybridShard's groups,
// NoShard's ranks) each write a share of them, and every group reads its own.
Holding hold_fully_shard(FullyShardBase& fsdp, optim::ShardOptimizer* opt, bool loading,
                         const std::vector<std::string>& load_states) {
  Holding h;
  h.mode = "fully_shard";
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
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const auto spans = unit_spans(layout[i]);
    hold(shards[i].detach(), layout[i], spans, "param");
    if (!opt) continue;
    std::vector<std::pair<std::string, at::Tensor>> states;
    if (loading) {
      for (const auto& name : load_states) states.emplace_back(name, opt->mutable_state(i, name));
    } else {
      states = opt->named_state(i);
    }
    for (const auto& [name, t] : states) {
      if (t.defined()) hold(t, layout[i], spans_of(spans, "." + name), "state");
    }
    for (const auto& s : spans) h.steps[s.key] = opt->steps(i);
  }
  if (opt) {
    h.state_names = opt->state_names();
    h.has_optimizer = loading || std::any_of(h.segments.begin(), h.segments.end(),
                                             [](const Segment& s) { return s.kind == "state"; });
  }
  add_buffers(h, fsdp.root_module());
  return h;
}

// DDP's buckets are replicated: on save each rank writes its balanced share of every
// bucket; on load each rank reads whole buckets.
void hold_buckets(Holding& h, sharding::DdpEngine& e, int rank, int n) {
  for (int i : e.rebuilt_order()) h.bucket_order.push_back(e.params()[i].name);
  for (int b = 0; b < static_cast<int>(e.buckets().size()); ++b) {
    const auto share = shard_range(e.buckets()[b].padded_numel, n, rank);
    h.segments.push_back(
        {e.step_values(b), 0, share.offset, share.offset + share.numel, bucket_spans(e, b), "param"});
  }
}

// torch::optim's per-parameter state, by the kinds FlatShard knows.
struct TorchState {
  std::vector<std::string> names;
  std::function<std::vector<std::pair<std::string, at::Tensor>>(torch::optim::OptimizerParamState*)> get;
  std::function<std::unique_ptr<torch::optim::OptimizerParamState>(const std::vector<at::Tensor>&,
                                                                   std::int64_t)>
      make;
  std::function<std::int64_t(torch::optim::OptimizerParamState*)> steps;
};

template <typename State, typename Options>
TorchState adam_like(torch::optim::Optimizer& opt) {
  if (static_cast<const Options&>(opt.param_groups().at(0).options()).amsgrad()) {
    throw InvalidArgument(
        "flatshard::checkpoint: sharded checkpoints do not support amsgrad's max_exp_avg_sq");
  }
  TorchState s;
  s.names = {"exp_avg", "exp_avg_sq"};
  s.get = [](auto* st) -> std::vector<std::pair<std::string, at::Tensor>> {
    auto* a = static_cast<State*>(st);
    return {{"exp_avg", a->exp_avg()}, {"exp_avg_sq", a->exp_avg_sq()}};
  };
  s.make = [](const std::vector<at::Tensor>& t, std::int64_t steps) {
    auto st = std::make_unique<State>();
    st->exp_avg(t[0]);
    st->exp_avg_sq(t[1]);
    st->step(steps);
    return std::unique_ptr<torch::optim::OptimizerParamState>(std::move(st));
  };
  s.steps = [](auto* st) { return static_cast<State*>(st)->step(); };
  return s;
}

TorchState torch_state_of(torch::optim::Optimizer& opt) {
  TorchState s;
  if (dynamic_cast<torch::optim::SGD*>(&opt)) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(opt.param_groups().at(0).options());
    if (o.momentum() != 0) s.names = {"momentum_buffer"};
    s.get = [](auto* st) -> std::vector<std::pair<std::string, at::Tensor>> {
      return {{"momentum_buffer", static_cast<torch::optim::SGDParamState*>(st)->momentum_buffer()}};
    };
    s.make = [](const std::vector<at::Tensor>& t, std::int64_t) {
      auto st = std::make_unique<torch::optim::SGDParamState>();
      st->momentum_buffer(t[0]);
      return std::unique_ptr<torch::optim::OptimizerParamState>(std::move(st));
    };
    s.steps = [](auto*) { return std::int64_t{0}; };
    return s;
  }
  if (dynamic_cast<torch::optim::Adam*>(&opt))
    return adam_like<torch::optim::AdamParamState, torch::optim::AdamOptions>(opt);
  if (dynamic_cast<torch::optim::AdamW*>(&opt))
    return adam_like<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(opt);
  throw InvalidArgument(
      "flatshard::checkpoint: sharded checkpoints of torch::optim optimizers support SGD, Adam and AdamW");
}

// A run resumed from a checkpoint builds its buckets as the saving run had rebuilt them
// (same summation order in the all-reduce: bit-identical resumption).
void restore_bucket_order(const Checkpoint& c, sharding::DdpEngine& e) {
  if (c.bucket_order.size() != e.params().size()) return;
  std::map<std::string, int> index;
  for (int i = 0; i < static_cast<int>(e.params().size()); ++i) index[e.params()[i].name] = i;
  std::vector<int> order;
  for (const auto& name : c.bucket_order) {
    auto it = index.find(name);
    if (it == index.end()) return;
    order.push_back(it->second);
  }
  e.restore_order(order);
}

at::Tensor optimizer_tensor(const sharding::DdpEngine& e, const sharding::DdpParam& p) {
  return e.mixed() ? p.master : p.param;
}

}  // namespace

// --- public entry points ---------------------------------------------------------------------

CheckpointInfo save_sharded(const std::string& root, FullyShardBase& fsdp,
                            const optim::ShardOptimizer* optimizer, const SaveOptions& options) {
  auto h = hold_fully_shard(fsdp, const_cast<optim::ShardOptimizer*>(optimizer), false, {});
  return save(root, fsdp.comm(), h, options);
}

CheckpointInfo load_sharded(const std::string& path, FullyShardBase& fsdp, optim::ShardOptimizer* optimizer) {
  return load(
      path, fsdp.comm(),
      [&](const Checkpoint& c) {
        fsdp.restore_bucket_order(c.bucket_order);
        const auto states =
            optimizer ? states_to_load(c, optimizer->state_names()) : std::vector<std::string>{};
        return hold_fully_shard(fsdp, optimizer && c.has_optimizer ? optimizer : nullptr, true, states);
      },
      [&](const Checkpoint& c) {
        if (!optimizer || !c.has_optimizer) return;
        const auto layout = fsdp.layout();
        for (std::size_t i = 0; i < layout.size(); ++i) {
          std::int64_t steps = 0;
          for (const auto& p : layout[i].params) steps = std::max(steps, steps_of(c, p.name));
          optimizer->set_steps(i, steps);
        }
      });
}

CheckpointInfo save_sharded(const std::string& root, DDPBase& ddp, torch::optim::Optimizer* optimizer,
                            const SaveOptions& options) {
  auto& e = ddp.engine();
  Holding h;
  h.mode = "ddp";
  const int rank = ddp.world().rank(), n = ddp.world().world_size();
  hold_buckets(h, e, rank, n);
  if (optimizer && !optimizer->state().empty()) {
    const auto kind = torch_state_of(*optimizer);
    h.has_optimizer = true;
    h.state_names = kind.names;
    for (const auto& p : e.params()) {
      auto it = optimizer->state().find(optimizer_tensor(e, p).unsafeGetTensorImpl());
      if (it == optimizer->state().end()) continue;
      h.steps[p.name] = kind.steps(it->second.get());
      const auto share = shard_range(p.numel, n, rank);
      for (const auto& [name, t] : kind.get(it->second.get())) {
        if (!t.defined()) continue;
        h.segments.push_back({t.detach().reshape({-1}),
                              0,
                              share.offset,
                              share.offset + share.numel,
                              {Span{p.name + "." + name, p.shape, 0, p.numel}},
                              "state"});
      }
    }
  }
  add_buffers(h, ddp.root_module());
  return save(root, ddp.comm(), h, options);
}

CheckpointInfo load_sharded(const std::string& path, DDPBase& ddp, torch::optim::Optimizer* optimizer) {
  auto& e = ddp.engine();
  std::vector<std::pair<const sharding::DdpParam*, std::vector<at::Tensor>>> loaded;
  return load(
      path, ddp.comm(),
      [&](const Checkpoint& c) {
        restore_bucket_order(c, e);
        Holding h;
        h.mode = "ddp";
        hold_buckets(h, e, ddp.world().rank(), ddp.world().world_size());
        if (optimizer && c.has_optimizer) {
          const auto names = states_to_load(c, torch_state_of(*optimizer).names);
          for (const auto& p : e.params()) {
            if (names.empty() || !c.tensors.count(p.name + "." + names.front())) continue;  // never stepped
            std::vector<at::Tensor> states;
            for (const auto& name : names) {
              states.push_back(at::zeros(p.shape, at::kFloat));
              h.segments.push_back({states.back().view({-1}),
                                    0,
                                    0,
                                    0,
                                    {Span{p.name + "." + name, p.shape, 0, p.numel}},
                                    "state"});
            }
            loaded.emplace_back(&p, std::move(states));
          }
        }
        add_buffers(h, ddp.root_module());
        return h;
      },
      [&](const Checkpoint& c) {
        if (!optimizer) return;
        const auto kind = torch_state_of(*optimizer);
        for (auto& [p, states] : loaded) {
          optimizer->state()[optimizer_tensor(e, *p).unsafeGetTensorImpl()] =
              kind.make(states, steps_of(c, p->name));
        }
      });
}

CheckpointInfo save_sharded(const std::string& root, ZeroRedundancyOptimizer& zero,
                            const SaveOptions& options) {
  auto& e = detail::Access::engine(zero);
  auto& opt = detail::Access::optimizer(zero);
  Holding h;
  h.mode = "zero";
  const int rank = e.rank(), n = e.world_size();
  hold_buckets(h, e, rank, n);
  h.has_optimizer = opt.state_bytes() > 0 || opt.state_names().empty();
  h.state_names = opt.state_names();
  for (int b = 0; b < static_cast<int>(e.buckets().size()); ++b) {
    const auto share = shard_range(e.buckets()[b].padded_numel, n, rank);
    const auto spans = bucket_spans(e, b);
    for (const auto& [name, t] : opt.named_state(b)) {
      if (!t.defined()) continue;
      h.segments.push_back(
          {t, share.offset, share.offset, share.offset + share.numel, spans_of(spans, "." + name), "state"});
    }
    for (const auto& s : spans) h.steps[s.key] = opt.steps(b);
  }
  add_buffers(h, e.model());
  return save(root, e.comm(), h, options);
}

CheckpointInfo load_sharded(const std::string& path, ZeroRedundancyOptimizer& zero) {
  auto& e = detail::Access::engine(zero);
  optim::ShardOptimizer* optimizer = nullptr;
  return load(
      path, e.comm(),
      [&](const Checkpoint& c) {
        restore_bucket_order(c, e);
        optimizer = &detail::Access::optimizer(zero);
        auto& opt = *optimizer;
        Holding h;
        h.mode = "zero";
        hold_buckets(h, e, e.rank(), e.world_size());
        const auto names = states_to_load(c, opt.state_names());
        for (int b = 0; b < static_cast<int>(e.buckets().size()); ++b) {
          const auto share = e.slice(b);
          const auto spans = bucket_spans(e, b);
          for (const auto& name : names) {
            h.segments.push_back(
                {opt.mutable_state(b, name), share.offset, 0, 0, spans_of(spans, "." + name), "state"});
          }
        }
        add_buffers(h, e.model());
        return h;
      },
      [&](const Checkpoint& c) {
        if (!c.has_optimizer) return;
        for (int b = 0; b < static_cast<int>(e.buckets().size()); ++b) {
          std::int64_t steps = 0;
          for (int i : e.buckets()[b].params) steps = std::max(steps, steps_of(c, e.params()[i].name));
          optimizer->set_steps(b, steps);
        }
      });
}

}  // namespace flatshard::checkpoint
