// The memory planner against the counting allocator's measured peak, for every mode at
// world sizes 1 to 4.
#include <ATen/Parallel.h>

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "flatshard/plan.h"
#include "tests/support/cases.h"
#include "tests/support/multirank.h"
#include "tests/support/wrapped.h"

namespace {

using namespace flatshard::testing;
namespace plan = flatshard::plan;
using flatshard::Strategy;

// Wide enough that model states dominate, small enough for CI.
GPTConfig plan_config(int layers = 4) { return GPTConfig{2048, 32, 192, 4, layers}; }
constexpr int kGlobalBatch = 12;

Batch batch_of(int step, int rows) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  const auto c = plan_config();
  auto tokens = at::randint(c.vocab, {rows, c.context + 1}, g);
  return {tokens.narrow(1, 0, c.context).contiguous(), tokens.narrow(1, 1, c.context).contiguous()};
}

// Parameters it accepts are frozen (fine-tuning); none when empty.
using Frozen = std::function<bool(const std::string&)>;

GPT plan_model(const Frozen& frozen, int layers = 4) {
  GPT model(plan_config(layers));
  for (auto& item : model->named_parameters()) {
    if (frozen && frozen(item.key())) item.value().requires_grad_(false);
  }
  return model;
}

// Activations and backward temporaries of one micro-batch: the allocator's peak over a
// forward and backward of the plain model whose gradients already exist (with every
// block recomputed, when asked: the planner accounts for recomputation through what is
// measured).
std::int64_t measure_activations(int rows, bool recompute = false, const Frozen& frozen = {},
                                 int layers = 4) {
  torch::manual_seed(5);
  GPT model = plan_model(frozen, layers);
  flatshard::set_recompute(*model, recompute);
  for (auto& p : model->parameters()) {
    if (p.requires_grad()) p.mutable_grad() = at::zeros_like(p);
  }
  const auto b = batch_of(0, rows);
  token_loss(model->forward(b.input), b.target).backward();  // warm-up, as the modes' first step
  flatshard::memory::reset_allocator_peak();
  const auto before = flatshard::memory::allocator_stats().current_bytes;
  token_loss(model->forward(b.input), b.target).backward();
  return flatshard::memory::allocator_stats().peak_bytes - before;
}

// The planner's options for one mode of this process's runs (training on the CPU).
plan::PlanOptions cpu_plan(Strategy mode, const flatshard::World& world, std::int64_t activations) {
  plan::PlanOptions o;
  o.strategy = mode;
  o.world_size = world.world_size();
  o.activation_bytes = activations;
  o.cpu_compute = true;
  return o;
}

// Peak of one mode from before the model is built to the end of its third step, in
// bytes above what was allocated before (with cpu_offload: from the end of construction,
// whose host figures the planner does not give).
std::int64_t measure_peak(const flatshard::World& world, Strategy mode,
                          const flatshard::MemoryBudget& budget = {}, int rows = 0, bool recompute = false,
                          bool build_into_shards = false, bool cpu_offload = false,
                          bool step_in_backward = false, const Frozen& frozen = {}, bool find_unused = false,
                          int layers = 4) {
  if (rows == 0) rows = kGlobalBatch / world.world_size();
  const auto base = flatshard::memory::allocator_stats().current_bytes;
  flatshard::memory::reset_allocator_peak();
  torch::manual_seed(5);
  flatshard::testing::WrappedOptions o;
  o.fully_shard.memory_budget = budget;
  o.fully_shard.strategy = mode;  // BuildIntoShards needs it first
  o.fully_shard.cpu_offload = cpu_offload;
  o.fully_shard.find_unused_parameters = find_unused;
  GPT model{nullptr};
  if (build_into_shards) {
    flatshard::BuildIntoShards build(world, o.fully_shard);
    model = GPT(plan_config(layers));
  } else {
    model = plan_model(frozen, layers);
  }
  flatshard::set_recompute(*model, recompute);
  flatshard::testing::Wrapped<GPT> run(model, world, mode, o);
  if (step_in_backward) run.fully_shard().step_in_backward(run.shard_optimizer());
  if (cpu_offload) flatshard::memory::reset_allocator_peak();
  for (int step = 0; step < 3; ++step) {
    const auto b = batch_of(step, rows * world.world_size());
    const auto x = b.input.narrow(0, world.rank() * rows, rows),
               y = b.target.narrow(0, world.rank() * rows, rows);
    token_loss(run.forward(x), y).backward();
    run.step();
  }
  return flatshard::memory::allocator_stats().peak_bytes - base;
}

