// Uneven inputs (include/flatshard/join.h): ranks with 3, 5 and 7 batches train to the
// end of the longest in every strategy, without hanging, and end with the weights of a
// single process that, at each step, averages over the world size the gradients of the
// ranks that still had data.
#include <gtest/gtest.h>

#include "tests/support/cases.h"
#include "tests/support/multirank.h"

namespace {

using namespace flatshard::testing;
using flatshard::Strategy;

constexpr int kRows = 2;
constexpr double kLr = 0.1;

int batches_of(int rank) { return 3 + 2 * rank; }  // 3, 5, 7, ...

Batch batch_of(int rank, int step, int world) {
  const auto b = gpt_batch(step, kRows * world);
  return {b.input.narrow(0, kRows * rank, kRows), b.target.narrow(0, kRows * rank, kRows)};
}

TEST(Join, UnevenInputsTrainToTheLongestInEveryStrategy) {
  FLATSHARD_RUN_RANKS({2, 3}, std::chrono::seconds(180));
  auto world = flatshard::init();
  const int n = world.world_size();
  // The reference: one process, SGD, each step's loss the sum over the ranks with data
  // divided by the world size.
  GPT reference = gpt_factory()();
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(kLr));
  const int longest = batches_of(n - 1);
  for (int step = 0; step < longest; ++step) {
    at::Tensor loss;
    for (int r = 0; r < n; ++r) {
      if (step >= batches_of(r)) continue;
      const auto b = batch_of(r, step, n);
      auto l = token_loss(reference->forward(b.input), b.target) / n;
      loss = loss.defined() ? loss + l : l;
    }
    ref_opt.zero_grad();
    loss.backward();
    ref_opt.step();
  }
  for (Strategy strategy :
       {Strategy::NoShard, Strategy::ShardOptimizerState, Strategy::ShardGradOp, Strategy::FullShard}) {
    SCOPED_TRACE(to_string(strategy));
    GPT model = gpt_factory()();
    flatshard::FullyShardOptions options;
    options.strategy = strategy;
    options.comm.timeout = std::chrono::seconds(60);
    flatshard::FullyShard<GPT> fsdp(model, world, options);
    flatshard::optim::SGD opt(fsdp, flatshard::optim::SGDOptions{kLr});
    flatshard::Join join(fsdp.comm());
    int mine = 0;
    while (join.step(mine < batches_of(world.rank()))) {
      const auto b = batch_of(world.rank(), join.joined() ? batches_of(world.rank()) - 1 : mine, n);
      auto loss = token_loss(fsdp.forward(b.input), b.target) * join.scale();
      loss.backward();
      opt.step();
      opt.zero_grad();
      if (!join.joined()) ++mine;
      EXPECT_EQ(join.active_ranks(), [&] {
        int active = 0;
        for (int r = 0; r < n; ++r) active += join.steps() - 1 < batches_of(r) ? 1 : 0;
        return active;
      }());
    }
    EXPECT_EQ(join.steps(), longest) << "every rank stepped as often as the longest";
    EXPECT_EQ(join.joined_at(), batches_of(world.rank())) << "the first step this rank had no batch for";
    auto full = fsdp.summon_full_params();
    auto ours = model->named_parameters();
    for (const auto& p : reference->named_parameters()) {
      const auto& got = ours[p.key()];
      const double diff = (got - p.value()).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5 * std::max(1.0, p.value().abs().max().item<double>())) << p.key();
    }
  }
}

TEST(Join, ARankThatJoinedMayNotHaveDataAgain) {
  FLATSHARD_RUN_RANKS({2});
  auto world = flatshard::init();
  flatshard::CommunicatorOptions o;
  o.timeout = std::chrono::seconds(30);
  o.name = "join";
  auto comm = flatshard::Communicator::create(world, o);
  flatshard::Join join(*comm);
  EXPECT_TRUE(join.step(world.rank() == 0));  // rank 1 joins at step 0
  EXPECT_EQ(join.active_ranks(), 1);
  if (world.rank() == 1) {
    try {
      join.step(true);
      ADD_FAILURE() << "a rank that had joined was let back in";
    } catch (const flatshard::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1/2"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("step 0"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(join.step(false));  // it rejoins the loop's collectives
  } else {
    EXPECT_FALSE(join.step(false));
  }
}

}  // namespace
