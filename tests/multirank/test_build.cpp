// Building into shards (build.h): every rank ends with exactly the slice of a whole
// single-process build, trains as a whole build does, never holds more than its shards
// plus one unit, and refuses units that differ across ranks or do not fit.
#include <gtest/gtest.h>

#include "flatshard/memory.h"
#include "flatshard/plan.h"
#include "sharding/build_checks.h"
#include "tests/support/cases.h"
#include "tests/support/multirank.h"

namespace {

using namespace flatshard::testing;
using flatshard::Strategy;

std::function<GPT()> gpt_units_factory() {
  return [] {
    torch::manual_seed(11);
    auto c = gpt_config();
    c.embedding_units = true;
    return GPT(c);
  };
}

// Expects this rank's shards to be its slices of the flat buffers of `whole` (a model
// built in one process, with every parameter at full size), bit for bit.
void expect_slices_of(flatshard::FullyShardBase& fsdp, torch::nn::Module& whole, const std::string& what) {
  std::map<std::string, at::Tensor> params;
  for (const auto& item : whole.named_parameters()) params[item.key()] = item.value().detach();
  const auto shards = fsdp.shards();
  const auto layout = fsdp.layout();
  ASSERT_EQ(shards.size(), layout.size()) << what;
  std::size_t covered = 0;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    auto flat = at::zeros({layout[i].padded_numel});
    for (const auto& p : layout[i].params) {
      ASSERT_TRUE(params.count(p.name)) << what << ": " << p.name;
      flat.narrow(0, p.offset, p.numel).copy_(params.at(p.name).reshape({-1}));
      ++covered;
    }
    const auto mine = flat.narrow(0, fsdp.shard_group().rank * layout[i].shard_numel, layout[i].shard_numel);
    EXPECT_TRUE(at::equal(shards[i].cpu(), mine)) << what << ": shard " << i;
  }
  EXPECT_EQ(covered, params.size()) << what << ": every parameter is in a shard";
}

template <typename Holder>
void expect_built_slices(const flatshard::World& world, const std::string& what,
                         const std::function<Holder()>& make, int expected_built_units,
                         flatshard::FullyShardOptions options = {}) {
  Holder whole = make();
  Holder model{nullptr};
  flatshard::BuildReport report;
  {
    flatshard::BuildIntoShards build(world, options);
    model = make();
    report = build.report();
  }
  EXPECT_EQ(report.units, expected_built_units) << what;
  int holding = 0;
  for (const auto& m : model->modules(/*include_self=*/true)) {
    auto* provider = dynamic_cast<flatshard::UnitProvider*>(m.get());
    if (!provider) continue;
    for (auto* unit : provider->provided_units()) {
      ASSERT_TRUE(unit->built_shard()) << what << ": every unit was built into shards";
      ++holding;
      for (auto* sub : unit->unit_modules()) {
        for (const auto& p : sub->parameters())
          EXPECT_EQ(p.numel(), 0) << what << ": a unit's parameter is whole";
      }
    }
  }
  EXPECT_EQ(holding, expected_built_units) << what;
  flatshard::FullyShard<Holder> fsdp(model, world, options);
  expect_slices_of(fsdp, *whole, what);
}

TEST(BuildIntoShards, EachRankHoldsItsSliceOfAWholeBuild) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const int layers = gpt_config().layers;
  expect_built_slices<GPT>(world, "gpt", gpt_factory(), layers);
  expect_built_slices<GPT>(world, "gpt with embedding units", gpt_units_factory(), layers + 2);
  expect_built_slices<flatshard::SequentialUnits>(world, "mlp", mlp_units_factory(), 4);
  expect_built_slices<MnistNet>(world, "cnn", cnn_factory(), 2);
  flatshard::FullyShardOptions bf16;
  bf16.mixed_precision.param = at::kBFloat16;  // other padding; the masters stay fp32 slices
  expect_built_slices<GPT>(world, "gpt, bf16 compute", gpt_units_factory(), layers + 2, bf16);
  if (world.world_size() % 2 == 0) {
    flatshard::FullyShardOptions hybrid;  // shards of the group of 2 this rank is in
    hybrid.strategy = Strategy::HybridShard;
    hybrid.shard_group_size = 2;
    expect_built_slices<GPT>(world, "gpt, hybrid groups of 2", gpt_units_factory(), layers + 2, hybrid);
  }
}