// Every mode, and (Note [Offloaded buckets], Note [Offloaded gradients]) every mode with
// CPU offload. On the CPU the device and the host are the same memory, so under offload
// what the planner puts on the device (Plan::training, at its peak at the start of
// backward) and on the host then (Plan::host without the gradient shards, which come
// later) add up to what is measured in training. (On a GPU the two are measured apart:
// tests/cuda/test_cuda.cpp.)
TEST(Planner, PredictsMeasuredPeakWithinTenPercent) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(300));
  at::set_num_threads(1);
  flatshard::memory::install_counting_allocator();
  auto world = flatshard::init();
  const auto activations = measure_activations(kGlobalBatch / world.world_size());
  torch::manual_seed(5);
  const auto shape = plan::shape_of(*GPT(plan_config()));
  for (bool offload : {false, true}) {
    for (Strategy mode :
         {Strategy::NoShard, Strategy::ShardOptimizerState, Strategy::ShardGradOp, Strategy::FullShard}) {
      auto o = cpu_plan(mode, world, activations);
      o.cpu_offload = offload;
      const auto predicted = plan::predict(shape, o);
      const auto expected =
          offload ? predicted.training() + predicted.host - predicted.late_host_grads : predicted.peak;
      const auto measured = measure_peak(world, mode, {}, 0, false, false, offload);
      const double error = static_cast<double>(expected - measured) / static_cast<double>(measured);
      std::printf("%s world %d%s: measured %.2f MiB, predicted %.2f MiB (%+.1f%%): %s\n", mode_name(mode),
                  world.world_size(), offload ? " offloaded" : "", measured / 1048576.0, expected / 1048576.0,
                  100 * error, predicted.describe().c_str());
      EXPECT_LE(std::abs(error), 0.10)
          << mode_name(mode) << " at world " << world.world_size() << (offload ? " offloaded" : "");
    }
  }
}

// A fine-tuning (the embeddings and every block's attention frozen: a partly frozen root
// and partly frozen blocks), whose frozen parameters take no gradient and no optimizer
// state: every mode within 10%.
TEST(Planner, PredictsMeasuredPeakOfAFineTuning) {
  FLATSHARD_RUN_RANKS({1, 2, 4}, std::chrono::seconds(300));
  at::set_num_threads(1);
  flatshard::memory::install_counting_allocator();
  auto world = flatshard::init();
  const Frozen frozen = [](const std::string& name) {
    return name.rfind("wte", 0) == 0 || name.rfind("wpe", 0) == 0 || name.find(".attn.") != std::string::npos;
  };
  const auto activations = measure_activations(kGlobalBatch / world.world_size(), false, frozen);
  torch::manual_seed(5);
  const auto shape = plan::shape_of(*plan_model(frozen));
  ASSERT_GT(shape.frozen(), shape.total() / 4);
  for (Strategy mode :
       {Strategy::NoShard, Strategy::ShardOptimizerState, Strategy::ShardGradOp, Strategy::FullShard}) {
    const auto predicted = plan::predict(shape, cpu_plan(mode, world, activations));
    const auto measured = measure_peak(world, mode, {}, 0, false, false, false, false, frozen);
    const double error = static_cast<double>(predicted.peak - measured) / static_cast<double>(measured);
    std::printf("fine-tuning, %s world %d: measured %.2f MiB, predicted %.2f MiB (%+.1f%%): %s\n",
                mode_name(mode), world.world_size(), measured / 1048576.0, predicted.peak / 1048576.0,
                100 * error, predicted.describe().c_str());
    EXPECT_LE(std::abs(error), 0.10) << mode_name(mode) << " at world " << world.world_size();
  }
}

