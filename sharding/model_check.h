// Refusing different models across ranks, before any collective runs on them.
#pragma once

#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "flatshard/world.h"

namespace flatshard::sharding {

// Every rank publishes a description of its model — one line per parameter (name,
// dtype, shape, whether frozen, in registration order) followed by `extra` lines (strategy, unit
// layout, ...) — through the world's store, and compares every rank's with rank 0's.
// On any difference every rank throws InvalidArgument naming the first differing entry
// and the rank. `who` names the caller in the message. No-op for a single process.
// Collective: every rank calls it, in the same order.
void check_same_model_everywhere(const World& world, torch::nn::Module& model, const std::string& who,
                                 const std::vector<std::string>& extra = {});

}  // namespace flatshard::sharding
