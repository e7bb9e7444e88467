// Which unit each parameter belongs to: shared by the engine and the memory planner.
#pragma once

#include <unordered_map>
#include <vector>

#include <torch/nn/module.h>

#include "flatshard/fully_shard.h"
#include "flatshard/plan.h"
#include "flatshard/unit.h"

namespace flatshard::sharding {

struct UnitMembership {
  std::vector<UnitBase*> declared;  // units in declaration (pre-order) order
  // parameter -> 1 + its unit's index in `declared`; 0: the root unit
  std::unordered_map<const c10::TensorImpl*, int> owner;
};

// A parameter belongs to the innermost declared unit that contains it, and to the root
// unit when none does.
UnitMembership discover_units(torch::nn::Module& model);

// The sharded strategies: a tensor registered in several places (tied weights) must sit in
// one unit, since each unit gathers only its own parameters. Throws InvalidArgument naming
// two of its names in different units (the root unit included).
void check_ties_in_one_unit(torch::nn::Module& model, const UnitMembership& m, const std::string& who);

// Throws MemoryBudgetError when the planner's figure for `mode` exceeds the budget.
// shard_group_size: HybridShard's group (0: the world).
// The budget is per rank, of the compute device's memory; `on_gpu`: the compute device is
// a GPU, whose memory the host's is apart from (CPU offload moves states out of it);
// `built_on_host`: the model is on the host, to be placed on that GPU (the device never
// holds it whole: PlanOptions::build_on_host); find_unused_parameters: the wrapper's
// (PlanOptions::find_unused_parameters).
void check_memory_budget(torch::nn::Module& model, const World& world, Strategy mode, int param_bytes,
                         const MemoryBudget& budget, const char* who, int shard_group_size = 0,
                         bool cpu_offload = false, bool on_gpu = false, bool built_on_host = false,
                         bool find_unused_parameters = false);

// Throws InvalidArgument when `device` is a CUDA device this process cannot use (no GPU
// visible, an index past the visible ones, or flatshard::cuda not linked), before
// anything is placed on it. `who` opens the message; `not_done` says what was left undone.
// Returns the device's total memory (0 for the CPU).
std::int64_t require_usable_device(const c10::Device& device, const std::string& who,
                                   const std::string& not_done);

}  // namespace flatshard::sharding
