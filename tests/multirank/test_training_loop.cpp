// The training loop's pieces over shards: parameter groups against torch::optim's groups
// in every strategy, parameters without gradients left untouched, learning-rate schedules
// resumed from checkpoints bit for bit, and fp16 with dynamic loss scaling.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <limits>
#include <optional>

#include "tests/support/cases.h"
#include "tests/support/models.h"
#include "tests/support/multirank.h"
#include "tests/support/training.h"

namespace {

using namespace flatshard::testing;
using flatshard::Strategy;
namespace fs = std::filesystem;
namespace optim = flatshard::optim;

// Every parameter of `ref` within 1e-5 (relative, 2-norm) of the same name in `got`.
void expect_weights_match(const std::map<std::string, at::Tensor>& got, torch::nn::Module& ref) {
  for (const auto& item : ref.named_parameters()) {
    const auto& want = item.value();
    const double rel = (got.at(item.key()) - want).norm().item<double>() / want.norm().item<double>();
    EXPECT_LE(rel, 1e-5) << item.key();
  }
}

// The GPT trained in one process with torch's AdamW (lr 1e-2) on batches 0 to steps - 1.
GPT trained_in_one_process(int steps, int rows) {
  auto ref = gpt_factory()();
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < steps; ++s) {
    const auto b = gpt_batch(s, rows);
    ref_opt.zero_grad();
    token_loss(ref->forward(b.input), b.target).backward();
    ref_opt.step();
  }
  return ref;
}

// Every strategy at this world size, then FullShard and NoShard offloaded: (strategy, offloads).
std::vector<std::pair<Strategy, bool>> strategies_and_offload(int world_size) {
  std::vector<std::pair<Strategy, bool>> cases;
  for (Strategy strategy : every_strategy(world_size)) cases.emplace_back(strategy, false);
  cases.emplace_back(Strategy::FullShard, true);
  cases.emplace_back(Strategy::NoShard, true);
  return cases;
}

// Groups (no decay for biases, norms, embeddings; twice the rate for the head) equal
// torch::optim's with the same groups, in every strategy; at worlds 2 and 3 parameters
// are split across ranks' shards, so each part must get its group's settings.
TEST(ParamGroups, MatchTorchOptimGroupsInEveryStrategy) {
  FLATSHARD_RUN_RANKS({2, 3, 4}, std::chrono::seconds(400));
  auto world = flatshard::init();
  for (Strategy strategy : every_strategy(world.world_size())) {
    for (OptKind opt : {OptKind::SGD, OptKind::Adam, OptKind::AdamW}) {
      TrainSpec spec;
      spec.strategy = strategy;
      spec.shard_group_size = hybrid_group_size(world.world_size());
      spec.optimizer = opt;
      spec.param_groups = true;
      spec.steps = 6;
      const auto r = train_and_compare<GPT>(
          world, gpt_factory(), [&](int s) { return gpt_batch(s, 12); }, token_loss, spec);
      SCOPED_TRACE(::testing::Message()
                   << to_string(strategy) << " " << to_string(opt) << " world " << world.world_size());
      EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << r.worst_param;
      EXPECT_LE(r.max_rel_loss_diff, kFp32Tolerance);
    }
  }
  TrainSpec spec;  // the CNN: its head (fc2) and conv biases split across ranks
  spec.optimizer = OptKind::AdamW;
  spec.param_groups = true;
  spec.steps = 4;
  const auto r = train_and_compare<MnistNet>(
      world, cnn_factory(), [&](int s) { return cnn_batch(s, 12); }, nll, spec);
  EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << r.worst_param;
}

