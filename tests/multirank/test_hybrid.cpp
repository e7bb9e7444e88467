// Hybrid sharding (Strategy::HybridShard): full shard within groups of G consecutive
// ranks, replicated across the groups. Trains as single-process training does at every
// G (1: DDP-like, world: full shard), holds 1/G of the states per rank, builds into
// shards of its group, and its checkpoints load in the other modes and back.
#include <unistd.h>

#include <filesystem>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "flatshard/plan.h"
#include "tests/support/cases.h"
#include "tests/support/multirank.h"

namespace {

using namespace flatshard::testing;
using flatshard::Strategy;
namespace fs = std::filesystem;

flatshard::FullyShardOptions hybrid(int group) {
  flatshard::FullyShardOptions o;
  o.strategy = Strategy::HybridShard;
  o.shard_group_size = group;
  o.comm.timeout = std::chrono::seconds(60);
  return o;
}

// Subworlds: each group's collectives see only its ranks.
TEST(Subworld, CollectivesStayWithinTheGroup) {
  FLATSHARD_RUN_RANKS({4}, std::chrono::seconds(60));
  auto world = flatshard::init();
  const int r = world.rank();
  const auto pair = flatshard::subworld(world, {r / 2 * 2, r / 2 * 2 + 1}, "pairs");
  const auto stride = flatshard::subworld(world, {r % 2, r % 2 + 2}, "stride");
  EXPECT_EQ(pair.world_size(), 2);
  EXPECT_EQ(pair.rank(), r % 2);
  EXPECT_EQ(stride.rank(), r / 2);
  auto a = flatshard::Communicator::create(pair, {});
  auto b = flatshard::Communicator::create(stride, {});
  auto x = at::full({3}, static_cast<float>(r));
  a->all_reduce(x, flatshard::ReduceOp::Sum).wait();
  EXPECT_EQ(x[0].item<float>(), r < 2 ? 1.0f : 5.0f);  // 0+1, 2+3
  auto y = at::full({3}, static_cast<float>(r));
  b->all_reduce(y, flatshard::ReduceOp::Sum).wait();
  EXPECT_EQ(y[0].item<float>(), r % 2 == 0 ? 2.0f : 4.0f);  // 0+2, 1+3
  EXPECT_THROW(flatshard::subworld(world, {(r + 1) % 4}, "without me"), flatshard::InvalidArgument);
  EXPECT_THROW(flatshard::subworld(world, {1, 0, 2, 3}, "unsorted"), flatshard::InvalidArgument);
}

// Every group size of world 4 (and world 2) against single-process training on the same
// global batch: fp32 and bf16 compute, gradient accumulation, and ShardGradOp within the
// group (reshard_after_forward off). Plain SGD moves each weight by lr times its gradient,
// so a wrong averaging divisor shows; with clipping that clips, a norm over the wrong
// ranks shows too (AdamW alone is blind to a uniform gradient scale).
TEST(HybridShard, MatchesSingleProcessAtEveryGroupSize) {
  FLATSHARD_RUN_RANKS({2, 4}, std::chrono::seconds(300));
  auto world = flatshard::init();
  struct Case {
    OptKind optimizer;
    double clip;
  };
  for (int group = 1; group <= world.world_size(); group *= 2) {
    for (bool bf16 : {false, true}) {
      for (const Case& c :
           {Case{OptKind::PlainSGD, 0}, Case{OptKind::PlainSGD, 0.25}, Case{OptKind::AdamW, 0.25}}) {
        SCOPED_TRACE(::testing::Message()
                     << "world " << world.world_size() << ", groups of " << group
                     << (bf16 ? ", bf16, " : ", fp32, ") << to_string(c.optimizer) << ", clip " << c.clip);
        TrainSpec spec;
        spec.strategy = Strategy::HybridShard;
        spec.shard_group_size = group;
        spec.optimizer = c.optimizer;
        spec.steps = 4;
        spec.micro_batches = 2;
        spec.clip = c.clip;
        if (bf16) {
          spec.param_dtype = at::kBFloat16;
          spec.reduce_dtype = at::kFloat;
        }
        const auto r = train_and_compare<GPT>(
            world, gpt_factory(), [](int s) { return gpt_batch(s, 8); }, token_loss, spec);
        expect_no_sync_sends_no_reduction(r, spec, world.world_size());
        if (world.rank() == 0) {
          std::printf(
              "hybrid world %d groups %d %s %s clip %.2f: model rel weight diff %.3g, masters %.3g, rel loss "
              "diff "
              "%.3g\n",
              world.world_size(), group, bf16 ? "bf16" : "fp32", to_string(c.optimizer), c.clip,
              r.global_rel_weight_diff, r.global_rel_master_diff, r.max_rel_loss_diff);
        }
        // Note [bf16 tolerance] in test_fully_shard.cpp.
        const double tolerance = bf16 ? kBf16Tolerance : kFp32Tolerance;
        EXPECT_LE(r.global_rel_weight_diff, tolerance) << "worst " << r.worst_param;
        // fp32: every tensor on its own too, so that an error confined to a small one (an
        // element at a shard's edge left out of the replicas' all-reduce) is not averaged away.
        if (!bf16) EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << "worst " << r.worst_param;
        EXPECT_LE(r.max_rel_loss_diff, tolerance);
        EXPECT_LE(r.global_rel_master_diff, bf16 ? bf16_master_tolerance(c.optimizer) : kFp32Tolerance);
        if (c.clip > 0) EXPECT_GT(r.max_grad_norm, c.clip) << "the test must actually clip";
        EXPECT_LE(r.peak_gathered_units, 2);
      }
    }
  }
}

// Per-rank states follow 1/G: the shards of groups of 2 are twice those of groups of 4
// (full shard at world 4) and half those of groups of 1 (every rank holds the model).
TEST(HybridShard, HoldsOneGroupsShareOfTheStates) {
  FLATSHARD_RUN_RANKS({4}, std::chrono::seconds(120));
  auto world = flatshard::init();
  std::int64_t total = 0;
  for (const auto& p : gpt_factory()()->parameters()) total += p.numel();
  std::map<int, std::int64_t> shard_bytes;
  for (int group : {1, 2, 4}) {
    auto model = gpt_factory()();
    flatshard::FullyShard<GPT> fsdp(model, world, hybrid(group));
    const auto g = fsdp.shard_group();
    EXPECT_EQ(g.size, group);
    EXPECT_EQ(g.rank, world.rank() % group);
    EXPECT_EQ(g.replicas, 4 / group);
    EXPECT_EQ(g.replica, world.rank() / group);
    shard_bytes[group] = fsdp.memory().param_shard_bytes;
    // fp32 shards: 4 bytes per parameter over G ranks, plus at most 16 bytes of padding
    // per unit and rank.
    const std::int64_t ideal = total * 4 / group;
    EXPECT_GE(shard_bytes[group], ideal) << "groups of " << group;
    EXPECT_LE(shard_bytes[group], ideal + 16 * fsdp.num_units() * 4) << "groups of " << group;
  }
  EXPECT_NEAR(static_cast<double>(shard_bytes[2]) / shard_bytes[4], 2.0, 0.01);
  EXPECT_NEAR(static_cast<double>(shard_bytes[1]) / shard_bytes[2], 2.0, 0.01);
  // The planner says the same: full shard over the group.
  flatshard::plan::PlanOptions o;
  o.world_size = 4;
  o.shard_group_size = 2;
  const auto hybrid_plan = flatshard::plan::predict(flatshard::plan::shape_of(*gpt_factory()()), o);
  o.world_size = 2;
  o.shard_group_size = 0;
  const auto two = flatshard::plan::predict(flatshard::plan::shape_of(*gpt_factory()()), o);
  EXPECT_EQ(hybrid_plan.params, two.params);
  EXPECT_EQ(hybrid_plan.peak, two.peak);
}

// bytes_sent() counts every communicator of the engine: a hybrid step of groups of 2 at
// world 4 sends what full shard over the group's two ranks sends for the same step, plus
// the replica all-reduce of each unit's fp32 shard gradient (over two ranks a ring
// all-reduce sends its whole input once).
TEST(HybridShard, BytesSentCountTheGroupAndTheReplicas) {
  FLATSHARD_RUN_RANKS({4}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const int r = world.rank();
  const auto pair = flatshard::subworld(world, {r / 2 * 2, r / 2 * 2 + 1}, "group");
  const auto b = gpt_batch(0, 8);
  auto step_bytes = [&](const flatshard::World& w, flatshard::FullyShardOptions options) {
    auto model = gpt_factory()();
    flatshard::FullyShard<GPT> fsdp(model, w, options);
    const auto before = fsdp.bytes_sent();
    token_loss(fsdp.forward(b.input.narrow(0, 2 * r, 2)), b.target.narrow(0, 2 * r, 2)).backward();
    std::uint64_t shard_bytes = 0;
    for (const auto& l : fsdp.layout()) shard_bytes += static_cast<std::uint64_t>(l.shard_numel) * 4;
    return std::make_pair(fsdp.bytes_sent() - before, shard_bytes);
  };
  auto full = hybrid(0);
  full.strategy = Strategy::FullShard;
  const auto [in_group, shard_bytes] = step_bytes(pair, full);
  const auto [hybrid_step, hybrid_shard_bytes] = step_bytes(world, hybrid(2));
  EXPECT_GT(in_group, 0u);
  EXPECT_EQ(hybrid_shard_bytes, shard_bytes);
  EXPECT_EQ(hybrid_step, in_group + shard_bytes);
}

// A group size that does not divide the world is refused on every rank, before any
// communicator is made.
TEST(HybridShard, RefusesAGroupSizeThatDoesNotDivideTheWorld) {
  FLATSHARD_RUN_RANKS({4}, std::chrono::seconds(60));
  auto world = flatshard::init();
  try {
    flatshard::FullyShard<GPT> fsdp(gpt_factory()(), world, hybrid(3));
    ADD_FAILURE() << "groups of 3 accepted at world 4";
  } catch (const flatshard::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("divides the world size 4, got 3"), std::string::npos) << e.what();
  }
  // Nothing else met after init: leave together, so that rank 0's store outlives every
  // rank's rendezvous.
  flatshard::Communicator::create(world, {})->barrier().wait();
}

std::map<std::string, at::Tensor> full_params(flatshard::FullyShardBase& fsdp) {
  auto guard = fsdp.summon_full_params();
  std::map<std::string, at::Tensor> out;
  for (const auto& item : fsdp.root_module().named_parameters())
    out[item.key()] = item.value().detach().clone();
  return out;
}

// Trains `steps` steps of AdamW on this rank's rows of the global batch.
void train(flatshard::FullyShard<GPT>& fsdp, flatshard::optim::Adam& opt, int first, int steps) {
  const auto& w = fsdp.world();
  const int local = 8 / w.world_size();
  for (int s = first; s < first + steps; ++s) {
    const auto b = gpt_batch(s, 8);
    token_loss(fsdp.forward(b.input.narrow(0, w.rank() * local, local)),
               b.target.narrow(0, w.rank() * local, local))
        .backward();
    opt.step();
    opt.zero_grad();
  }
}

// Hybrid checkpoints are full-shard checkpoints: saved from groups of 2, loaded under full
// shard (and the reverse, into groups of 2 and of 1), the parameters are the saved ones bit
// for bit, and the two steps after the load match single-process AdamW trained through all
// four: a load that lost the optimizer's moments or step count would not.
TEST(HybridShard, CheckpointsLoadAcrossHybridAndFullShard) {
  FLATSHARD_RUN_RANKS({4}, std::chrono::seconds(240));
  auto world = flatshard::init();
  const flatshard::optim::AdamWOptions adamw{1e-3, 0.9, 0.999, 1e-8, 0.1};
  auto root = (fs::temp_directory_path() / fmt::format("flatshard-hybrid-ckpt-{}", ::getppid())).string();
  auto run = [&](flatshard::FullyShardOptions options, const std::string& load, const std::string& save,
                 int first) {
    auto model = gpt_factory()();
    flatshard::FullyShard<GPT> fsdp(model, world, options);
    flatshard::optim::AdamW opt(fsdp, adamw);
    std::map<std::string, at::Tensor> loaded;
    if (!load.empty()) {
      flatshard::checkpoint::load_sharded(load, fsdp, &opt);
      loaded = full_params(fsdp);
    }
    train(fsdp, opt, first, 2);
    if (!save.empty()) {
      flatshard::checkpoint::SaveOptions at_step;
      at_step.step = first + 2;
      flatshard::checkpoint::save_sharded(save, fsdp, &opt, at_step);
    }
    return std::make_pair(loaded, full_params(fsdp));
  };
  auto expect_equal = [](const std::map<std::string, at::Tensor>& got,
                         const std::map<std::string, at::Tensor>& want, double tolerance,
                         const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (const auto& [name, t] : want) {
      const double rel = (got.at(name) - t).norm().item<double>() / std::max(t.norm().item<double>(), 1e-12);
      EXPECT_LE(rel, tolerance) << what << ": " << name;
    }
  };
  // Single-process AdamW on the whole global batch, four steps.
  std::map<std::string, at::Tensor> reference;
  {
    auto model = gpt_factory()();
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(adamw.lr)
                                                     .betas({adamw.beta1, adamw.beta2})
                                                     .eps(adamw.eps)
                                                     .weight_decay(adamw.weight_decay));
    for (int s = 0; s < 4; ++s) {
      const auto b = gpt_batch(s, 8);
      opt.zero_grad();
      token_loss(model->forward(b.input), b.target).backward();
      opt.step();
    }
    for (const auto& item : model->named_parameters()) reference[item.key()] = item.value().detach().clone();
  }
  const auto full = flatshard::FullyShardOptions{};
  // Saved from groups of 2 after two steps.
  const auto saved = run(hybrid(2), "", root + "/hybrid", 0).second;
  const auto into_full = run(full, root + "/hybrid/step-000000002", "", 2);
  expect_equal(into_full.first, saved, 0, "hybrid -> full shard, as loaded");
  const auto hybrid_on = run(hybrid(2), root + "/hybrid/step-000000002", root + "/hybrid-on", 2);
  expect_equal(hybrid_on.first, saved, 0, "hybrid -> hybrid, as loaded");
  expect_equal(into_full.second, reference, 1e-5, "hybrid -> full shard, two more steps");
  expect_equal(hybrid_on.second, reference, 1e-5, "hybrid -> hybrid, two more steps");
  // Saved from full shard, loaded into groups of 2 and of 1.
  const auto saved_full = run(full, "", root + "/full", 0).second;
  for (int group : {2, 1}) {
    const auto into_hybrid = run(hybrid(group), root + "/full/step-000000002", "", 2);
    expect_equal(into_hybrid.first, saved_full, 0, fmt::format("full shard -> groups of {}", group));
    expect_equal(into_hybrid.second, reference, 1e-5,
                 fmt::format("full shard -> groups of {}, two more steps", group));
  }
  if (world.rank() == 0) fs::remove_all(root);
}

}  // namespace
