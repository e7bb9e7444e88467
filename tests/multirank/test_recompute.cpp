// Activation recomputation: in every mode, training with every unit recomputed is bit
// for bit training without it (fp32, residual dropout on: the generators are restored
// for the second run), and a recomputed unit keeps only its inputs from forward.
#include <gtest/gtest.h>

#include "flatshard/flatshard.h"
#include "flatshard/memory.h"
#include "flatshard/unit.h"
#include "tests/support/cases.h"
#include "tests/support/models.h"
#include "tests/support/multirank.h"
#include "tests/support/training.h"

namespace {

using namespace flatshard::testing;
using flatshard::Strategy;

std::function<GPT()> gpt_with_dropout() {
  return [] {
    torch::manual_seed(11);
    auto c = gpt_config();
    c.dropout = 0.2;
    return GPT(c);
  };
}

// With dropout the reference draws other masks than the wrapped model (the same generator,
// further on), so their losses differ: dropout is on, and the bit-for-bit match below
// needed the recomputed forward to draw the first forward's masks again.
void expect_dropout_on(const std::string& what, const TrainResult& r) {
  EXPECT_GT(r.max_rel_loss_diff, 1e-3) << what << ": dropout is off";
}

// Runs `train` without and with recomputation and expects the same weights, bit for bit.
template <typename Train>
void expect_recompute_changes_nothing(const std::string& what, TrainSpec spec, const Train& train,
                                      bool dropout = true) {
  spec.recompute = false;
  const auto plain = train(spec);
  spec.recompute = true;
  const auto recomputed = train(spec);
  if (dropout) expect_dropout_on(what, recomputed);
  ASSERT_EQ(plain.weights.size(), recomputed.weights.size()) << what;
  ASSERT_FALSE(plain.weights.empty()) << what;
  for (const auto& [name, w] : plain.weights) {
    const auto& v = recomputed.weights.at(name);
    EXPECT_TRUE(at::equal(w, v)) << what << ": " << name << " differs by "
                                 << (w - v).abs().max().template item<double>();
  }
  EXPECT_EQ(plain.max_rel_loss_diff, recomputed.max_rel_loss_diff) << what;
}

TEST(Recompute, BitForBitInEveryMode) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(300));
  auto world = flatshard::init();
  const auto batch = [](int s) { return gpt_batch(s, 12); };
  TrainSpec spec;
  spec.optimizer = OptKind::AdamW;
  spec.steps = 4;
  spec.clip = 0.25;
  std::vector<Strategy> sharded{Strategy::FullShard, Strategy::ShardGradOp};
  if (world.world_size() > 1) sharded.push_back(Strategy::HybridShard);
  for (Strategy strategy : sharded) {
    spec.strategy = strategy;
    spec.shard_group_size = hybrid_group_size(world.world_size());
    expect_recompute_changes_nothing(to_string(strategy), spec, [&](const TrainSpec& s) {
      return train_and_compare<GPT>(world, gpt_with_dropout(), batch, token_loss, s);
    });
  }
  // Note [Recomputation and DDP's buckets]
  // A recomputed unit hands all its parameters' gradients over at once, at the end of its
  // second run, in another order than a unit whose backward runs op by op. The replicated
  // strategies lay their buckets out again after the first step from the order gradients
  // arrived, but keep each unit's parameters together (Note [Buckets keep units together]
  // in sharding/replicated.cpp), so the layout, and the order in which a ring of three or
  // more ranks adds each element's contributions, is the same with recomputation: bit for
  // bit at every world size.
  for (Strategy strategy : {Strategy::NoShard, Strategy::ShardOptimizerState}) {
    spec.strategy = strategy;
    expect_recompute_changes_nothing(to_string(strategy), spec, [&](const TrainSpec& s) {
      return train_and_compare<GPT>(world, gpt_with_dropout(), batch, token_loss, s);
    });
  }
  spec.strategy = Strategy::FullShard;
  // A Sequential split by SequentialUnits recomputes its groups.
  spec.clip = 0;
  spec.optimizer = OptKind::SGD;
  expect_recompute_changes_nothing(
      "mlp full shard", spec,
      [&](const TrainSpec& s) {
        return train_and_compare<flatshard::SequentialUnits>(
            world, mlp_units_factory(), [](int st) { return mlp_batch(st, 12); }, mse, s);
      },
      /*dropout=*/false);
  // Dropout is really on, and recomputation still matches single-process training
  // without it (the reference model runs without dropout's randomness only when p = 0).
  spec.optimizer = OptKind::AdamW;
  spec.recompute = true;
  const auto r = train_and_compare<GPT>(world, gpt_factory(), batch, token_loss, spec);
  EXPECT_LE(r.max_rel_weight_diff, 1e-5) << r.worst_param;
}