// A unit whose second linear layer (b) only sees rows whose first feature is positive:
// in a step where no row of the global batch is, b gets no gradient anywhere.
struct GateImpl : torch::nn::Module {
  GateImpl() {
    a = register_module("a", torch::nn::Linear(6, 16));
    b = register_module("b", torch::nn::Linear(6, 16));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = a(x);
    const auto mask = x.select(1, 0) > 0;
    if (mask.any().item<bool>()) h = h + b(x) * mask.unsqueeze(1).to(h.scalar_type());
    return torch::tanh(h);
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Gate);

struct GatedNetImpl : torch::nn::Module {
  GatedNetImpl() {
    gate = register_module("gate", flatshard::Unit<Gate>());
    head = register_module("head", torch::nn::Linear(16, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return head(gate(x)); }
  flatshard::Unit<Gate> gate{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(GatedNet);

// Steps 0, 3, 6, ...: the first row (rank 0's) opens the gate; other steps: no row does.
Batch gated_batch(int step, int rows) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(4000 + step);
  auto x = at::randn({rows, 6}, g);
  x.select(1, 0).fill_(-1.0);
  if (step % 3 == 0) x[0][0] = 1.0;
  return {x, at::randn({rows, 3}, g)};
}

// torch::optim leaves b untouched in the steps where it gets no gradient (no weight
// decay, no momentum, no step count); every strategy does the same. With
// find_unused_parameters the ranks agree on it when only rank 0 used b; without it (the
// sharded strategies' default) each rank's own record is right when no rank used it.
TEST(UnusedParameters, AreLeftUntouchedAsTorchOptimLeavesThem) {
  FLATSHARD_RUN_RANKS({1, 2, 3}, std::chrono::seconds(300));
  auto world = flatshard::init();
  const auto make = [] {
    torch::manual_seed(5);
    return GatedNet();
  };
  for (Strategy strategy : every_strategy(world.world_size())) {
    for (bool find_unused : {false, true}) {
      const bool replicated = strategy == Strategy::NoShard || strategy == Strategy::ShardOptimizerState;
      if (replicated && !find_unused) continue;  // refused: tested in test_replicated.cpp
      for (OptKind opt : {OptKind::SGD, OptKind::AdamW}) {
        TrainSpec spec;
        spec.strategy = strategy;
        spec.shard_group_size = hybrid_group_size(world.world_size());
        spec.optimizer = opt;
        spec.find_unused_parameters = find_unused;
        spec.steps = 7;
        // Without find_unused_parameters only steps where no rank uses b are uniform.
        const auto batch = [&](int s) {
          auto b = gated_batch(s, 12);
          if (!find_unused && world.world_size() > 1) b.input.select(1, 0).fill_(-1.0);
          return b;
        };
        const bool b_used = find_unused || world.world_size() == 1;  // in steps 0, 3 and 6
        // The reference's b before each step: it moves exactly after the steps that used it.
        std::vector<at::Tensor> ref_b;
        spec.before_step = [&](int, torch::nn::Module& ref, torch::nn::Module&) {
          ref_b.push_back(ref.named_parameters()["gate.b.weight"].detach().clone());
        };
        const at::Tensor b_initial = make()->gate->b->weight.detach().clone();
        const auto r = train_and_compare<GatedNet>(world, make, batch, mse, spec);
        SCOPED_TRACE(::testing::Message() << to_string(strategy) << " " << to_string(opt) << " find_unused "
                                          << find_unused << " world " << world.world_size());
        EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << r.worst_param;
        ASSERT_EQ(ref_b.size(), 7u);
        ASSERT_TRUE(ref_b[0].equal(b_initial));
        for (int step = 1; step < 7; ++step) {
          const bool used_before = b_used && (step - 1) % 3 == 0;
          EXPECT_EQ(!ref_b[step].equal(ref_b[step - 1]), used_before)
              << "reference b after step " << step - 1;
        }
        // The distributed b moved as the reference's did, or not at all, bit for bit.
        const at::Tensor b_final = r.weights.at("gate.b.weight");
        if (b_used) {
          EXPECT_GT((b_final - b_initial).abs().max().item<double>(), 1e-3) << "b must have moved";
        } else {
          EXPECT_TRUE(b_final.equal(b_initial)) << "b got no gradient on any rank and must not move";
        }
      }
    }
  }
}

// Note [Parameters without gradients]: gradients accumulated over two micro-batches,
// each backward reduced (no no_sync), where only the first micro-batch opens the gate: b's
// gradient is in its accumulated .grad when the optimizer steps, so torch::optim steps it,
// and so must every strategy. A record that began again at the second backward would leave
// b out of the step (and with AdamW out of its weight decay).
TEST(UnusedParameters, AParameterOnlyAnEarlierMicroBatchUsedIsStepped) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(300));
  auto world = flatshard::init();
  const auto make = [] {
    torch::manual_seed(5);
    return GatedNet();
  };
  for (Strategy strategy : every_strategy(world.world_size())) {
    TrainSpec spec;
    spec.strategy = strategy;
    spec.shard_group_size = hybrid_group_size(world.world_size());
    spec.optimizer = OptKind::AdamW;
    spec.find_unused_parameters = true;
    spec.micro_batches = 2;
    spec.reduce_every_micro_batch = true;
    spec.steps = 2;
    const at::Tensor b_initial = make()->gate->b->weight.detach().clone();
    // Step 0's first row (rank 0's, in the first micro-batch) opens the gate; step 1 opens none.
    const auto r = train_and_compare<GatedNet>(
        world, make, [](int s) { return gated_batch(s == 0 ? 0 : 1, 12); }, mse, spec);
    SCOPED_TRACE(to_string(strategy));
    EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << r.worst_param;
    EXPECT_GT((r.weights.at("gate.b.weight") - b_initial).abs().max().item<double>(), 1e-3)
        << "b must have moved";
  }
}

// Two units of one shape, the second gated (Note [Reductions in one order]): its b only
// sees rows whose first column (passed through the units unchanged) is positive.
struct StageImpl : torch::nn::Module {
  explicit StageImpl(bool gated) : gated(gated) {
    a = register_module("a", torch::nn::Linear(6, 6));
    b = register_module("b", torch::nn::Linear(6, 6));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = a(x);
    const auto mask = x.select(1, 0) > 0;
    if (!gated) {
      h = h + b(x);
    } else if (mask.any().item<bool>()) {
      h = h + b(x) * mask.unsqueeze(1).to(h.scalar_type());
    }
    return torch::cat({x.narrow(1, 0, 1), torch::tanh(h).narrow(1, 1, 5)}, 1);
  }
  bool gated;
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Stage);

struct TwoStagesImpl : torch::nn::Module {
  TwoStagesImpl() {
    first = register_module("first", flatshard::Unit<Stage>(false));
    second = register_module("second", flatshard::Unit<Stage>(true));
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return head(second(first(x))); }
  flatshard::Unit<Stage> first{nullptr}, second{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TwoStages);

// 12 rows for the gated stages: only the first (rank 0's) opens the gate.
Batch rank0_opens_the_gate(std::uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto x = at::randn({12, 6}, g);
  x.select(1, 0).fill_(-1.0);
  x[0][0] = 1.0;
  return Batch{x, at::randn({12, 3}, g)};
}

// Only rank 0's rows open the second unit's gate, so on the other ranks that unit's b gets
// no gradient and the unit is not done when its backward is: with find_unused_parameters
// the sharded strategies still reduce the units in one order on every rank (Note
// [Reductions in one order]) and train as single-process training does. Reduced as each
// rank finished them, rank 0 would reduce the second unit first and the others the first,
// and, the units being of one size, every rank would add one unit's gradients to the
// other's.
TEST(UnusedParameters, UnitsDoneAtOtherTimesOnOtherRanksReduceInOneOrder) {
  FLATSHARD_RUN_RANKS({2, 3}, std::chrono::seconds(240));
  auto world = flatshard::init();
  const auto make = [] {
    torch::manual_seed(7);
    return TwoStages();
  };
  const auto batch = [](int s) { return rank0_opens_the_gate(5000 + s); };
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp}) {
    TrainSpec spec;
    spec.strategy = strategy;
    spec.find_unused_parameters = true;
    spec.optimizer = OptKind::AdamW;
    spec.steps = 4;
    const auto r = train_and_compare<TwoStages>(world, make, batch, mse, spec);
    SCOPED_TRACE(::testing::Message() << to_string(strategy) << " world " << world.world_size());
    EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << r.worst_param;
  }
}

// A frozen unit first (its backward is never reached: its input and parameters need no
// gradient), then the two stages, the second gated as above.
struct FrozenLeadImpl : torch::nn::Module {
  FrozenLeadImpl() {
    lead = register_module("lead", flatshard::Unit<Stage>(false));
    first = register_module("first", flatshard::Unit<Stage>(false));
    second = register_module("second", flatshard::Unit<Stage>(true));
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return head(second(first(lead(x)))); }
  flatshard::Unit<Stage> lead{nullptr}, first{nullptr}, second{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(FrozenLead);

// With find_unused_parameters the gated unit stays gathered until backward ends on the
// ranks whose rows leave its b unused, and is resharded early on rank 0. The next unit's
// backward then prefetches the frozen lead unit: were that prefetch bounded by the units
// gathered, rank 0 would issue it and the others not, and the gathers would go out of step
// (Note [Units a backward did not reach]); every rank prefetches, and training matches a
// single process.
TEST(UnusedParameters, APrefetchInBackwardIsTheSameOnEveryRank) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const auto make = [] {
    torch::manual_seed(17);
    return FrozenLead();
  };
  const auto batch = [](int s) { return rank0_opens_the_gate(6000 + s); };
  TrainSpec spec;
  spec.strategy = Strategy::FullShard;
  spec.find_unused_parameters = true;
  spec.optimizer = OptKind::PlainSGD;
  spec.steps = 3;
  spec.frozen = [](const std::string& name) { return name.rfind("lead.", 0) == 0; };
  const auto r = train_and_compare<FrozenLead>(world, make, batch, mse, spec);
  EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << r.worst_param;
}

// Two units side by side on the input; the loss reaches each only while its flag is set
// (a branch whose output is dropped: an auxiliary head, a LayerDrop), though both run
// forward on every rank.
struct BranchesImpl : torch::nn::Module {
  BranchesImpl() {
    left = register_module("left", flatshard::Unit<Stage>(false));
    right = register_module("right", flatshard::Unit<Stage>(false));
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto a = left(x), b = right(x);
    return head((use_left ? a : a.detach() * 0) + (use_right ? b : b.detach() * 0));
  }
  bool use_left = true, use_right = true;
  flatshard::Unit<Stage> left{nullptr}, right{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Branches);

at::Tensor mse_of(const at::Tensor& out, const at::Tensor& target) { return torch::mse_loss(out, target); }

// Note [Units a backward did not reach]: two micro-batches, the first under no_sync()
// reaching both branches, the second (the synced backward) only the left one. The right
// unit's gradient from the first stays in its full gradient with no hook of the synced
// backward to reduce it; single-process training steps it all the same (its .grad stays
// defined), and so must every strategy, with or without find_unused_parameters. Plain SGD:
// a gradient lost or counted twice moves the right unit by another amount.
TEST(UnusedParameters, AUnitOnlyAMicroBatchUnderNoSyncReachedIsStepped) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(240));
  auto world = flatshard::init();
  const int n = world.world_size(), rank = world.rank();
  constexpr int kRows = 4;  // per rank and micro-batch
  constexpr double lr = 0.1;
  for (Strategy strategy : every_strategy(n)) {
    for (bool find_unused : {false, true}) {
      const bool replicated = strategy == Strategy::NoShard || strategy == Strategy::ShardOptimizerState;
      if (replicated && !find_unused) continue;  // they refuse a parameter the synced backward leaves out
      SCOPED_TRACE(::testing::Message()
                   << to_string(strategy) << (find_unused ? ", find_unused_parameters" : ""));
      torch::manual_seed(11);
      Branches reference;
      torch::manual_seed(11);
      Branches model;
      const at::Tensor right_start = reference->right->a->weight.detach().clone();
      torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(lr));
      auto options = options_for(strategy, n);
      options.find_unused_parameters = find_unused;
      flatshard::FullyShard<Branches> fsdp(model, world, options);
      optim::SGD opt(fsdp, optim::SGDOptions{lr});
      for (int step = 0; step < 2; ++step) {
        auto g = at::make_generator<at::CPUGeneratorImpl>(700 + step);
        const auto x = at::randn({2, kRows * n, 6}, g), target = at::randn({2, kRows * n, 3}, g);
        ref_opt.zero_grad();
        for (int m = 0; m < 2; ++m) {
          reference->use_right = m == 0;
          (mse_of(reference->forward(x[m]), target[m]) / 2).backward();
        }
        ref_opt.step();
        for (int m = 0; m < 2; ++m) {
          model->use_right = m == 0;
          std::optional<flatshard::FullyShardBase::NoSync> guard;
          if (m == 0) guard.emplace(fsdp);
          (mse_of(fsdp.forward(x[m].narrow(0, kRows * rank, kRows)),
                  target[m].narrow(0, kRows * rank, kRows)) /
           2)
              .backward();
        }
        EXPECT_NO_THROW(fsdp.clip_grad_norm(1e30)) << "the synced backward reduced everything";
        opt.step();
        opt.zero_grad();
      }
      ASSERT_GT((reference->right->a->weight.detach() - right_start).abs().max().item<double>(), 1e-3);
      expect_weights_match(flatshard::checkpoint::full_state_dict(fsdp, *model, -1), *reference);
    }
  }
}

