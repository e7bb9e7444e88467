// Building a model straight into shards.
//
//   auto world = flatshard::init();
//   flatshard::FullyShardOptions options{.strategy = flatshard::Strategy::FullShard};
//   torch::manual_seed(0);                              // the same seed on every rank
//   GPT model{nullptr};
//   {
//     flatshard::BuildIntoShards build(world, options);
//     model = GPT(cfg);                                 // the model's code, unchanged
//   }
//   flatshard::FullyShard fsdp(model, world, options);  // adopts the units' shards
//
// While a BuildIntoShards lives, every unit constructed on its thread (a Unit<M>, or a
// group of a SequentialUnits) is sharded the moment its constructor returns: it is built
// at full size (its own initialisation runs as usual), this rank's slice of its flat
// buffer becomes the unit's fp32 master shard, and its parameters give up their values.
// So a rank holds its shards so far plus the one unit being built — never the whole
// model — and ends with exactly the slice it would hold had the model been built whole
// with the same seed. No weights travel between ranks: each unit's fingerprint (names,
// shapes, a hash of its values) is compared across ranks as it is built, and a unit that
// differs (another seed, another config) is refused with InvalidArgument naming it and
// the ranks on each side.
//
// Parameters outside every unit (the root unit) are built whole and sharded when the
// wrapper is made; declare large embeddings and heads as units of their own
// (Unit<torch::nn::Embedding>) to keep them out of the root. Initialise parameters in
// their unit's constructor: a unit's parameters are empty once it is built, and a parent
// that writes to them afterwards is refused when the wrapper adopts the unit. Only
// FullyShard can adopt such a model (DDP and ZeRO-1 replicate it: they refuse it).
// See docs/larger-than-device.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "flatshard/fully_shard.h"
#include "flatshard/world.h"

namespace flatshard {

// What a build has done so far on this rank.
struct BuildReport {
  int units = 0;                        // units sharded as they were built
  std::int64_t shard_bytes = 0;         // their fp32 master shards
  std::int64_t largest_unit_bytes = 0;  // the largest unit's parameters at full size
  std::string largest_unit;             // which one
};

class BuildIntoShards {
 public:
  // `options` must be those the model will be wrapped with (the world, the compute dtype,
  // the device and CPU offload decide each shard's size and place; the memory budget is
  // checked unit by unit). A collective: every rank builds the same units in the same
  // order. One build at a time per thread.
  BuildIntoShards(const World& world, const FullyShardOptions& options = {});
  ~BuildIntoShards();
  BuildIntoShards(const BuildIntoShards&) = delete;
  BuildIntoShards& operator=(const BuildIntoShards&) = delete;

  BuildReport report() const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace flatshard