// Training a model built into shards is bit for bit training the whole-built one.
TEST(BuildIntoShards, TrainsBitForBitAsAWholeBuild) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(240));
  auto world = flatshard::init();
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp}) {
    TrainSpec spec;
    spec.strategy = strategy;
    spec.optimizer = OptKind::AdamW;
    spec.steps = 4;
    spec.clip = 0.5;
    const auto batch = [](int s) { return gpt_batch(s, 12); };
    const auto whole = train_and_compare<GPT>(world, gpt_units_factory(), batch, token_loss, spec);
    spec.build_into_shards = true;
    const auto built = train_and_compare<GPT>(world, gpt_units_factory(), batch, token_loss, spec);
    SCOPED_TRACE(::testing::Message() << (strategy == Strategy::FullShard ? "full shard" : "shard grad op")
                                      << " world " << world.world_size());
    ASSERT_EQ(whole.weights.size(), built.weights.size());
    for (const auto& [name, w] : whole.weights) EXPECT_TRUE(at::equal(w, built.weights.at(name))) << name;
    EXPECT_EQ(whole.max_rel_loss_diff, built.max_rel_loss_diff);
    EXPECT_LE(built.max_rel_weight_diff, 1e-5) << "against single-process training: " << built.worst_param;
  }
  // The CNN's and the MLP's units, built into shards, against single-process training.
  TrainSpec spec;
  spec.build_into_shards = true;
  spec.steps = 3;
  const auto cnn = train_and_compare<MnistNet>(
      world, cnn_factory(), [](int s) { return cnn_batch(s, 12); }, nll, spec);
  EXPECT_LE(cnn.max_rel_weight_diff, 1e-5) << cnn.worst_param;
  const auto mlp = train_and_compare<flatshard::SequentialUnits>(
      world, mlp_units_factory(), [](int s) { return mlp_batch(s, 12); }, mse, spec);
  EXPECT_LE(mlp.max_rel_weight_diff, 1e-5) << mlp.worst_param;
}