// Note [Late in backward]: a states-heavy run (one sequence per rank: the activations are
// small beside 16 bytes per parameter) peaks at the end of backward with every gradient
// shard; stepping in backward, only the shards in flight exist then. Both within 10%, and
// the measured saving is most of the predicted one.
TEST(Planner, PredictsMeasuredPeakWhenSteppingInBackward) {
  FLATSHARD_RUN_RANKS({1, 2}, std::chrono::seconds(300));
  at::set_num_threads(1);
  flatshard::memory::install_counting_allocator();
  auto world = flatshard::init();
  constexpr int kRows = 1;
  const auto activations = measure_activations(kRows);
  torch::manual_seed(5);
  const auto shape = plan::shape_of(*GPT(plan_config()));
  for (Strategy mode : {Strategy::FullShard, Strategy::ShardGradOp}) {
    std::int64_t measured_after = 0, predicted_after = 0;
    for (bool in_backward : {false, true}) {
      auto o = cpu_plan(mode, world, activations);
      o.step_in_backward = in_backward;
      const auto predicted = plan::predict(shape, o);
      const auto measured = measure_peak(world, mode, {}, kRows, false, false, false, in_backward);
      const double error = static_cast<double>(predicted.peak - measured) / static_cast<double>(measured);
      std::printf("%s world %d%s: measured %.2f MiB, predicted %.2f MiB (%+.1f%%): %s\n", mode_name(mode),
                  world.world_size(), in_backward ? ", stepping in backward" : "", measured / 1048576.0,
                  predicted.peak / 1048576.0, 100 * error, predicted.describe().c_str());
      EXPECT_LE(std::abs(error), 0.10) << mode_name(mode) << (in_backward ? " stepping in backward" : "");
      if (!in_backward) {
        measured_after = measured;
        predicted_after = predicted.peak;
      } else {
        EXPECT_LT(predicted.peak, predicted_after);
        EXPECT_LT(measured, measured_after - (predicted_after - predicted.peak) / 2) << mode_name(mode);
      }
    }
  }
}

// Note [Reductions in one order]: with find_unused_parameters above one rank every unit is
// reduced when backward ends, so a states-heavy run (one sequence per rank, sixteen blocks
// sharded over four ranks) holds every unit's unsharded gradient then, some four times its
// gradient shards. Both within 10%, and the measured rise is most of the predicted one.
TEST(Planner, PredictsMeasuredPeakWhenUnusedParametersAreFound) {
  FLATSHARD_RUN_RANKS({4}, std::chrono::seconds(300));
  at::set_num_threads(1);
  flatshard::memory::install_counting_allocator();
  auto world = flatshard::init();
  constexpr int kRows = 1, kLayers = 16;
  const auto activations = measure_activations(kRows, false, {}, kLayers);
  torch::manual_seed(5);
  const auto shape = plan::shape_of(*GPT(plan_config(kLayers)));
  for (Strategy mode : {Strategy::FullShard, Strategy::ShardGradOp}) {
    std::int64_t measured_without = 0, predicted_without = 0;
    for (bool find_unused : {false, true}) {
      auto o = cpu_plan(mode, world, activations);
      o.find_unused_parameters = find_unused;
      const auto predicted = plan::predict(shape, o);
      const auto measured =
          measure_peak(world, mode, {}, kRows, false, false, false, false, {}, find_unused, kLayers);
      const double error = static_cast<double>(predicted.peak - measured) / static_cast<double>(measured);
      std::printf("%s world %d%s: measured %.2f MiB, predicted %.2f MiB (%+.1f%%): %s\n", mode_name(mode),
                  world.world_size(), find_unused ? ", finding unused parameters" : "", measured / 1048576.0,
                  predicted.peak / 1048576.0, 100 * error, predicted.describe().c_str());
      EXPECT_LE(std::abs(error), 0.10)
          << mode_name(mode) << (find_unused ? " finding unused parameters" : "");
      if (!find_unused) {
        measured_without = measured;
        predicted_without = predicted.peak;
      } else {
        EXPECT_GT(predicted.peak, predicted_without);
        EXPECT_GT(measured, measured_without + (predicted.peak - predicted_without) / 2) << mode_name(mode);
      }
    }
  }
}