// With find_unused_parameters, a unit the backward reaches on some ranks only (Note [Units a
// backward did not reach]): the ranks that did not reach it reduce zeros, and training
// matches a single process whose loss is the ranks' losses averaged, under ShardGradOp (no
// gather in backward) and under FullShard where the gathers stay in step (the unit reached
// on rank 0 only is prefetched on rank 1 too). Where they do not (each rank's loss reaches
// one branch only: rank 0 gathers two units, rank 1 one), every rank throws
// InvalidArgument, rather than step on gradients made from another unit's parameters.
TEST(UnusedParameters, AUnitSomeRanksBackwardsDidNotReach) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const int n = world.world_size(), rank = world.rank();
  constexpr int kRows = 4;
  constexpr double lr = 0.1;
  for (Strategy strategy : {Strategy::ShardGradOp, Strategy::FullShard}) {
    SCOPED_TRACE(to_string(strategy));
    torch::manual_seed(13);
    Branches reference;
    torch::manual_seed(13);
    Branches model;
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(lr));
    auto options = options_for(strategy, n);
    options.find_unused_parameters = true;
    flatshard::FullyShard<Branches> fsdp(model, world, options);
    optim::SGD opt(fsdp, optim::SGDOptions{lr});
    // Only rank 0's loss reaches the left branch. Under FullShard rank 1's backward still
    // gathers it (the right branch's backward prefetches it), so the gathers stay in step.
    model->use_left = rank == 0;
    for (int step = 0; step < 2; ++step) {
      auto g = at::make_generator<at::CPUGeneratorImpl>(900 + step);
      const auto x = at::randn({kRows * n, 6}, g), target = at::randn({kRows * n, 3}, g);
      ref_opt.zero_grad();
      for (int r = 0; r < n; ++r) {
        reference->use_left = r == 0;
        (mse_of(reference->forward(x.narrow(0, kRows * r, kRows)), target.narrow(0, kRows * r, kRows)) / n)
            .backward();
      }
      ref_opt.step();
      mse_of(fsdp.forward(x.narrow(0, kRows * rank, kRows)), target.narrow(0, kRows * rank, kRows))
          .backward();
      opt.step();
      opt.zero_grad();
    }
    expect_weights_match(flatshard::checkpoint::full_state_dict(fsdp, *model, -1), *reference);
  }
  {
    SCOPED_TRACE("FullShard");
    torch::manual_seed(13);
    Branches model;
    auto options = options_for(Strategy::FullShard, n);
    options.find_unused_parameters = true;
    options.comm.timeout = std::chrono::seconds(10);
    flatshard::FullyShard<Branches> fsdp(model, world, options);
    model->use_left = rank != 0;
    model->use_right = rank == 0;
    const auto x = at::randn({kRows, 6}), target = at::randn({kRows, 3});
    try {
      mse_of(fsdp.forward(x), target).backward();
      ADD_FAILURE() << "the backward went on";
    } catch (const flatshard::InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("the ranks' backwards gathered different units"), std::string::npos) << what;
      EXPECT_NE(what.find("restart"), std::string::npos) << what;
    }
  }
}