// Note [Built units frozen afterwards]: a model built into shards and frozen in part
// afterwards (every block's attention and the norm before it, as a LoRA fine-tuning of the
// MLPs freezes them; the embedding unit wholly) is laid out as the whole build frozen alike:
// every block gets a frozen part, the shards are bit for bit the whole build's, and
// training is bit for bit the same.
TEST(BuildIntoShards, FrozenAfterBuildingIsLaidOutAsAWholeBuild) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(240));
  auto world = flatshard::init();
  const auto frozen = [](const std::string& n) {
    return n.find(".attn.") != std::string::npos || n.find(".ln1.") != std::string::npos ||
           n.rfind("wte.", 0) == 0;
  };
  auto freeze = [&](GPT& model) {
    for (auto& item : model->named_parameters()) {
      if (frozen(item.key())) item.value().requires_grad_(false);
    }
  };
  std::vector<std::pair<std::string, flatshard::FullyShardOptions>> cases(3);
  cases[0].first = "full shard";
  cases[1].first = "shard grad op, bf16 compute";
  cases[1].second.strategy = Strategy::ShardGradOp;
  cases[1].second.mixed_precision.param = at::kBFloat16;
  cases[2].first = "hybrid groups of 2";
  cases[2].second.strategy = Strategy::HybridShard;
  cases[2].second.shard_group_size = 2;
  if (world.world_size() % 2 != 0) cases.pop_back();
  for (const auto& [what, options] : cases) {
    SCOPED_TRACE(what);
    GPT whole = gpt_units_factory()();
    freeze(whole);
    const auto whole_shape = flatshard::plan::shape_of(*whole);
    flatshard::FullyShard<GPT> whole_fsdp(whole, world, options);
    GPT built{nullptr};
    {
      flatshard::BuildIntoShards build(world, options);
      built = gpt_units_factory()();
    }
    freeze(built);
    // The planner sees the frozen parameters of the units built into shards too.
    const auto built_shape = flatshard::plan::shape_of(*built);
    EXPECT_EQ(built_shape.unit_numels, whole_shape.unit_numels);
    EXPECT_EQ(built_shape.unit_frozen, whole_shape.unit_frozen);
    EXPECT_EQ(built_shape.root_frozen, whole_shape.root_frozen);
    EXPECT_GT(built_shape.frozen(), 0);
    flatshard::FullyShard<GPT> built_fsdp(built, world, options);
    const auto whole_layout = whole_fsdp.layout(), built_layout = built_fsdp.layout();
    ASSERT_EQ(built_layout.size(), whole_layout.size());
    EXPECT_EQ(built_layout.size(), static_cast<std::size_t>(built_fsdp.num_units() + gpt_config().layers))
        << "every block has a frozen part";
    const auto whole_shards = whole_fsdp.shards(), built_shards = built_fsdp.shards();
    for (std::size_t i = 0; i < built_layout.size(); ++i) {
      ASSERT_EQ(built_layout[i].params.size(), whole_layout[i].params.size()) << "shard " << i;
      bool any_frozen = false, any_trained = false;
      for (std::size_t k = 0; k < built_layout[i].params.size(); ++k) {
        const auto& p = built_layout[i].params[k];
        EXPECT_EQ(p.name, whole_layout[i].params[k].name) << "shard " << i;
        EXPECT_EQ(p.offset, whole_layout[i].params[k].offset) << p.name;
        (frozen(p.name) ? any_frozen : any_trained) = true;
      }
      EXPECT_FALSE(any_frozen && any_trained) << "shard " << i << " mixes frozen and trained parameters";
      EXPECT_EQ(built_layout[i].padded_numel, whole_layout[i].padded_numel) << "shard " << i;
      EXPECT_TRUE(at::equal(built_shards[i].cpu(), whole_shards[i].cpu())) << "shard " << i;
    }
  }
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp}) {
    SCOPED_TRACE(strategy == Strategy::FullShard ? "full shard, trained" : "shard grad op, trained");
    TrainSpec spec;
    spec.strategy = strategy;
    spec.optimizer = OptKind::AdamW;
    spec.steps = 4;
    spec.frozen = frozen;
    const auto batch = [](int s) { return gpt_batch(s, 12); };
    const auto whole = train_and_compare<GPT>(world, gpt_units_factory(), batch, token_loss, spec);
    spec.build_into_shards = true;
    const auto built = train_and_compare<GPT>(world, gpt_units_factory(), batch, token_loss, spec);
    ASSERT_EQ(whole.weights.size(), built.weights.size());
    for (const auto& [name, w] : whole.weights) EXPECT_TRUE(at::equal(w, built.weights.at(name))) << name;
    EXPECT_LE(built.max_rel_weight_diff, 1e-5) << "against single-process training: " << built.worst_param;
  }
}

