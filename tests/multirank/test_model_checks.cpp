// What a wrapper does with models a user might hand it: ranks whose values differ (Note
// [Same values on every rank]), a zero-size parameter, a unit without parameters, and a
// model wrapped a second time.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>

#include "tests/support/cases.h"
#include "tests/support/multirank.h"

namespace {

using namespace flatshard::testing;
using flatshard::Strategy;
using flatshard::SyncModuleStates;

GPT gpt_seeded(int seed) {
  torch::manual_seed(seed);
  GPTConfig c = gpt_config();
  c.position_scale_buffer = true;
  return GPT(c);
}

// The message of the InvalidArgument that wrapping `model` throws, or "" when it does not.
std::string wrap_error(const flatshard::World& world, GPT model, flatshard::FullyShardOptions options) {
  try {
    flatshard::FullyShard<GPT> fsdp(model, world, options);
  } catch (const flatshard::InvalidArgument& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Ranks 0 and 2 build with one seed, rank 1 with another: every sharded strategy refuses,
// on every rank, naming the first unit that differs and who holds which version; a
// difference in one unit alone, or in a buffer alone, is named as such. The replicated
// strategies start every rank from rank 0's values instead, as DDP does.
TEST(SameValues, RanksBuiltDifferentlyAreRefusedNamingUnitAndRanks) {
  FLATSHARD_RUN_RANKS({3}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const int rank = world.rank();
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp, Strategy::HybridShard}) {
    SCOPED_TRACE(to_string(strategy));
    const auto options = options_for(strategy, world.world_size());
    const std::string seeds = wrap_error(world, gpt_seeded(rank == 1 ? 99 : 11), options);
    EXPECT_TRUE(contains(seeds, "the root unit")) << seeds;
    EXPECT_TRUE(contains(seeds, "ranks 0, 2 / rank 1")) << seeds;
    EXPECT_TRUE(contains(seeds, fmt::format("(rank {}/3)", rank))) << seeds;
    EXPECT_TRUE(contains(seeds, "SyncModuleStates::FromRank0")) << seeds;

    GPT one_unit = gpt_seeded(11);
    if (rank == 2) {
      at::NoGradGuard no_grad;
      one_unit->blocks[1]->fc->weight.view(-1)[7] += 1e-6;  // one element, far below any tolerance
    }
    const std::string unit = wrap_error(world, one_unit, options);
    EXPECT_TRUE(contains(unit, "unit 'h1'")) << unit;
    EXPECT_TRUE(contains(unit, "ranks 0, 1 / rank 2")) << unit;

    GPT one_buffer = gpt_seeded(11);
    if (rank == 0) one_buffer->position_scale[0] = 3.0;
    const std::string buffer = wrap_error(world, one_buffer, options);
    EXPECT_TRUE(contains(buffer, "the model's buffers")) << buffer;
    EXPECT_TRUE(contains(buffer, "rank 0 / ranks 1, 2")) << buffer;

    EXPECT_EQ(wrap_error(world, gpt_seeded(11), options), "") << "the same values everywhere are accepted";
  }
  const GPT rank0 = gpt_seeded(11);
  for (Strategy strategy : {Strategy::NoShard, Strategy::ShardOptimizerState}) {
    SCOPED_TRACE(to_string(strategy));
    GPT model = gpt_seeded(rank == 1 ? 99 : 11);
    flatshard::FullyShard<GPT> ddp(model, world, options_for(strategy));
    auto full = ddp.summon_full_params();
    EXPECT_TRUE(at::equal(model->head->weight, rank0->head->weight)) << "rank 0's values, as DDP";
    EXPECT_TRUE(at::equal(model->position_scale, rank0->position_scale)) << "rank 0's buffers, as DDP";
  }
}

// SyncModuleStates::FromRank0: every rank ends up with rank 0's values, parameters and
// buffers, whatever it built; Trust accepts the differing models as they are.
TEST(SameValues, FromRank0CopiesRankZerosValuesEverywhere) {
  FLATSHARD_RUN_RANKS({3}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const int rank = world.rank();
  GPT expected = gpt_seeded(11);
  std::map<std::string, at::Tensor> want;
  for (const auto& item : expected->named_parameters()) want[item.key()] = item.value().detach().clone();
  for (const auto& item : expected->named_buffers()) want[item.key()] = item.value().detach().clone();
  for (Strategy strategy : every_strategy(world.world_size())) {
    SCOPED_TRACE(to_string(strategy));
    auto options = options_for(strategy, world.world_size());
    options.sync_module_states = SyncModuleStates::FromRank0;
    GPT model = gpt_seeded(11 + 7 * rank);
    flatshard::FullyShard<GPT> fsdp(model, world, options);
    const auto state = flatshard::checkpoint::full_state_dict(fsdp, *model, -1);
    ASSERT_EQ(state.size(), want.size());
    for (const auto& [name, t] : want) EXPECT_TRUE(at::equal(state.at(name), t)) << name;
    const auto b = gpt_batch(0, 6);
    token_loss(fsdp.forward(b.input.narrow(0, 2 * rank, 2)), b.target.narrow(0, 2 * rank, 2)).backward();
  }
  auto options = options_for(Strategy::FullShard);
  options.sync_module_states = SyncModuleStates::Trust;
  EXPECT_EQ(wrap_error(world, gpt_seeded(11 + 7 * rank), options), "") << "Trust compares nothing";
}

// A unit without parameters (a scaled tanh) and a unit holding a zero-size parameter
// beside a real layer: both train as single-process LibTorch trains them, in every
// strategy (the first is no group at all; the second's empty parameter takes no slot).
struct ScaledTanhImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) { return 1.5 * torch::tanh(x); }
};
TORCH_MODULE(ScaledTanh);

struct WithEmptyImpl : torch::nn::Module {
  WithEmptyImpl() {
    lin = register_module("lin", torch::nn::Linear(16, 16));
    empty = register_parameter("empty", torch::zeros({0}));
  }
  at::Tensor forward(const at::Tensor& x) { return lin(x) + empty.sum(); }
  torch::nn::Linear lin{nullptr};
  at::Tensor empty;
};
TORCH_MODULE(WithEmpty);

struct OddUnitsNetImpl : torch::nn::Module {
  OddUnitsNetImpl() {
    first = register_module("first", torch::nn::Linear(6, 16));
    act = register_module("act", flatshard::Unit<ScaledTanh>());
    odd = register_module("odd", flatshard::Unit<WithEmpty>());
    head = register_module("head", torch::nn::Linear(16, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return head(odd(act(first(x)))); }
  torch::nn::Linear first{nullptr}, head{nullptr};
  flatshard::Unit<ScaledTanh> act{nullptr};
  flatshard::Unit<WithEmpty> odd{nullptr};
};
TORCH_MODULE(OddUnitsNet);

TEST(OddModels, AZeroSizeParameterAndAUnitWithoutParametersTrain) {
  FLATSHARD_RUN_RANKS({1, 2, 3}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const auto make = [] {
    torch::manual_seed(21);
    return OddUnitsNet();
  };
  const auto batch = [](int step) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(500 + step);
    return Batch{at::randn({12, 6}, g), at::randn({12, 3}, g)};
  };
  for (Strategy strategy : every_strategy(world.world_size())) {
    for (OptKind opt : {OptKind::PlainSGD, OptKind::AdamW}) {
      SCOPED_TRACE(::testing::Message() << to_string(strategy) << " " << to_string(opt));
      TrainSpec spec;
      spec.strategy = strategy;
      spec.shard_group_size = hybrid_group_size(world.world_size());
      spec.optimizer = opt;
      spec.steps = 4;
      const auto r = train_and_compare<OddUnitsNet>(world, make, batch, mse, spec);
      EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << r.worst_param;
      ASSERT_EQ(r.weights.count("odd.empty"), 1u);
      EXPECT_EQ(r.weights.at("odd.empty").numel(), 0);
    }
  }
}

// Note [One wrapper per model]: a second wrapper on a model is refused by name while the
// first lives and after it is gone; a model built again takes a wrapper as any other.
TEST(OddModels, AModelWrappedTwiceIsRefused) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(60));
  auto world = flatshard::init();
  for (Strategy strategy : every_strategy(world.world_size())) {
    SCOPED_TRACE(to_string(strategy));
    const auto options = options_for(strategy, world.world_size());
    GPT model = gpt_factory()();
    auto first = std::make_unique<flatshard::FullyShard<GPT>>(model, world, options);
    const std::string alive = wrap_error(world, model, options);
    EXPECT_TRUE(contains(alive, "already wrapped by a FullyShard that is still alive")) << alive;
    first.reset();
    const std::string gone = wrap_error(world, model, options);
    EXPECT_TRUE(contains(gone, "has since been destroyed")) << gone;
    EXPECT_EQ(wrap_error(world, gpt_factory()(), options), "");
  }
}

// A projection by a weight it is given: two of them share one.
struct ProjectionImpl : torch::nn::Module {
  explicit ProjectionImpl(const at::Tensor& w) { weight = register_parameter("weight", w); }
  at::Tensor forward(const at::Tensor& x) { return x.matmul(weight.t()); }
  at::Tensor weight;
};
TORCH_MODULE(Projection);

// Two projections sharing one weight: in two units, one in a unit and the other in the
// root, or both in the root.
struct TiedImpl : torch::nn::Module {
  TiedImpl(bool first_unit, bool second_unit) {
    const auto w = torch::randn({8, 8});
    if (first_unit) {
      first_unit_ = register_module("first", flatshard::Unit<Projection>(w));
    } else {
      first = register_module("first", Projection(w));
    }
    if (second_unit) {
      second_unit_ = register_module("second", flatshard::Unit<Projection>(w));
    } else {
      second = register_module("second", Projection(w));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto h = first_unit_ ? first_unit_(x) : first(x);
    return second_unit_ ? second_unit_(h) : second(h);
  }
  Projection first{nullptr}, second{nullptr};
  flatshard::Unit<Projection> first_unit_{nullptr}, second_unit_{nullptr};
};
TORCH_MODULE(Tied);

// A tied weight must sit in one unit under the sharded strategies (each unit gathers only
// its own parameters): across two units, or a unit and the root, wrapping names both
// names; in one unit (here the root), and under the replicated strategies, it wraps.
TEST(OddModels, TiedWeightsInTwoUnitsAreRefused) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(60));
  auto world = flatshard::init();
  const auto wrap = [&](Strategy strategy, bool first_unit, bool second_unit) -> std::string {
    torch::manual_seed(3);  // the same values on every rank
    try {
      flatshard::FullyShard<Tied> fsdp(Tied(first_unit, second_unit), world, options_for(strategy, 2));
    } catch (const flatshard::InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp}) {
    SCOPED_TRACE(to_string(strategy));
    const std::string two = wrap(strategy, true, true), with_root = wrap(strategy, true, false);
    EXPECT_TRUE(
        contains(two, "'first.weight' and 'second.weight' are one tensor (tied weights) in two units"))
        << two;
    EXPECT_TRUE(contains(with_root, "(unit 1 and the root unit)")) << with_root;
    EXPECT_EQ(wrap(strategy, false, false), "");
  }
  EXPECT_EQ(wrap(Strategy::NoShard, true, true), "");
}

