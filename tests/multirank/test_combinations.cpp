// Random mixes of the options every strategy takes — accumulation with and without
// no_sync, clipping, bf16 compute and reduction, prefetch depth, CPU offload,
// recomputation, building into shards, stepping in backward, staleness, unused-parameter
// search, parameter groups, frozen parameters, communication hooks, and a sharded
// checkpoint halfway loaded by a wrapper with other options — each trained against
// single-process training on the same global batch. The other tests pin each option down
// alone or in pairs; this one looks for the interactions between them that nobody wrote a
// test for.
//
// The mixes are drawn from a seeded generator, the same on every rank; a failure names
// its seed and mix, and FLATSHARD_COMBINATION_SEED=<seed> FLATSHARD_COMBINATIONS=1 runs it
// again alone. FLATSHARD_COMBINATIONS=<n> draws n mixes per world size (default 8,
// to keep the suite's time).
#include <gtest/gtest.h>

#include "tests/support/mixes.h"
#include "tests/support/multirank.h"

namespace {

using namespace flatshard::testing::mixes;

TEST(Combinations, RandomOptionMixesMatchSingleProcess) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(600));
  train_mixes(flatshard::init(), env_or("FLATSHARD_COMBINATION_SEED", 20261125),
              env_or("FLATSHARD_COMBINATIONS", 8), c10::Device(c10::kCPU), flatshard::Transport::Auto,
              flatshard::testing::kBf16Tolerance);
}

}  // namespace