// From before construction to the wrapper: this rank's shards, the root's parameters
// and one unit at full size; a whole build holds the whole model.
TEST(BuildIntoShards, HoldsItsShardsAndOneUnitAtATime) {
  FLATSHARD_RUN_RANKS({1, 4}, std::chrono::seconds(120));
  at::set_num_threads(1);
  flatshard::memory::install_counting_allocator();
  auto world = flatshard::init();
  GPTConfig c{512, 32, 128, 4, 6};
  c.embedding_units = true;
  const std::int64_t block = 12 * c.dim * c.dim + 10 * c.dim;  // a block's parameters
  const std::int64_t embedding = static_cast<std::int64_t>(c.vocab) * c.dim;
  const std::int64_t root = static_cast<std::int64_t>(c.context) * c.dim + 2 * c.dim;  // wpe, ln_f
  const std::int64_t total = c.layers * block + 2 * embedding + root;

  const auto base = flatshard::memory::allocator_stats().current_bytes;
  flatshard::memory::reset_allocator_peak();
  GPT model{nullptr};
  flatshard::BuildReport report;
  {
    flatshard::BuildIntoShards build(world, {});
    torch::manual_seed(1);
    model = GPT(c);
    report = build.report();
  }
  flatshard::FullyShard<GPT> fsdp(model, world, {});
  const auto built_peak = flatshard::memory::allocator_stats().peak_bytes - base;
  EXPECT_EQ(report.largest_unit_bytes, 4 * block);
  EXPECT_EQ(report.units, c.layers + 2);
  const std::int64_t shards = fsdp.memory().param_shard_bytes;
  const std::int64_t bound = shards + report.largest_unit_bytes + 4 * root;
  std::printf(
      "world %d: built into shards, peak %.3f MiB; bound (shards %.3f + one unit %.3f + root %.3f) %.3f MiB; "
      "whole model %.3f MiB\n",
      world.world_size(), built_peak / 1048576.0, shards / 1048576.0, report.largest_unit_bytes / 1048576.0,
      4.0 * root / 1048576.0, bound / 1048576.0, 4.0 * total / 1048576.0);
  EXPECT_LE(built_peak, bound);

  // A whole build, wrapped the same way, holds the whole model first.
  const auto before_whole = flatshard::memory::allocator_stats().current_bytes;
  flatshard::memory::reset_allocator_peak();
  {
    torch::manual_seed(1);
    GPT whole(c);
    flatshard::FullyShard<GPT> other(whole, world, {});
  }
  const auto whole_peak = flatshard::memory::allocator_stats().peak_bytes - before_whole;
  EXPECT_GE(whole_peak, 4 * total);
  if (world.world_size() > 1) EXPECT_GT(whole_peak, bound) << "the bound must be below a whole build";
}

// A rank that builds with another seed or another config is refused while the unit is
// built, on every rank, naming the unit and the ranks on each side; a new build works.
TEST(BuildIntoShards, RefusesAUnitBuiltDifferently) {
  FLATSHARD_RUN_RANKS({2, 3});
  auto world = flatshard::init();
  const int last = world.world_size() - 1;
  auto build_expecting = [&](const GPTConfig& c, int seed, const std::vector<std::string>& needles) {
    flatshard::BuildIntoShards build(world, {});
    GPT model{nullptr};
    try {
      torch::manual_seed(seed);
      model = GPT(c);
      ADD_FAILURE() << "a different build was not refused";
    } catch (const flatshard::InvalidArgument& e) {
      const std::string what = e.what();
      for (const auto& needle : needles) EXPECT_NE(what.find(needle), std::string::npos) << what;
    }
    EXPECT_TRUE(model.is_empty()) << "nothing is left half-built";
    try {
      model = GPT(c);
      ADD_FAILURE() << "a failed build must not go on";
    } catch (const flatshard::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("start another"), std::string::npos) << e.what();
    }
  };
  const std::string others = world.world_size() == 2 ? "rank 0 (" : "ranks 0, 1 (";
  build_expecting(gpt_config(), world.rank() == last ? 12 : 11,
                  {"unit #1 (Block", others, "rank " + std::to_string(last) + " (", "seed every rank alike"});
  auto c = gpt_config();
  if (world.rank() == last) c.dim = 48;
  build_expecting(c, 11, {"unit #1 (Block", "names or shapes differ"});

  // The same seed and config everywhere: built and wrapped.
  GPT model{nullptr};
  {
    flatshard::BuildIntoShards build(world, {});
    model = gpt_factory()();
  }
  flatshard::FullyShard<GPT> fsdp(model, world, {});
  expect_slices_of(fsdp, *gpt_factory()(), "after refused builds");
}