// A parameter of the root used outside the wrapped forward (a learnable temperature on the
// logits): autograd gives it its gradient before the root's backward begins, and every
// strategy adds that gradient in as single-process training does.
TEST(UnusedParameters, AParameterUsedOutsideTheForwardIsTrained) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(240));
  auto world = flatshard::init();
  const int n = world.world_size(), rows = 8, steps = 3;
  const auto make = [] {
    auto model = gpt_factory()();
    model->register_parameter("temperature", torch::full({1}, 1.5f));
    return model;
  };
  const auto loss_of = [](GPT& model, const at::Tensor& logits, const at::Tensor& target) {
    return token_loss(logits * model->named_parameters()["temperature"], target);
  };
  auto ref = make();
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.5));
  for (int s = 0; s < steps; ++s) {
    const auto b = gpt_batch(s, rows);
    ref_opt.zero_grad();
    loss_of(ref, ref->forward(b.input), b.target).backward();
    ref_opt.step();
  }
  const double ref_temperature = ref->named_parameters()["temperature"].item<double>();
  ASSERT_GT(std::abs(ref_temperature - 1.5), 1e-4) << "the reference's temperature moved";
  for (Strategy strategy : every_strategy(n)) {
    SCOPED_TRACE(to_string(strategy));
    auto model = make();
    flatshard::FullyShard<GPT> fsdp(model, world, options_for(strategy, n));
    optim::SGD opt(fsdp, optim::SGDOptions{0.5});
    for (int s = 0; s < steps; ++s) {
      const auto b = gpt_batch(s, rows);
      const int local = rows / n;
      const auto logits = fsdp.forward(b.input.narrow(0, world.rank() * local, local));
      loss_of(model, logits, b.target.narrow(0, world.rank() * local, local)).backward();
      opt.step();
      opt.zero_grad();
    }
    const auto got = flatshard::checkpoint::full_state_dict(fsdp, *model, -1);
    EXPECT_NEAR(got.at("temperature").item<double>(), ref_temperature, 1e-5);
    expect_weights_match(got, *ref);
  }
}

// While `armed`, the first block's weight throws when its gradient arrives: a backward
// that fails midway, after the later units' reductions were issued.
void arm_tripwire(torch::nn::Module& model, const bool& armed) {
  model.named_parameters()["h0.fc.weight"].register_hook([&armed](const at::Tensor& grad) {
    if (armed) throw std::runtime_error("tripwire");
    return grad;
  });
}

// Runs `f`, which must fail by the tripwire's throw, not for another reason.
template <typename F>
void expect_tripwire(F&& f) {
  try {
    f();
    ADD_FAILURE() << "the backward did not fail";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("tripwire"), std::string::npos) << "failed otherwise: " << e.what();
  }
}