// bf16 compute with recomputation: the second run rounds as the first did.
TEST(Recompute, Bf16FullShard) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  TrainSpec spec;
  spec.optimizer = OptKind::AdamW;
  spec.steps = 3;
  spec.param_dtype = at::kBFloat16;
  spec.reduce_dtype = at::kFloat;
  expect_recompute_changes_nothing("bf16", spec, [&](const TrainSpec& s) {
    return train_and_compare<GPT>(
        world, gpt_with_dropout(), [](int st) { return gpt_batch(st, 12); }, token_loss, s);
  });
}

// A block whose forward takes its tensors in a vector and an optional: recomputed, the
// tensors upstream of both get the gradients they get without recomputation (an engine
// that kept such arguments out of the recomputed node left them none). Its second
// linear is used only when `skip` is absent: the unit's parameter left unused gets no
// gradient either way.
struct PairBlockImpl : torch::nn::Module {
  torch::nn::Linear mix{nullptr}, extra{nullptr};
  PairBlockImpl() {
    mix = register_module("mix", torch::nn::Linear(8, 8));
    extra = register_module("extra", torch::nn::Linear(8, 8));
  }
  at::Tensor forward(const std::vector<at::Tensor>& xs, const std::optional<at::Tensor>& bias,
                     bool use_extra) {
    auto y = mix->forward(xs[0]) * xs[1];
    if (bias) y = y + *bias;
    return use_extra ? extra->forward(y) : y;
  }
};
TORCH_MODULE(PairBlock);

struct PairModelImpl : torch::nn::Module {
  torch::nn::Linear in{nullptr};
  flatshard::Unit<PairBlock> block{nullptr};
  at::Tensor outside;  // a root parameter
  PairModelImpl() {
    in = register_module("in", torch::nn::Linear(8, 24));
    block = register_module("block", flatshard::Unit<PairBlock>());
    outside = register_parameter("outside", at::ones({8}));
  }
  at::Tensor forward(const at::Tensor& x, bool use_extra) {
    auto h = in->forward(x);
    auto parts = h.split(8, 1);
    return block(std::vector<at::Tensor>{parts[0], parts[1]}, std::optional<at::Tensor>(parts[2]), use_extra);
  }
};
TORCH_MODULE(PairModel);

TEST(Recompute, TensorsInVectorsAndOptionalsGetTheirGradients) {
  const auto x = at::randn({4, 8});
  std::map<std::string, at::Tensor> grads[2];
  for (bool on : {false, true}) {
    torch::manual_seed(5);
    PairModel model;
    flatshard::set_recompute(*model, on);
    model->forward(x, /*use_extra=*/false).square().sum().backward();
    for (const auto& p : model->named_parameters()) grads[on][p.key()] = p.value().grad();
  }
  for (const auto& [name, g] : grads[0]) {
    SCOPED_TRACE(name);
    const at::Tensor& r = grads[1].at(name);
    ASSERT_EQ(g.defined(), r.defined());
    if (name.rfind("block.extra", 0) == 0 || name == "outside") {
      EXPECT_FALSE(r.defined());
      continue;
    }
    ASSERT_TRUE(r.defined());
    EXPECT_TRUE(at::allclose(g, r, 1e-6, 1e-6));
  }
}

