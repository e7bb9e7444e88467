// Refusing different models across ranks, before any collective runs on them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "flatshard/communicator.h"
#include "flatshard/fully_shard.h"
#include "flatshard/world.h"

namespace flatshard::sharding {

// Every rank publishes a description of its model — one line per parameter (name,
// dtype, shape, whether frozen, in registration order), one per buffer (name, dtype,
// shape), then `extra` lines (strategy, unit layout, ...) — through the world's store, and
// compares every rank's with rank 0's.
// On any difference every rank throws InvalidArgument naming the first differing entry
// and the rank. `who` names the caller in the message. No-op for a single process.
// Collective: every rank calls it, in the same order.
void check_same_model_everywhere(const World& world, torch::nn::Module& model, const std::string& who,
                                 const std::vector<std::string>& extra = {});

// A 64-bit hash of `bytes` bytes, continuing from `seed` (not cryptographic: it tells
// apart values that differ).
std::uint64_t hash_bytes(std::uint64_t seed, const void* data, std::size_t bytes);

// Tensors compared or copied together, under the name an error gives them ("unit 'h1'").
struct NamedValues {
  std::string name;
  std::vector<at::Tensor> tensors;
};

// Note [Same values on every rank]: under SyncModuleStates::Check, throws InvalidArgument on
// every rank when an entry's values differ across the ranks of `comm`, naming the entry
// and which ranks hold which version; under FromRank0, copies rank 0's values into every
// rank's tensors (in place); under Trust, does nothing. Collective. `who` names the caller.
void reconcile_values(Communicator& comm, const std::vector<NamedValues>& entries, SyncModuleStates mode,
                      const std::string& who);

}  // namespace flatshard::sharding