// Note [A backward that failed]: a backward that throws midway (here a hook on the first
// block's weight, after the later units' reductions were issued) is abandoned by the next
// forward, which finds the backward still active: its gradients are dropped, its units
// resharded, and training goes on from the same weights as if the failed batch had never
// run, in every strategy, offloaded or not. The second failure comes after the replicated strategies laid
// their buckets out again, with buckets in flight; the third inside no_sync, after an
// accumulating backward (whose gradients go with it).
TEST(FailedBackward, TrainingGoesOnFromTheSameWeights) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(240));
  auto world = flatshard::init();
  const int n = world.world_size(), rows = 8, steps = 4;
  GPT ref = trained_in_one_process(steps, rows);
  for (const auto& [strategy, offload] : strategies_and_offload(n)) {
    SCOPED_TRACE(::testing::Message() << to_string(strategy) << (offload ? " offloaded" : ""));
    auto model = gpt_factory()();
    bool armed = false;
    arm_tripwire(*model, armed);
    auto options = options_for(strategy, n);
    options.cpu_offload = offload;
    flatshard::FullyShard<GPT> fsdp(model, world, options);
    optim::AdamW opt(fsdp, optim::AdamWOptions{1e-2});
    const int local = rows / n;
    const auto mine = [&](const at::Tensor& t) { return t.narrow(0, world.rank() * local, local); };
    const auto fail_once = [&](int seed) {
      const auto b = gpt_batch(100 + seed, rows);
      armed = true;
      auto loss = token_loss(fsdp.forward(mine(b.input)), mine(b.target));
      expect_tripwire([&] { loss.backward(); });
      armed = false;
    };
    for (int s = 0; s < steps; ++s) {
      if (s == 0 || s == 2) fail_once(s);
      if (s == 3) {
        flatshard::FullyShardBase::NoSync guard(fsdp);
        const auto b = gpt_batch(200, rows);
        token_loss(fsdp.forward(mine(b.input)), mine(b.target)).backward();
        fail_once(s);
      }
      const auto b = gpt_batch(s, rows);
      token_loss(fsdp.forward(mine(b.input)), mine(b.target)).backward();
      opt.step();
      opt.zero_grad();
    }
    const auto got = flatshard::checkpoint::full_state_dict(fsdp, *model, -1);
    expect_weights_match(got, *ref);
  }
}

// Two forwards, then the first one's backward fails. Until the failed backward is
// abandoned its gradients are partial: step() and clip_grad_norm refuse them. The second
// forward's graph, kept from before the failure, then runs its backward without a forward
// between: it abandons the failed one first, and the step that follows is the step of its
// batch alone, as in a single process.
TEST(FailedBackward, AKeptGraphsBackwardAbandonsItAndStepsRefusePartialGradients) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(240));
  auto world = flatshard::init();
  const int n = world.world_size(), rows = 8;
  auto ref = gpt_factory()();
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  const auto failed = gpt_batch(0, rows), kept = gpt_batch(1, rows);
  token_loss(ref->forward(kept.input), kept.target).backward();
  ref_opt.step();
  for (Strategy strategy : {Strategy::FullShard, Strategy::NoShard}) {
    SCOPED_TRACE(to_string(strategy));
    auto model = gpt_factory()();
    bool armed = false;
    arm_tripwire(*model, armed);
    flatshard::FullyShard<GPT> fsdp(model, world, options_for(strategy, n));
    optim::AdamW opt(fsdp, optim::AdamWOptions{1e-2});
    const int local = rows / n;
    const auto mine = [&](const at::Tensor& t) { return t.narrow(0, world.rank() * local, local); };
    auto first = token_loss(fsdp.forward(mine(failed.input)), mine(failed.target));
    auto second = token_loss(fsdp.forward(mine(kept.input)), mine(kept.target));
    armed = true;
    expect_tripwire([&] { first.backward(); });
    armed = false;
    EXPECT_TRUE(fsdp.backward_failed());
    EXPECT_THROW(opt.step(), flatshard::InvalidArgument);
    EXPECT_THROW(fsdp.clip_grad_norm(1.0), flatshard::InvalidArgument);
    second.backward();
    EXPECT_FALSE(fsdp.backward_failed());
    opt.step();
    const auto got = flatshard::checkpoint::full_state_dict(fsdp, *model, -1);
    expect_weights_match(got, *ref);
  }
}

// Note [zero_grad after no_sync]: gradients accumulated under no_sync and then dropped by
// zero_grad (the optimizer's, and the wrapper's) do not reach the next step, in every
// strategy, offloaded or not: training matches a single process that never saw those
// batches. On an engine that kept them, the first step took the dropped batch's gradient too.
TEST(NoSync, ZeroGradDropsWhatNoSyncAccumulated) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(240));
  auto world = flatshard::init();
  const int n = world.world_size(), rows = 8, steps = 3;
  GPT ref = trained_in_one_process(steps, rows);
  for (const auto& [strategy, offload] : strategies_and_offload(n)) {
    SCOPED_TRACE(::testing::Message() << to_string(strategy) << (offload ? " offloaded" : ""));
    auto model = gpt_factory()();
    auto options = options_for(strategy, n);
    options.cpu_offload = offload;
    flatshard::FullyShard<GPT> fsdp(model, world, options);
    optim::AdamW opt(fsdp, optim::AdamWOptions{1e-2});
    const int local = rows / n;
    const auto mine = [&](const at::Tensor& t) { return t.narrow(0, world.rank() * local, local); };
    for (int s = 0; s < steps; ++s) {
      {
        flatshard::FullyShardBase::NoSync guard(fsdp);
        const auto dropped = gpt_batch(300 + s, rows);
        token_loss(fsdp.forward(mine(dropped.input)), mine(dropped.target)).backward();
      }
      if (s == 1) {
        fsdp.zero_grad();
      } else {
        opt.zero_grad();
      }
      const auto b = gpt_batch(s, rows);
      token_loss(fsdp.forward(mine(b.input)), mine(b.target)).backward();
      opt.step();
    }
    const auto got = flatshard::checkpoint::full_state_dict(fsdp, *model, -1);
    expect_weights_match(got, *ref);
  }
}

