// Uneven inputs (include/flatshard/join.h): ranks with 3, 5 and 7 batches train to the
// end of the longest in every strategy, without hanging, and end with the weights of a
// single process that, at each step, averages over the world size the gradients of the
// ranks that still had data; and the same under staleness (applied a step late) and
// decentralized training (a joined rank keeps averaging with its neighbours).
#include <gtest/gtest.h>

#include <deque>
#include <functional>

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

// One process, SGD: each step's loss is the sum over the ranks with data divided by the
// world size; with `staleness` each step applies the gradient of `staleness` steps before
// (none in the first `staleness` steps).
GPT reference_uneven(int n, int staleness) {
  GPT reference = gpt_factory()();
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(kLr));
  std::deque<std::vector<at::Tensor>> delayed;
  for (int step = 0; step < batches_of(n - 1); ++step) {
    at::Tensor loss;
    for (int r = 0; r < n; ++r) {
      if (step >= batches_of(r)) continue;
      const auto b = batch_of(r, step, n);
      auto l = token_loss(reference->forward(b.input), b.target) / n;
      loss = loss.defined() ? loss + l : l;
    }
    ref_opt.zero_grad();
    loss.backward();
    std::vector<at::Tensor> grads;
    for (auto& p : reference->parameters()) grads.push_back(p.grad().clone());
    delayed.push_back(std::move(grads));
    if (static_cast<int>(delayed.size()) <= staleness) continue;
    auto params = reference->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = delayed.front()[i];
    delayed.pop_front();
    ref_opt.step();
  }
  return reference;
}

// This rank's batches, then zero-loss steps until the longest rank is done. `each_step`
// runs after every step.
void train_uneven(const flatshard::World& world, flatshard::FullyShard<GPT>& fsdp,
                  const std::function<void(const flatshard::Join&)>& each_step = nullptr) {
  const int n = world.world_size();
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
    if (each_step) each_step(join);
  }
  EXPECT_EQ(join.steps(), batches_of(n - 1)) << "every rank stepped as often as the longest";
  EXPECT_EQ(join.joined_at(), batches_of(world.rank())) << "the first step this rank had no batch for";
}

void expect_weights(flatshard::FullyShard<GPT>& fsdp, GPT& model, GPT& reference) {
  auto full = fsdp.summon_full_params();
  auto ours = model->named_parameters();
  for (const auto& p : reference->named_parameters()) {
    const auto& got = ours[p.key()];
    const double diff = (got - p.value()).abs().max().item<double>();
    EXPECT_LE(diff, 1e-5 * std::max(1.0, p.value().abs().max().item<double>())) << p.key();
  }
}

TEST(Join, UnevenInputsTrainToTheLongestInEveryStrategy) {
  FLATSHARD_RUN_RANKS({2, 3}, std::chrono::seconds(180));
  auto world = flatshard::init();
  GPT reference = reference_uneven(world.world_size(), 0);
  for (Strategy strategy : every_strategy(world.world_size())) {
    SCOPED_TRACE(to_string(strategy));
    GPT model = gpt_factory()();
    flatshard::FullyShard<GPT> fsdp(model, world, options_for(strategy, world.world_size()));
    train_uneven(world, fsdp);
    expect_weights(fsdp, model, reference);
  }
}

// Under staleness the joined ranks' zero contributions are delayed like any gradient; under
// decentralized training a joined rank keeps exchanging its weights with its neighbours,
// so they still move after its last batch.
TEST(Join, UnevenInputsUnderStalenessAndDecentralizedTraining) {
  FLATSHARD_RUN_RANKS({2, 3}, std::chrono::seconds(180));
  auto world = flatshard::init();
  GPT reference = reference_uneven(world.world_size(), 1);
  for (Strategy strategy : {Strategy::NoShard, Strategy::ShardOptimizerState}) {
    SCOPED_TRACE(::testing::Message() << to_string(strategy) << " staleness 1");
    GPT model = gpt_factory()();
    auto options = options_for(strategy);
    options.staleness = 1;
    flatshard::FullyShard<GPT> fsdp(model, world, options);
    train_uneven(world, fsdp);
    expect_weights(fsdp, model, reference);
  }
  GPT model = gpt_factory()();
  auto options = options_for(Strategy::NoShard);
  options.decentralized_every = 1;
  flatshard::FullyShard<GPT> ddp(model, world, options);
  at::Tensor at_join, at_end;
  train_uneven(world, ddp, [&](const flatshard::Join& join) {
    if (join.joined() && !at_join.defined()) at_join = ddp.shards().front().detach().clone();
  });
  at_end = ddp.shards().front().detach().clone();
  if (world.rank() + 1 < world.world_size()) {  // every rank but the longest joins early
    ASSERT_TRUE(at_join.defined());
    EXPECT_GT((at_end - at_join).abs().max().item<double>(), 0.0)
        << "a joined rank's weights no longer moved: it stopped averaging with its neighbours";
  }
  // Against the rule over every rank's weights, in one process: each step
  // w_r <- (w_{r-1} + w_r + w_{r+1}) / 3 - lr g_r, where g_r is the gradient at w_r of rank
  // r's batch, and zero once r has joined.
  const int n = world.world_size();
  GPT sim = gpt_factory()();
  auto names = sim->named_parameters();
  std::vector<std::vector<at::Tensor>> weights(n);
  for (int r = 0; r < n; ++r) {
    for (const auto& p : names) weights[r].push_back(p.value().detach().clone());
  }
  for (int step = 0; step < batches_of(n - 1); ++step) {
    std::vector<std::vector<at::Tensor>> next(n);
    for (int r = 0; r < n; ++r) {
      {
        at::NoGradGuard no_grad;
        for (std::size_t k = 0; k < names.size(); ++k) names[k].value().copy_(weights[r][k]);
      }
      sim->zero_grad();
      const bool has_data = step < batches_of(r);
      if (has_data) {
        const auto b = batch_of(r, step, n);
        token_loss(sim->forward(b.input), b.target).backward();
      }
      for (std::size_t k = 0; k < names.size(); ++k) {
        const auto average = (weights[r][k] + weights[(r + n - 1) % n][k] + weights[(r + 1) % n][k]) / 3;
        next[r].push_back(has_data ? average - kLr * names[k].value().grad() : average);
      }
    }
    weights = std::move(next);
  }
  auto full = ddp.summon_full_params();
  auto ours = model->named_parameters();
  for (std::size_t k = 0; k < names.size(); ++k) {
    const auto& want = weights[world.rank()][k];
    const double diff = (ours[names[k].key()] - want).abs().max().item<double>();
    EXPECT_LE(diff, 1e-5 * std::max(1.0, want.abs().max().item<double>())) << names[k].key();
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
  // Rank 1 has data again at step 1: refused on every rank at once (rank 0 is not left
  // waiting in the count's all-reduce), naming rank 1 and its step on rank 1.
  try {
    join.step(world.rank() == 1);
    ADD_FAILURE() << "a rank that had joined was let back in";
  } catch (const flatshard::InvalidArgument& e) {
    const std::string what = e.what();
    if (world.rank() == 1) {
      EXPECT_NE(what.find("rank 1/2"), std::string::npos) << what;
      EXPECT_NE(what.find("step 0"), std::string::npos) << what;
    } else {
      EXPECT_NE(what.find("another rank had data again at step 1"), std::string::npos) << what;
    }
  }
}

}  // namespace
