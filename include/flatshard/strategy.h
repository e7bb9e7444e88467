// The one choice of mode: how the engine shards a model (see docs/modes.md). Used by the
// wrapper (FullyShardOptions::strategy), the planner (plan::PlanOptions::strategy), the
// checkpoints' metadata and the tools' --mode flags. No LibTorch here: flatshard-plan
// links it without the engine.
#pragma once

#include <string>

namespace flatshard {

enum class Strategy {
  FullShard,    // parameters resharded after forward and gathered again for backward
  ShardGradOp,  // parameters gathered once per step, kept until backward ends (ZeRO-2)
  // Full shard within groups of shard_group_size ranks (one machine, say), replicated
  // across the groups: parameters gathered within the group, gradients reduce-scattered
  // within it and then all-reduced across the groups (FSDP's HYBRID_SHARD, FSDP2's 2-D
  // mesh). With reshard_after_forward = false it is ShardGradOp within the group.
  HybridShard,
  // Parameters replicated and kept gathered on every rank; gradients averaged by all-reduce
  // of buckets as they fill during backward; every rank steps the whole model (DDP,
  // FSDP's NO_SHARD). Without mixed precision the master shard is the parameters' own
  // flat buffer: nothing is copied.
  NoShard,
  // Parameters replicated and kept gathered; gradients reduce-scattered by buckets as they
  // fill, each rank stepping its slice of every bucket (optimizer state and reduced
  // gradients / N); the updated slices are all-gathered before the next forward
  // (ZeroRedundancyOptimizer, DeepSpeed ZeRO stages 1 and 2).
  ShardOptimizerState,
};

// The enum's name ("FullShard", "NoShard", ...).
const char* to_string(Strategy s);
// The short name the tools take and print: "full", "zero2", "hybrid", "ddp", "zero1".
const char* mode_name(Strategy s);
// Either name (case as written above); false when `name` is neither.
bool parse_strategy(const std::string& name, Strategy& out);

}  // namespace flatshard