// A parent that initialises its unit's parameters after the unit was built.
struct LateInitImpl : torch::nn::Module {
  LateInitImpl() {
    block = register_module("block", flatshard::Unit<Block>(gpt_config()));
    torch::NoGradGuard no_grad;
    block->fc->weight.normal_(0, 0.02);
  }
  at::Tensor forward(const at::Tensor& x) { return block(x); }
  flatshard::Unit<Block> block{nullptr};
};
TORCH_MODULE(LateInit);

template <typename Error, typename Fn>
void expect_refused(const std::string& what, const std::vector<std::string>& needles, Fn&& fn) {
  try {
    fn();
    ADD_FAILURE() << what << ": not refused";
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const auto& needle : needles)
      EXPECT_NE(message.find(needle), std::string::npos) << what << ": " << message;
  }
}

TEST(BuildIntoShards, BadInputIsRefusedAtConstruction) {
  FLATSHARD_RUN_RANKS({2});
  auto world = flatshard::init();
  const int layers = gpt_config().layers;
  const std::int64_t block_bytes = 4 * (12 * 32 * 32 + 10 * 32);

  // A budget that one unit alone exceeds: refused naming the unit and its bytes.
  {
    flatshard::FullyShardOptions o;
    o.memory_budget.bytes = block_bytes / 2;
    flatshard::BuildIntoShards build(world, o);
    GPT model{nullptr};
    try {
      model = gpt_factory()();
      ADD_FAILURE() << "a unit larger than the budget was built";
    } catch (const flatshard::MemoryBudgetError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("unit #1 (Block"), std::string::npos) << what;
      EXPECT_NE(what.find("even this unit alone does not fit"), std::string::npos) << what;
      EXPECT_EQ(e.need_bytes(), block_bytes);
      EXPECT_EQ(e.budget_bytes(), block_bytes / 2);
    }
    EXPECT_TRUE(model.is_empty());
  }
  // Shards plus the next unit over the budget: the advice is more ranks.
  {
    flatshard::FullyShardOptions o;
    o.memory_budget.bytes = block_bytes + block_bytes / 4;
    flatshard::BuildIntoShards build(world, o);
    expect_refused<flatshard::MemoryBudgetError>("budget", {"unit #2 (Block", "use more ranks"},
                                                 [&] { gpt_factory()(); });
  }
  // Built for bf16, wrapped for fp32.
  {
    flatshard::FullyShardOptions bf16;
    bf16.mixed_precision.param = at::kBFloat16;
    GPT model{nullptr};
    {
      flatshard::BuildIntoShards build(world, bf16);
      model = gpt_factory()();
    }
    expect_refused<flatshard::InvalidArgument>("other options",
                                               {"was built into shards for", "BFloat16", "Float"},
                                               [&] { flatshard::FullyShard<GPT> fsdp(model, world, {}); });
    // NoShard (DDP) and ShardOptimizerState (ZeRO-1) keep whole replicas.
    for (auto strategy : {flatshard::Strategy::NoShard, flatshard::Strategy::ShardOptimizerState}) {
      flatshard::FullyShardOptions replicated;
      replicated.strategy = strategy;
      expect_refused<flatshard::InvalidArgument>(
          flatshard::to_string(strategy),
          {"built into shards", std::string(flatshard::to_string(strategy)) + " keeps a whole replica"},
          [&] { flatshard::FullyShard<GPT> ddp(model, world, replicated); });
    }
    // Running the unwrapped model.
    expect_refused<flatshard::InvalidArgument>("unwrapped", {"wrap the model in flatshard::FullyShard"},
                                               [&] { model->forward(gpt_batch(0, 2).input); });
  }
  // A parent's write to a built unit's parameter would be lost.
  {
    LateInit model{nullptr};
    {
      flatshard::BuildIntoShards build(world, {});
      model = LateInit();
    }
    expect_refused<flatshard::InvalidArgument>("late init", {"'block.fc.weight' was written after"}, [&] {
      flatshard::FullyShard<LateInit> fsdp(model, world, {});
    });
  }
  // Shards for a GPU that this program cannot use (on a GPU machine too: past the visible ones).
  {
    flatshard::FullyShardOptions on_gpu;
    on_gpu.device = c10::Device(c10::kCUDA, 100);
    flatshard::BuildIntoShards build(world, on_gpu);
    expect_refused<flatshard::InvalidArgument>("no gpu", {"options.device is cuda:100,", "unit #1 (Block"},
                                               [&] { gpt_factory()(); });
  }
  // One build at a time.
  {
    flatshard::BuildIntoShards build(world, {});
    expect_refused<flatshard::InvalidArgument>("nested", {"another BuildIntoShards is active"},
                                               [&] { flatshard::BuildIntoShards inner(world, {}); });
  }
  EXPECT_GT(layers, 1);
}