// Steps 3 to 5 continue bit for bit after saving at step 3 and loading into a new
// wrapper, optimizer (with groups), scheduler and scaler state.
TEST(Schedules, ResumedRunContinuesTheScheduleBitForBit) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(240));
  auto world = flatshard::init();
  const fs::path dir = fs::temp_directory_path() / fmt::format("flatshard_sched_{}", getppid());
  for (Strategy strategy : {Strategy::FullShard, Strategy::NoShard, Strategy::ShardOptimizerState}) {
    SCOPED_TRACE(to_string(strategy));
    flatshard::FullyShardOptions o;
    o.strategy = strategy;
    o.comm.timeout = std::chrono::seconds(60);
    struct Run {
      GPT model{nullptr};
      std::unique_ptr<flatshard::FullyShard<GPT>> fsdp;
      std::unique_ptr<optim::AdamW> opt;
      std::unique_ptr<optim::LRScheduler> sched;
      std::unique_ptr<optim::GradScaler> scaler;  // fp32: scales by powers of two, exactly
      std::vector<double> lrs;
    };
    auto start = [&] {
      Run r;
      r.model = gpt_factory()();
      r.fsdp = std::make_unique<flatshard::FullyShard<GPT>>(r.model, world, o);
      r.opt = std::make_unique<optim::AdamW>(
          *r.fsdp, optim::AdamWOptions{3e-3, 0.9, 0.95, 1e-8, 0.1},
          std::vector<optim::ParamGroup<optim::AdamWOptions>>{
              {"no_decay", optim::biases_norms_embeddings(), {3e-3, 0.9, 0.95, 1e-8, 0.0}}});
      r.sched = std::make_unique<optim::LRScheduler>(*r.opt, optim::warmup_then(2, optim::cosine(4, 0.1)));
      r.scaler = std::make_unique<optim::GradScaler>(*r.fsdp, optim::GradScalerOptions{256.0, 2.0, 0.5, 2});
      return r;
    };
    auto train = [&](Run& r, int first, int last) {
      for (int s = first; s < last; ++s) {
        const auto b = gpt_batch(s, 8);
        const int n = world.world_size(), rows = 8 / n;
        auto loss = token_loss(r.fsdp->forward(b.input.narrow(0, world.rank() * rows, rows)),
                               b.target.narrow(0, world.rank() * rows, rows));
        r.scaler->scale(loss).backward();
        r.scaler->unscale(*r.opt);
        r.fsdp->clip_grad_norm(1.0);
        r.scaler->step(*r.opt);
        r.scaler->update();
        r.sched->step();
        r.opt->zero_grad();
        r.lrs.push_back(r.opt->lr(0));
      }
    };
    auto weights = [&](Run& r) {
      auto full = flatshard::checkpoint::full_state_dict(*r.fsdp, *r.model, -1);
      return full;
    };
    Run whole = start();
    train(whole, 0, 6);
    Run first = start();
    train(first, 0, 3);
    flatshard::checkpoint::SaveOptions so;
    so.step = 3;
    so.scheduler = first.sched.get();
    so.scaler = first.scaler.get();
    flatshard::checkpoint::save_sharded(dir.string(), *first.fsdp, first.opt.get(), so);
    Run second = start();
    flatshard::checkpoint::LoadOptions lo;
    lo.scheduler = second.sched.get();
    lo.scaler = second.scaler.get();
    flatshard::checkpoint::load_sharded(dir.string(), *second.fsdp, second.opt.get(), lo);
    EXPECT_EQ(second.sched->steps(), 3);
    EXPECT_EQ(second.scaler->scale(), 512.0) << "grown once after two clean steps";
    EXPECT_EQ(second.scaler->growth_tracker(), 1);
    EXPECT_EQ(second.opt->lr(0), first.opt->lr(0));
    {
      // Note [A schedule's base rate]: a scheduler made after a load (not restored from it)
      // scales the saved initial rate, not the rate the saved schedule had reached.
      optim::AdamW bare(*second.fsdp, optim::AdamWOptions{3e-3, 0.9, 0.95, 1e-8, 0.1},
                        std::vector<optim::ParamGroup<optim::AdamWOptions>>{
                            {"no_decay", optim::biases_norms_embeddings(), {3e-3, 0.9, 0.95, 1e-8, 0.0}}});
      flatshard::checkpoint::load_sharded(dir.string(), *second.fsdp, &bare);
      EXPECT_NE(bare.lr(0), 3e-3);
      optim::LRScheduler late(bare, optim::constant());
      EXPECT_DOUBLE_EQ(late.base_lrs()[0], 3e-3);
      EXPECT_DOUBLE_EQ(late.base_lrs()[1], 3e-3);
    }
    train(second, 3, 6);
    for (int k = 0; k < 3; ++k) EXPECT_EQ(second.lrs[k], whole.lrs[3 + k]) << "step " << 3 + k;
    EXPECT_EQ(whole.opt->lr(1), whole.opt->lr(0)) << "both groups follow the schedule";
    const auto want = weights(whole), got = weights(second);
    for (const auto& [name, t] : want) EXPECT_TRUE(at::equal(t, got.at(name))) << name;
    EXPECT_EQ(second.scaler->scale(), whole.scaler->scale());
    // The consolidated state names each group's hyperparameters and each parameter's step.
    const auto state = flatshard::checkpoint::full_optimizer_state_dict(
        *second.fsdp, *second.opt, -1, second.sched.get(), second.scaler.get());
    EXPECT_EQ(state.at("scheduler.steps").item<std::int64_t>(), 6);
    EXPECT_DOUBLE_EQ(state.at("scheduler.base_lr.no_decay").item<double>(), 3e-3);
    EXPECT_DOUBLE_EQ(state.at("scaler.scale").item<double>(), second.scaler->scale());
    EXPECT_DOUBLE_EQ(state.at("param_groups.no_decay.weight_decay").item<double>(), 0.0);
    EXPECT_DOUBLE_EQ(state.at("param_groups.default.lr").item<double>(), second.opt->lr(0));
    EXPECT_EQ(state.at("head.weight.step").item<std::int64_t>(), 6);
    // A checkpoint without a scheduler's state does not load into one.
    if (world.rank() == 0) fs::remove_all(dir);
    second.fsdp->comm().barrier().wait();
    flatshard::checkpoint::SaveOptions plain;
    plain.step = 7;
    flatshard::checkpoint::save_sharded(dir.string(), *second.fsdp, second.opt.get(), plain);
    EXPECT_THROW(flatshard::checkpoint::load_sharded(dir.string(), *second.fsdp, second.opt.get(), lo),
                 flatshard::checkpoint::CheckpointError);
    // Nor into an optimizer with other groups.
    optim::AdamW ungrouped(*second.fsdp, optim::AdamWOptions{});
    EXPECT_THROW(flatshard::checkpoint::load_sharded(dir.string(), *second.fsdp, &ungrouped),
                 flatshard::checkpoint::CheckpointError);
    // Nor AdamW's state into Adam, whose weight decay is an L2 term (the same state names).
    optim::Adam adam(*second.fsdp, optim::AdamOptions{3e-3, 0.9, 0.95, 1e-8, 0.1},
                     std::vector<optim::ParamGroup<optim::AdamOptions>>{
                         {"no_decay", optim::biases_norms_embeddings(), {3e-3, 0.9, 0.95, 1e-8, 0.0}}});
    try {
      flatshard::checkpoint::load_sharded(dir.string(), *second.fsdp, &adam);
      ADD_FAILURE() << "AdamW's state loaded into Adam";
    } catch (const flatshard::checkpoint::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("holds the state of AdamW; this optimizer is Adam"),
                std::string::npos)
          << e.what();
    }
    // Refused before anything was read: the Adam holds no state.
    for (std::size_t i = 0; i < adam.shards().size(); ++i)
      for (const auto& [name, t] : adam.named_state(i)) EXPECT_FALSE(t.defined()) << name << " was loaded";
    second.fsdp->comm().barrier().wait();
    if (world.rank() == 0) fs::remove_all(dir);
    second.fsdp->comm().barrier().wait();
  }
}

