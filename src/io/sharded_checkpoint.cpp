// Sharded checkpoints, the wrapper's side: what a rank holds, from the layout every
// strategy exports (FullyShardBase::layout() and shard_group(): each flat group's segments
// and this rank's slice of them), as segments of flat spaces, and the public save_sharded /
// load_sharded entry points. No strategy is named here. The files, their format and crash
// safety are shard_save.cpp and shard_load.cpp's.
#include <algorithm>
#include <functional>
#include <map>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "flatshard/checkpoint.h"
#include "flatshard/shard.h"
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

// FullyShard: shard i is this rank's slice of every segment of group i: segment k's slice
// starts at its offset + rank * slice in the group's flat space, rank being this rank's
// place in its shard group. Groups that hold the same shards (HybridShard's groups,
// NoShard's ranks) each write a share of them, and every group reads its own.
Holding hold_fully_shard(FullyShardBase& fsdp, optim::ShardOptimizer* opt, bool loading,
                         const std::vector<std::string>& load_states) {
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

}  // namespace flatshard::checkpoint