// With every block recomputed, activations are measured the same way (smaller), and the
// prediction still holds.
TEST(Planner, PredictsMeasuredPeakWithRecomputation) {
  FLATSHARD_RUN_RANKS({1, 2, 4}, std::chrono::seconds(300));
  at::set_num_threads(1);
  flatshard::memory::install_counting_allocator();
  auto world = flatshard::init();
  const auto rows = kGlobalBatch / world.world_size();
  const auto activations = measure_activations(rows, /*recompute=*/true);
  EXPECT_LT(activations, measure_activations(rows, /*recompute=*/false));
  torch::manual_seed(5);
  const auto shape = plan::shape_of(*GPT(plan_config()));
  for (Strategy mode : {Strategy::NoShard, Strategy::FullShard}) {
    auto o = cpu_plan(mode, world, activations);
    o.recompute = true;
    const auto predicted = plan::predict(shape, o);
    const auto measured = measure_peak(world, mode, {}, 0, /*recompute=*/true);
    const double error = static_cast<double>(predicted.peak - measured) / static_cast<double>(measured);
    std::printf("%s world %d, recomputed: measured %.2f MiB, predicted %.2f MiB (%+.1f%%)\n", mode_name(mode),
                world.world_size(), measured / 1048576.0, predicted.peak / 1048576.0, 100 * error);
    EXPECT_LE(std::abs(error), 0.10) << mode_name(mode) << " at world " << world.world_size();
  }
}

// "Doesn't fit": with a per-rank budget below what DDP's model states need, DDP is
// refused at construction, stating need and budget; full shard trains within it.
TEST(Planner, BudgetRefusesDdpAndFullShardTrainsWithinIt) {
  FLATSHARD_RUN_RANKS({2, 3}, std::chrono::seconds(120));
  at::set_num_threads(1);
  flatshard::memory::install_counting_allocator();
  auto world = flatshard::init();
  flatshard::MemoryBudget budget;
  budget.bytes = 36 << 20;  // DDP: 16 bytes x 2.57M parameters = 39.2 MiB before activations
  try {
    measure_peak(world, Strategy::NoShard, budget);
    ADD_FAILURE() << "DDP was not refused";
  } catch (const flatshard::MemoryBudgetError& e) {
    const std::string what = e.what();
    EXPECT_GT(e.need_bytes(), budget.bytes);
    EXPECT_EQ(e.budget_bytes(), budget.bytes);
    EXPECT_NE(what.find("needs 39.2 MiB per rank"), std::string::npos) << what;
    EXPECT_NE(what.find("memory budget of 36.0 MiB"), std::string::npos) << what;
    EXPECT_NE(what.find("FullyShard (full shard) with the model built into shards"), std::string::npos)
        << what;
  }
  const auto peak = measure_peak(world, Strategy::FullShard, budget, /*rows=*/2);
  std::printf("full shard at world %d: measured peak %.1f MiB, budget 36 MiB\n", world.world_size(),
              peak / 1048576.0);
  EXPECT_LE(peak, budget.bytes);
}