// The accepted layouts train a tied weight as one tensor: its gradient is the sum of both
// uses' (averaged over the ranks), it is stepped once, and both names read the same values.
// Plain SGD against a single process whose optimizer holds the tensor once: a weight laid
// out twice (stepped twice, or with one use's gradient) moves by another amount.
TEST(OddModels, TiedWeightsTrainAsOneTensor) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(60));
  auto world = flatshard::init();
  const int n = world.world_size(), rank = world.rank();
  constexpr double lr = 0.1;
  for (const auto& [strategy, units] :
       {std::pair{Strategy::FullShard, false}, std::pair{Strategy::ShardGradOp, false},
        std::pair{Strategy::NoShard, true}, std::pair{Strategy::ShardOptimizerState, true}}) {
    SCOPED_TRACE(to_string(strategy));
    torch::manual_seed(3);
    Tied reference(false, false);
    torch::manual_seed(3);
    Tied model(units, units);
    ASSERT_TRUE(reference->first->weight.is_same(reference->second->weight));
    torch::optim::SGD ref_opt(std::vector<at::Tensor>{reference->first->weight},
                              torch::optim::SGDOptions(lr));
    flatshard::FullyShard<Tied> fsdp(model, world, options_for(strategy, n));
    flatshard::optim::SGD opt(fsdp, flatshard::optim::SGDOptions{lr});
    const at::Tensor start = reference->first->weight.detach().clone();
    for (int step = 0; step < 3; ++step) {
      auto g = at::make_generator<at::CPUGeneratorImpl>(100 + step);
      const auto x = at::randn({4 * n, 8}, g), target = at::randn({4 * n, 8}, g);
      ref_opt.zero_grad();
      torch::mse_loss(reference->forward(x), target).backward();
      ref_opt.step();
      torch::mse_loss(fsdp.forward(x.narrow(0, 4 * rank, 4)), target.narrow(0, 4 * rank, 4)).backward();
      opt.step();
      opt.zero_grad();
    }
    const at::Tensor want = reference->first->weight.detach();
    ASSERT_GT((want - start).abs().max().item<double>(), 1e-3) << "the reference did not train";
    const auto full = flatshard::checkpoint::full_state_dict(fsdp, *model, -1);
    // A tied weight is one tensor of the state dict, under its first name (as safetensors
    // saves it), so that the dict loads back into the same model.
    EXPECT_EQ(full.size(), 1u);
    EXPECT_TRUE(full.count("first.weight"));
    for (const auto& [key, got] : full) {
      EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-6))
          << key << ": max diff " << (got - want).abs().max().item<double>();
    }
  }
}

}  // namespace