// Bad input: a group that chooses nothing, a parameter in two groups, a non-positive
// schedule length, one schedule per group of the wrong count.
TEST(ParamGroups, BadGroupsAndSchedulesAreRefused) {
  FLATSHARD_RUN_RANKS({1}, std::chrono::seconds(60));
  auto world = flatshard::init();
  auto model = gpt_factory()();
  flatshard::FullyShard<GPT> fsdp(model, world, {});
  auto expect_error = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one naming " << part;
    } catch (const flatshard::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_error(
      [&] {
        optim::SGD opt(fsdp, {}, {{"typo", optim::names_containing({"no_such_layer"}), {}}});
      },
      "'typo' chooses no parameter");
  expect_error(
      [&] {
        optim::SGD opt(fsdp, {},
                       {{"norms", optim::dims_below(2), {}}, {"ln", optim::names_containing({"ln_"}), {}}});
      },
      "groups 'norms' and 'ln'");
  expect_error([] { optim::cosine(0); }, "at least one step");
  expect_error([] { optim::linear_warmup(-3); }, "at least one step");
  expect_error([] { optim::then(optim::step_decay(10, 0.5), optim::constant()); }, "never ends");
  optim::SGD opt(fsdp, {0.1}, {{"norms", optim::dims_below(2), {0.2}}});
  EXPECT_EQ(opt.num_groups(), 2u);
  EXPECT_EQ(opt.group_of("ln_f.weight"), 1u);
  EXPECT_EQ(opt.group_of("head.weight"), 0u);
  expect_error([&] { optim::LRScheduler s(opt, std::vector<optim::Schedule>{optim::constant()}); },
               "1 schedules");
  optim::LRScheduler s(opt, optim::linear_decay(4, 0.5));
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.1);
  EXPECT_DOUBLE_EQ(opt.lr(1), 0.2);
  s.step();
  s.step();
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.1 * 0.75);
  EXPECT_DOUBLE_EQ(opt.lr(1), 0.2 * 0.75);
  // Note [A schedule's base rate]: a second scheduler scales the groups' initial rates, not
  // the rates the first one left (PyTorch's initial_lr).
  optim::LRScheduler second(opt, optim::constant(0.5));
  EXPECT_DOUBLE_EQ(second.base_lrs()[0], 0.1);
  EXPECT_DOUBLE_EQ(opt.lr(1), 0.2 * 0.5);
}