// Issue-sized proof: a GPT whose fp32 parameters alone exceed the per-rank budget. DDP
// is refused at construction, full shard over a whole build is refused (the build alone
// would exceed the budget), and full shard built into shards with recomputation builds
// and trains it at world 4 with every rank's peak, from before construction to the last
// step, under the budget.
TEST(BuildIntoShards, TrainsAModelWhoseParametersExceedTheBudget) {
  FLATSHARD_RUN_RANKS({4}, std::chrono::seconds(300));
  at::set_num_threads(1);
  flatshard::memory::install_counting_allocator();
  auto world = flatshard::init();
  GPTConfig c{256, 64, 192, 4, 32};
  c.embedding_units = true;
  constexpr int kRows = 2;  // sequences per rank
  const std::int64_t budget_bytes = std::int64_t{48} << 20;
  flatshard::FullyShardOptions options;
  options.memory_budget.bytes = budget_bytes;
  options.memory_budget.optimizer_state_bytes = 0;  // SGD without momentum
  options.comm.timeout = std::chrono::seconds(120);

  const auto base = flatshard::memory::allocator_stats().current_bytes;
  flatshard::memory::reset_allocator_peak();
  std::int64_t params = 0;
  {
    torch::manual_seed(3);
    GPT whole(c);
    for (const auto& p : whole->parameters()) params += p.numel();
    EXPECT_GT(4 * params, budget_bytes) << "the model's fp32 parameters alone must exceed the budget";
    flatshard::FullyShardOptions ddp_options;
    ddp_options.strategy = flatshard::Strategy::NoShard;
    ddp_options.memory_budget = options.memory_budget;
    expect_refused<flatshard::MemoryBudgetError>(
        "ddp", {"in mode ddp needs", "memory budget of 48.0 MiB", "built into shards (BuildIntoShards)"},
        [&] { flatshard::FullyShard<GPT> ddp(whole, world, ddp_options); });
    expect_refused<flatshard::MemoryBudgetError>(
        "full shard over a whole build", {"while the model is built", "BuildIntoShards"},
        [&] { flatshard::FullyShard<GPT> fsdp(whole, world, options); });
  }

  // The planner, with one rank's activations measured on the plain model (recomputed).
  std::int64_t activations = 0;
  {
    torch::manual_seed(3);
    GPT plain(c);
    flatshard::set_recompute(*plain);
    for (auto& p : plain->parameters()) p.mutable_grad() = at::zeros_like(p);
    auto tokens = at::randint(c.vocab, {kRows, c.context + 1});
    auto pass = [&] {
      token_loss(plain->forward(tokens.narrow(1, 0, c.context)), tokens.narrow(1, 1, c.context)).backward();
    };
    pass();
    flatshard::memory::reset_allocator_peak();
    const auto before = flatshard::memory::allocator_stats().current_bytes;
    pass();
    activations = flatshard::memory::allocator_stats().peak_bytes - before;
  }

  flatshard::memory::reset_allocator_peak();
  GPT model{nullptr};
  {
    flatshard::BuildIntoShards build(world, options);
    torch::manual_seed(3);
    model = GPT(c);
  }
  flatshard::set_recompute(*model);
  const auto shape = flatshard::plan::shape_of(*model);
  flatshard::FullyShard<GPT> fsdp(model, world, options);
  flatshard::optim::SGD opt(fsdp, {0.05});
  double first_loss = 0, loss = 0;
  for (int step = 0; step < 3; ++step) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(7);  // the same batch: the loss must fall
    auto tokens = at::randint(c.vocab, {kRows * world.world_size(), c.context + 1}, g)
                      .narrow(0, world.rank() * kRows, kRows);
    auto l = token_loss(fsdp.forward(tokens.narrow(1, 0, c.context)), tokens.narrow(1, 1, c.context));
    l.backward();
    opt.step();
    opt.zero_grad();
    loss = l.item<double>();
    if (step == 0) first_loss = loss;
  }
  const auto peak = flatshard::memory::allocator_stats().peak_bytes - base;
  const auto m = fsdp.memory();
  std::printf(
      "rank %d: %lld parameters (%.1f MiB in fp32); peak %.1f MiB from before construction, budget %.1f "
      "MiB; shards %.1f, gathered units at most %.1f + %.1f (grads), the rest (activations, temporaries) "
      "%.1f; loss %.3f -> %.3f\n",
      world.rank(), static_cast<long long>(params), 4.0 * params / 1048576.0, peak / 1048576.0,
      budget_bytes / 1048576.0, 2.0 * m.param_shard_bytes / 1048576.0,
      m.peak_unsharded_param_bytes / 1048576.0, m.peak_unsharded_grad_bytes / 1048576.0,
      (peak - 2 * m.param_shard_bytes - m.peak_unsharded_param_bytes - m.peak_unsharded_grad_bytes) /
          1048576.0,
      first_loss, loss);
  EXPECT_LE(peak, budget_bytes);
  EXPECT_LT(loss, first_loss);
  flatshard::plan::PlanOptions po;
  po.world_size = world.world_size();
  po.optimizer_state_bytes = 0;
  po.recompute = true;
  po.build_into_shards = true;
  po.activation_bytes = activations;
  const auto predicted = flatshard::plan::predict(shape, po);
  const double error = static_cast<double>(predicted.peak - peak) / static_cast<double>(peak);
  std::printf("rank %d: planner %.1f MiB (%+.1f%%): %s\n", world.rank(), predicted.peak / 1048576.0,
              100 * error, predicted.describe().c_str());
  EXPECT_LE(std::abs(error), 0.10);
}

// A unit too large for its device (the check that guards a GPU), as arithmetic.
TEST(BuildIntoShards, UnitTooLargeForTheDevice) {
  flatshard::sharding::UnitFit fit;
  fit.unit = "unit #3 (Block)";
  fit.unit_bytes = 3 << 20;
  fit.gathered_bytes = 6 << 20;
  fit.device = "cuda:0";
  fit.device_bytes = 4 << 20;
  const auto misfit = flatshard::sharding::unit_does_not_fit(fit);
  ASSERT_TRUE(misfit.has_value());
  EXPECT_NE(misfit->why.find("unit #3 (Block) needs 6.0 MiB on cuda:0"), std::string::npos) << misfit->why;
  EXPECT_EQ(misfit->limit, 4 << 20);
  fit.device_bytes = 8 << 20;
  EXPECT_FALSE(flatshard::sharding::unit_does_not_fit(fit).has_value());
}

}  // namespace