// Building and wrapping alone: the whole model, or (built into shards) the shards with
// the root and the largest unit at full size.
TEST(Planner, PredictsTheConstructionPeak) {
  FLATSHARD_RUN_RANKS({1, 2, 4}, std::chrono::seconds(120));
  at::set_num_threads(1);
  flatshard::memory::install_counting_allocator();
  auto world = flatshard::init();
  auto config = plan_config();
  config.embedding_units = true;  // the vocabulary-sized matrices are units: a small root
  for (bool into_shards : {false, true}) {
    const auto base = flatshard::memory::allocator_stats().current_bytes;
    flatshard::memory::reset_allocator_peak();
    torch::manual_seed(5);
    GPT model{nullptr};
    if (into_shards) {
      flatshard::BuildIntoShards build(world, {});
      model = GPT(config);
    } else {
      model = GPT(config);
    }
    const auto shape = plan::shape_of(*model);
    flatshard::FullyShard<GPT> fsdp(model, world, {});
    const auto measured = flatshard::memory::allocator_stats().peak_bytes - base;
    plan::PlanOptions o;
    o.world_size = world.world_size();
    o.build_into_shards = into_shards;
    const auto predicted = plan::predict(shape, o).construction;
    const double error = static_cast<double>(predicted - measured) / static_cast<double>(measured);
    std::printf("construction world %d, %s: measured %.2f MiB, predicted %.2f MiB (%+.1f%%)\n",
                world.world_size(), into_shards ? "built into shards" : "built whole", measured / 1048576.0,
                predicted / 1048576.0, 100 * error);
    EXPECT_LE(std::abs(error), 0.10) << (into_shards ? "into shards" : "whole");
  }
}

TEST(Planner, ShapeOfFollowsTheUnits) {
  torch::manual_seed(5);
  GPT model(plan_config());
  const auto shape = plan::shape_of(*model);
  const auto c = plan_config();
  ASSERT_EQ(shape.unit_numels.size(), static_cast<std::size_t>(c.layers));
  std::int64_t total = 0;
  for (const auto& p : model->parameters()) total += p.numel();
  EXPECT_EQ(shape.total(), total);
  // Root: token and position embeddings, final layer norm, head.
  EXPECT_EQ(shape.root_numel, c.vocab * c.dim + c.context * c.dim + 2 * c.dim + c.dim * c.vocab);
  EXPECT_EQ(shape.largest_param_numel, c.vocab * c.dim);
}

// The device figures against what an H100 measured (CudaPlanner.PredictsTheDevicePeakWith-
// AndWithoutOffload in tests/cuda/test_cuda.cpp, 2026-11-25: the caching allocator's peak
// over three steps of AdamW, bf16 compute, fp32 masters, world 1, built on the host), so
// that the CPU machines keep the planner's GPU arithmetic within 10% of the GPU's
// (Note [The device peak in the loss's backward] in src/plan/plan.cpp). The shape is the
// test's GPT, built here; the activations are what that test measured on the GPU.
TEST(Planner, DeviceFiguresMatchWhatAnH100Measured) {
  GPTConfig config;
  config.vocab = 8192;
  config.context = 64;
  config.dim = 512;
  config.heads = 8;
  config.layers = 4;
  torch::manual_seed(5);
  const auto shape = plan::shape_of(*GPT(config));
  constexpr double kMiB = 1048576.0;
  struct Measured {
    Strategy mode;
    bool offload;
    double peak_mib;
  };
  const Measured runs[] = {
      {Strategy::FullShard, false, 353.03},
      {Strategy::FullShard, true, 100.24},
      {Strategy::ShardGradOp, false, 377.07},
      {Strategy::ShardGradOp, true, 123.16},
      {Strategy::NoShard, false, 431.53},
      {Strategy::NoShard, true, 128.36},
      {Strategy::ShardOptimizerState, false, 431.53},
      {Strategy::ShardOptimizerState, true, 128.36},
  };
  for (const auto& run : runs) {
    plan::PlanOptions o;
    o.strategy = run.mode;
    o.param_bytes = 2;
    o.activation_bytes = static_cast<std::int64_t>(83.05 * kMiB);
    o.cpu_offload = run.offload;
    o.build_on_host = true;
    const auto predicted = plan::predict(shape, o);
    const double error = (predicted.peak / kMiB - run.peak_mib) / run.peak_mib;
    std::printf("H100, %s%s: measured %.2f MiB, predicted %.2f MiB (%+.1f%%): %s\n", mode_name(run.mode),
                run.offload ? " offloaded" : "", run.peak_mib, predicted.peak / kMiB, 100 * error,
                predicted.describe().c_str());
    EXPECT_LE(std::abs(error), 0.10) << mode_name(run.mode) << (run.offload ? " offloaded" : "");
  }
}

}  // namespace