// fp16 compute with dynamic loss scaling against a single-process run of the same
// algorithm (fp32 master model, fp16 copy for compute, the same scale, unscaling, skip
// and growth rules), with an overflow injected on the last rank at step 2: every rank
// skips that step (the weights stay bit for bit) and halves its scale. The same when the
// wrapper drops the overflowed gradients itself (nonfinite_grads = Skip); a wrapper that
// raises on them is refused.
TEST(GradScaler, Fp16MatchesSingleProcessAndSkipsOverflowsEverywhere) {
  FLATSHARD_RUN_RANKS({1, 2}, std::chrono::seconds(240));
  auto world = flatshard::init();
  const int n = world.world_size(), steps = 6, rows = 8, overflow_step = 2;
  const optim::GradScalerOptions so{1024.0, 2.0, 0.5, 2};
  const optim::AdamWOptions ao{1e-3, 0.9, 0.999, 1e-8, 0.1};
  // Reference.
  auto ref = gpt_factory()();
  auto half = gpt_factory()();
  half->to(at::kHalf);
  torch::optim::AdamW ref_opt(ref->parameters(),
                              torch::optim::AdamWOptions(ao.lr).weight_decay(ao.weight_decay));
  double ref_scale = so.init_scale;
  int ref_clean = 0;
  std::vector<double> ref_scales, ref_norms;  // the scale after each step; its unscaled gradients' norm
  for (int s = 0; s < steps; ++s) {
    {
      torch::NoGradGuard ng;
      auto hp = half->parameters();
      auto rp = ref->parameters();
      for (std::size_t k = 0; k < hp.size(); ++k) hp[k].copy_(rp[k]);
    }
    for (auto& p : half->parameters()) p.mutable_grad().reset();
    const auto b = gpt_batch(s, rows);
    auto loss = token_loss(half->forward(b.input).to(at::kFloat), b.target);
    if (s == overflow_step) loss = loss * std::numeric_limits<float>::infinity();
    (loss * ref_scale).backward();
    bool finite = true;
    auto hp = half->parameters();
    auto rp = ref->parameters();
    double norm_sq = 0;
    for (std::size_t k = 0; k < hp.size(); ++k) {
      rp[k].mutable_grad() = hp[k].grad().to(at::kFloat) * (1.0 / ref_scale);
      finite = finite && at::isfinite(rp[k].grad()).all().item<bool>();
      norm_sq += rp[k].grad().to(at::kDouble).pow(2).sum().item<double>();
    }
    ref_norms.push_back(std::sqrt(norm_sq));
    if (finite) ref_opt.step();
    if (!finite) {
      ref_scale *= so.backoff_factor;
      ref_clean = 0;
    } else if (++ref_clean >= so.growth_interval) {
      ref_scale *= so.growth_factor;
      ref_clean = 0;
    }
    ref_scales.push_back(ref_scale);
  }
  // Distributed, in fp16 with fp32 reduction and masters.
  std::vector<std::pair<Strategy, flatshard::NonFiniteGrads>> runs;
  for (Strategy strategy : every_strategy(n)) runs.emplace_back(strategy, flatshard::NonFiniteGrads::Ignore);
  for (Strategy strategy : {Strategy::FullShard, Strategy::NoShard})
    runs.emplace_back(strategy, flatshard::NonFiniteGrads::Skip);
  for (const auto& [strategy, nonfinite] : runs) {
    const bool wrapper_skips = nonfinite == flatshard::NonFiniteGrads::Skip;
    SCOPED_TRACE(std::string(to_string(strategy)) + (wrapper_skips ? ", the wrapper skipping" : ""));
    auto model = gpt_factory()();
    flatshard::FullyShardOptions o = options_for(strategy, n);
    o.mixed_precision.param = at::kHalf;
    o.mixed_precision.reduce = at::kFloat;
    o.nonfinite_grads = nonfinite;
    flatshard::FullyShard<GPT> fsdp(model, world, o);
    optim::AdamW opt(fsdp, ao);
    optim::GradScaler scaler(fsdp, so);
    std::map<std::string, at::Tensor> before;
    for (int s = 0; s < steps; ++s) {
      const auto b = gpt_batch(s, rows);
      const int local = rows / n;
      auto loss = token_loss(fsdp.forward(b.input.narrow(0, world.rank() * local, local)).to(at::kFloat),
                             b.target.narrow(0, world.rank() * local, local));
      if (s == overflow_step && world.rank() == n - 1) loss = loss * std::numeric_limits<float>::infinity();
      scaler.scale(loss).backward();
      if (s == overflow_step) before = flatshard::checkpoint::full_state_dict(fsdp, *model, -1);
      // The unscaled gradients' norm is the reference's (a bound no norm reaches: nothing is
      // clipped): unscaled by an explicit unscale() on even steps, by step() itself on odd
      // ones. A scale left in, or divided out twice, is off by a factor of 1024 or more;
      // fp16 rounding apart moves it by about 1e-3.
      const auto expect_unscaled = [&] {
        if (s == overflow_step) return;
        const double norm = fsdp.clip_grad_norm(1e30);
        EXPECT_NEAR(norm, ref_norms[s], 1e-2 * ref_norms[s]) << "step " << s;
      };
      if (s % 2 == 0) {
        scaler.unscale(opt);
        // A second unscale() would divide by the scale twice: refused, as torch.amp does.
        EXPECT_THROW(scaler.unscale(opt), flatshard::InvalidArgument);
        expect_unscaled();
      }
      const bool stepped = scaler.step(opt);
      if (s % 2 == 1) expect_unscaled();
      if (s == 1) EXPECT_THROW(scaler.unscale(opt), flatshard::InvalidArgument) << "unscale() after step()";
      EXPECT_EQ(stepped, s != overflow_step) << "step " << s;
      // A second step before update() would step gradients it never unscaled (or, after a
      // skipped step, scaled ones).
      if (s == 0 || s == overflow_step) EXPECT_THROW(scaler.step(opt), flatshard::InvalidArgument);
      scaler.update();
      opt.zero_grad();
      EXPECT_EQ(scaler.scale(), ref_scales[s]) << "step " << s;
      if (s == overflow_step) {
        const auto after = flatshard::checkpoint::full_state_dict(fsdp, *model, -1);
        for (const auto& [name, t] : before) EXPECT_TRUE(at::equal(t, after.at(name))) << name;
      }
    }
    EXPECT_EQ(scaler.skipped_steps(), 1);
    EXPECT_EQ(fsdp.skipped_steps(), wrapper_skips ? 1 : 0);
    // An update() with no step through the scaler since the last (the optimizer stepped on
    // its own, on scaled gradients) is refused, as torch.amp refuses it.
    EXPECT_THROW(scaler.update(), flatshard::InvalidArgument);
    if (strategy == Strategy::FullShard &&
        !wrapper_skips) {  // stepping in backward would step scaled gradients
      fsdp.step_in_backward(&opt);
      EXPECT_THROW(scaler.unscale(opt), flatshard::InvalidArgument);
      fsdp.step_in_backward(nullptr);
    }
    auto full = fsdp.summon_full_params();
    auto ref_params = ref->named_parameters();
    double delta = 0, norm = 0;
    for (const auto& item : model->named_parameters()) {
      const auto want = ref_params[item.key()];
      delta += (item.value().to(at::kFloat) - want).pow(2).sum().item<double>();
      norm += want.pow(2).sum().item<double>();
    }
    // fp16 keeps 11 significant bits: as Note [bf16 tolerance] with 8x finer rounding.
    EXPECT_LE(std::sqrt(delta / norm), 2e-3);
  }
  auto model = gpt_factory()();
  flatshard::FullyShardOptions raising = options_for(Strategy::FullShard, n);
  raising.mixed_precision.param = at::kHalf;
  raising.nonfinite_grads = flatshard::NonFiniteGrads::Raise;
  flatshard::FullyShard<GPT> fsdp(model, world, raising);
  EXPECT_THROW({ optim::GradScaler raised(fsdp, so); }, flatshard::InvalidArgument);
}

}  // namespace