// The unused linear of a recomputed unit gets an undefined gradient in the re-run, and its
// AccumulateGrad hook fires all the same: the engine records no gradient for it, so
// AdamW's decoupled decay leaves it as it was, as without recomputation (an engine that
// counted the hook as a gradient decayed it).
TEST(Recompute, AParameterTheUnitLeftUnusedIsNotStepped) {
  flatshard::World world;
  const auto x = at::randn({4, 8});
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp}) {
    SCOPED_TRACE(to_string(strategy));
    torch::manual_seed(5);
    PairModel model;
    flatshard::set_recompute(*model, true);
    const auto extra = model->block->extra->weight.detach().clone();
    const auto mix = model->block->mix->weight.detach().clone();
    flatshard::FullyShard<PairModel> fsdp(model, world, options_for(strategy));
    flatshard::optim::AdamWOptions o;
    o.lr = 1e-2;
    o.weight_decay = 0.1;
    flatshard::optim::AdamW opt(fsdp, o);
    for (int s = 0; s < 2; ++s) {
      fsdp.forward(x, /*use_extra=*/false).square().sum().backward();
      opt.step();
      opt.zero_grad();
    }
    const auto got = flatshard::checkpoint::full_state_dict(fsdp, *model, -1);
    EXPECT_TRUE(at::equal(got.at("block.extra.weight"), extra));
    EXPECT_FALSE(at::equal(got.at("block.mix.weight"), mix)) << "the used linear trained";
  }
}

// Note [What a recomputed unit may reach]: a recomputed unit whose forward uses a
// parameter it does not own (here the root's) is refused in backward, naming what to do,
// where its gradient would have been lost.
struct ReachesOutImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  at::Tensor* foreign = nullptr;
  ReachesOutImpl() { lin = register_module("lin", torch::nn::Linear(8, 8)); }
  at::Tensor forward(const at::Tensor& x) { return lin->forward(x) * *foreign; }
};
TORCH_MODULE(ReachesOut);

TEST(Recompute, AUnitUsingAParameterItDoesNotOwnIsRefused) {
  torch::manual_seed(5);
  auto outer = std::make_shared<torch::nn::Module>();
  at::Tensor scale = outer->register_parameter("scale", at::full({8}, 2.0));
  flatshard::Unit<ReachesOut> unit;
  unit->foreign = &scale;
  const auto x = at::randn({4, 8}, at::TensorOptions().requires_grad(true));
  unit(x).sum().backward();  // without recomputation: scale gets its gradient
  ASSERT_TRUE(scale.grad().defined());
  unit->set_recompute(true);
  try {
    unit(x).sum().backward();
    ADD_FAILURE() << "the lost gradient was not refused";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("neither one of its parameters nor a tensor passed"),
              std::string::npos)
        << e.what();
  }
}

// What forward keeps: with every block recomputed, the activations alive between
// forward and backward are the blocks' inputs, not their internals.
TEST(Recompute, KeepsOnlyUnitInputs) {
  flatshard::memory::install_counting_allocator();
  auto c = gpt_config();
  c.dim = 64;
  c.context = 64;
  c.layers = 6;
  const auto tokens = at::randint(c.vocab, {16, c.context});
  std::int64_t kept[2] = {0, 0};
  for (bool on : {false, true}) {
    torch::manual_seed(3);
    GPT model(c);
    flatshard::set_recompute(*model, on);
    const auto before = flatshard::memory::allocator_stats().current_bytes;
    auto loss = model->forward(tokens).square().mean();
    kept[on] = flatshard::memory::allocator_stats().current_bytes - before;
    loss.backward();
    for (auto& p : model->parameters()) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_GT(p.grad().abs().sum().item<double>(), 0);
    }
  }
  // One block input is 16 x 64 x 64 fp32 = 256 KiB; a block's internals are about 15 of
  // those (attention scores of 4 heads alone are 1 MiB).
  const std::int64_t input_bytes = 16 * 64 * 64 * 4;
  std::printf("kept from forward: %lld bytes without recomputation, %lld with\n",
              static_cast<long long>(kept[0]), static_cast<long long>(kept[1]));
  EXPECT_LT(kept[1] * 3, kept[0]);
  EXPECT_LT(kept[1], (c.layers + 8) * input_bytes);  // inputs of the blocks + the root's own
}

}  // namespace
