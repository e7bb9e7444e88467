// The three models of the correctness tests with their data and losses.
#pragma once

#include <chrono>
#include <functional>
#include <vector>

#include "tests/support/models.h"
#include "tests/support/training.h"

namespace flatshard::testing {

inline std::function<torch::nn::Sequential()> mlp_factory() {
  return [] {
    torch::manual_seed(7);
    return make_mlp(8, 37, 5, 3);  // 37: layer sizes not divisible by the world size
  };
}
inline Batch mlp_batch(int step, int rows) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return {at::randn({rows, 8}, g), at::randn({rows, 5}, g)};
}
inline at::Tensor mse(const at::Tensor& out, const at::Tensor& y) { return torch::mse_loss(out, y); }

// HybridShard's group size where a test runs every strategy: groups of 2 where the world
// splits into several, else groups of 1 (each rank a whole replica, averaged across all).
inline int hybrid_group_size(int world_size) { return world_size > 2 && world_size % 2 == 0 ? 2 : 1; }

// Every strategy a world size can run (HybridShard from 2 ranks, in hybrid_group_size).
inline std::vector<Strategy> every_strategy(int world_size) {
  std::vector<Strategy> out{Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard,
                            Strategy::ShardOptimizerState};
  if (world_size > 1) out.push_back(Strategy::HybridShard);
  return out;
}

// A wrapper's options under `strategy` (HybridShard in hybrid_group_size(world_size)), with
// a test's deadline for its collectives.
inline FullyShardOptions options_for(Strategy strategy, int world_size = 1) {
  FullyShardOptions options;
  options.strategy = strategy;
  if (strategy == Strategy::HybridShard) options.shard_group_size = hybrid_group_size(world_size);
  options.comm.timeout = std::chrono::seconds(60);
  return options;
}

inline std::function<flatshard::SequentialUnits()> mlp_units_factory() {
  return [] {
    torch::manual_seed(7);
    return flatshard::SequentialUnits(make_mlp(8, 37, 5, 3), flatshard::SequentialUnitsOptions{1});
  };
}

inline GPTConfig gpt_config() { return GPTConfig{}; }
inline std::function<GPT()> gpt_factory() {
  return [] {
    torch::manual_seed(11);
    return GPT(gpt_config());
  };
}
inline Batch gpt_batch(int step, int rows) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(2000 + step);
  const auto c = gpt_config();
  auto tokens = at::randint(c.vocab, {rows, c.context + 1}, g);
  return {tokens.narrow(1, 0, c.context).contiguous(), tokens.narrow(1, 1, c.context).contiguous()};
}
inline at::Tensor token_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

inline std::function<MnistNet()> cnn_factory() {
  return [] {
    torch::manual_seed(3);
    return MnistNet(/*dropout=*/0.0);
  };
}
inline Batch cnn_batch(int step, int rows) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(3000 + step);
  return {at::randn({rows, 1, 28, 28}, g), at::randint(10, {rows}, g)};
}
inline at::Tensor nll(const at::Tensor& out, const at::Tensor& y) { return torch::nll_loss(out, y); }

}  // namespace flatshard::testing
