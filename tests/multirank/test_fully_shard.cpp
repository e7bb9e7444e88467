// Full shard and shard-grad-op training against single-process LibTorch training on
// the same global batch: three models, three optimizers, world sizes 1 to 4.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "tests/support/cases.h"
#include "tests/support/models.h"
#include "tests/support/multirank.h"
#include "tests/support/training.h"

namespace {

using namespace flatshard::testing;
using flatshard::Strategy;

// Note [Comparing weights]
// A parameter matches when ||w - w_ref|| / ||w_ref|| <= 1e-5. Element-wise comparison is
// also asserted for SGD, but not for Adam and AdamW: their first steps move every
// element by about lr whatever its gradient's size, so an element whose gradient is
// near zero follows the sign of its rounding noise, and the summation order (which
// sharding changes) decides it (even at world size 1, where only the kernels' rounding
// differs from torch::optim's). Measured over worlds 1-4: SGD element-wise <= 1e-6;
// Adam/AdamW element-wise up to 1e-3 on a few such elements (the CNN's fc1 behind dead
// ReLUs), norm-wise <= 5e-6.

template <typename Holder>
void expect_matches_reference(const std::string& model, const std::function<Holder()>& make,
                              const std::function<Batch(int, int)>& batch,
                              const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss) {
  auto world = flatshard::init();
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp}) {
    for (OptKind opt : {OptKind::SGD, OptKind::Adam, OptKind::AdamW}) {
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = opt;
      const auto r = train_and_compare<Holder>(
          world, make, [&](int step) { return batch(step, spec.global_batch); }, loss, spec);
      SCOPED_TRACE(::testing::Message()
                   << model << " " << (strategy == Strategy::FullShard ? "full shard" : "shard grad op")
                   << " " << to_string(opt) << " world " << world.world_size());
      if (world.rank() == 0) {
        std::printf("%s %s %s world %d: rel weight diff %.3g (%s), element-wise %.3g, rel loss diff %.3g\n",
                    model.c_str(), strategy == Strategy::FullShard ? "full-shard" : "shard-grad-op",
                    to_string(opt), world.world_size(), r.max_rel_weight_diff, r.worst_param.c_str(),
                    r.max_elementwise_diff, r.max_rel_loss_diff);
      }
      EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << "worst parameter: " << r.worst_param;
      if (opt == OptKind::SGD) EXPECT_LE(r.max_elementwise_diff, kFp32Tolerance);
      EXPECT_LE(r.max_rel_loss_diff, kFp32Tolerance);
    }
  }
}

TEST(FullyShard, MlpMatchesSingleProcess) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(120));
  expect_matches_reference<flatshard::SequentialUnits>("mlp", mlp_units_factory(), mlp_batch, mse);
}

TEST(FullyShard, GptMatchesSingleProcess) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(180));
  expect_matches_reference<GPT>("gpt", gpt_factory(), gpt_batch, token_loss);
}

TEST(FullyShard, MnistCnnMatchesSingleProcess) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(240));
  expect_matches_reference<MnistNet>("cnn", cnn_factory(), cnn_batch, nll);
}

// Note [Buffers a collective touches]: with every freed flat buffer poisoned (0xFF bytes,
// NaN), training in every strategy still matches single-process training, bf16 compute
// included: no step reads a gathered, gradient or bucket buffer after the schedule freed
// it (a read would bring NaN into the loss or the weights).
TEST(FullyShard, TrainingWithFreedBuffersPoisonedMatchesSingleProcess) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(180));
  setenv("FLATSHARD_POISON_FREED", "1", 1);
  auto world = flatshard::init();
  for (Strategy strategy :
       {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard, Strategy::ShardOptimizerState}) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << to_string(strategy) << (bf16 ? " bf16" : " fp32"));
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = OptKind::AdamW;
      spec.micro_batches = 2;
      spec.param_dtype = bf16 ? std::optional<at::ScalarType>{at::kBFloat16} : std::nullopt;
      spec.reduce_dtype = spec.param_dtype;
      const auto r = train_and_compare<GPT>(
          world, gpt_factory(), [&](int s) { return gpt_batch(s, spec.global_batch); }, token_loss, spec);
      // bf16: the whole model's relative difference, as the other bf16 tests (a small
      // parameter's own moves by bf16 rounding alone); NaN fails either comparison.
      EXPECT_LE(bf16 ? r.global_rel_weight_diff : r.max_rel_weight_diff,
                bf16 ? kBf16Tolerance : kFp32Tolerance)
          << "worst parameter: " << r.worst_param;
      EXPECT_LE(r.max_rel_loss_diff, bf16 ? kBf16Tolerance : kFp32Tolerance);
      if (bf16) EXPECT_LE(r.global_rel_master_diff, bf16_master_tolerance(spec.optimizer));
    }
  }
  unsetenv("FLATSHARD_POISON_FREED");
}

// Gradient accumulation over 2 micro-batches (no communication for the first), global
// gradient-norm clipping, and a unit that goes unused in every other step.
TEST(FullyShard, AccumulationClippingAndUnusedUnit) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(180));
  auto world = flatshard::init();
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp}) {
    const char* name = strategy == Strategy::FullShard ? "full shard" : "shard grad op";
    {
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = OptKind::PlainSGD;  // moves in proportion to a wrongly scaled gradient
      spec.global_batch = 24;
      spec.micro_batches = 2;
      const auto r = train_and_compare<GPT>(
          world, gpt_factory(), [&](int s) { return gpt_batch(s, 24); }, token_loss, spec);
      EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << name << " accumulation: " << r.worst_param;
      EXPECT_LE(r.max_rel_loss_diff, kFp32Tolerance) << name << " accumulation";
      expect_no_sync_sends_no_reduction(r, spec, world.world_size());
    }
    // The Euclidean norm, and another (torch's clip_grad_norm_ with its norm_type): the
    // largest magnitude under full shard, the 1.5-norm under shard-grad-op.
    const double other_norm = strategy == Strategy::FullShard ? INFINITY : 1.5;
    for (const double norm_type : {2.0, other_norm}) {
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = OptKind::SGD;
      spec.clip = std::isinf(norm_type) ? 0.005 : 0.25;
      spec.clip_norm_type = norm_type;
      const auto r = train_and_compare<GPT>(
          world, gpt_factory(), [&](int s) { return gpt_batch(s, 12); }, token_loss, spec);
      EXPECT_GT(r.max_grad_norm, spec.clip) << "the test must actually clip";
      EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance)
          << name << " clipping, norm " << norm_type << ": " << r.worst_param;
      EXPECT_LE(r.max_elementwise_diff, kFp32Tolerance) << name << " clipping, norm " << norm_type;
    }
    for (OptKind opt : {OptKind::SGD, OptKind::AdamW}) {
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = opt;
      spec.before_step = [](int step, torch::nn::Module& ref, torch::nn::Module& sharded) {
        const int skip = step % 2 == 1 ? 1 : -1;  // block h1 sits out odd steps, everywhere
        dynamic_cast<GPTImpl&>(ref).skip_block = skip;
        dynamic_cast<GPTImpl&>(sharded).skip_block = skip;
      };
      const auto r = train_and_compare<GPT>(
          world, gpt_factory(), [&](int s) { return gpt_batch(s, 12); }, token_loss, spec);
      EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance)
          << name << " unused unit " << to_string(opt) << ": " << r.worst_param;
    }
  }
}

// Clipping between backwards under no_sync() would clip shard gradients that do not hold
// the accumulated sum (nothing, or an older step's): refused in every strategy, as are a
// norm_type of 0 or less and a negative bound; after the backward that reduces, it clips.
TEST(FullyShard, ClippingBeforeTheReducingBackwardIsRefused) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp, Strategy::HybridShard,
                            Strategy::NoShard, Strategy::ShardOptimizerState}) {
    SCOPED_TRACE(to_string(strategy));
    flatshard::FullyShardOptions options;
    options.strategy = strategy;
    if (strategy == Strategy::HybridShard) options.shard_group_size = 1;
    flatshard::FullyShard<GPT> fsdp(gpt_factory()(), world, options);
    const auto b = gpt_batch(0, 4 * world.world_size());
    const auto rows = [&](const at::Tensor& t) { return t.narrow(0, 4 * world.rank(), 4); };
    {
      auto guard = fsdp.no_sync();
      token_loss(fsdp.forward(rows(b.input)), rows(b.target)).backward();
    }
    EXPECT_THROW(fsdp.clip_grad_norm(1.0), flatshard::InvalidArgument);
    token_loss(fsdp.forward(rows(b.input)), rows(b.target)).backward();
    EXPECT_THROW(fsdp.clip_grad_norm(1.0, 0.0), flatshard::InvalidArgument);
    EXPECT_THROW(fsdp.clip_grad_norm(-1.0), flatshard::InvalidArgument);
    const double norm = fsdp.clip_grad_norm(1e30);
    EXPECT_GT(norm, 0.0);
    EXPECT_GT(fsdp.clip_grad_norm(1e30, 1.0), norm) << "the 1-norm is at least the 2-norm";
    EXPECT_LT(fsdp.clip_grad_norm(1e30, INFINITY), norm) << "the largest magnitude is at most the 2-norm";
    fsdp.zero_grad();
  }
}

// With resharding after forward, at most prefetch + 1 units besides the root are
// gathered at any time during a step, and the gathered bytes stay under that bound.
TEST(FullyShard, GatheredBytesStayWithinThePrefetchBound) {
  FLATSHARD_RUN_RANKS({1, 2, 4}, std::chrono::seconds(120));
  auto world = flatshard::init();
  for (int prefetch : {0, 1, 2}) {
    TrainSpec spec;
    spec.prefetch = prefetch;
    spec.steps = 3;
    auto make = [] {
      torch::manual_seed(11);
      GPTConfig c;
      c.layers = 6;
      return GPT(c);
    };
    const auto r = train_and_compare<GPT>(
        world, make, [&](int s) { return gpt_batch(s, 12); }, token_loss, spec);
    EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance);
    // Equal, not at most: a prefetch that gathers nothing ahead peaks at one unit.
    EXPECT_EQ(r.peak_gathered_units, prefetch + 1) << "prefetch " << prefetch;
    EXPECT_LE(r.peak_unsharded_param_bytes, r.root_unit_bytes + (prefetch + 1) * r.largest_unit_bytes)
        << "prefetch " << prefetch;
    if (world.rank() == 0) {
      std::printf(
          "prefetch %d world %d: peak gathered units %d, peak unsharded param bytes %lld "
          "(root %lld + unit %lld each)\n",
          prefetch, world.world_size(), r.peak_gathered_units,
          static_cast<long long>(r.peak_unsharded_param_bytes), static_cast<long long>(r.root_unit_bytes),
          static_cast<long long>(r.largest_unit_bytes));
    }
  }
}

// Wrapping keeps the module's own parameter objects: names, parameters() and shapes
// (when gathered) are those of the plain model.
TEST(FullyShard, KeepsParameterObjectsAndNames) {
  FLATSHARD_RUN_RANKS({2});
  auto world = flatshard::init();
  GPT model = gpt_factory()();
  std::vector<std::string> names;
  std::vector<const c10::TensorImpl*> impls;
  std::vector<std::vector<std::int64_t>> shapes;
  for (const auto& item : model->named_parameters()) {
    names.push_back(item.key());
    impls.push_back(item.value().unsafeGetTensorImpl());
    shapes.push_back(item.value().sizes().vec());
  }
  const auto blocks_before = model->blocks[0]->fc->weight.unsafeGetTensorImpl();
  flatshard::FullyShard<GPT> fsdp(model, world, {});
  EXPECT_EQ(fsdp.num_units(), 1 + gpt_config().layers) << "the root and one unit per block";
  const auto b = gpt_batch(0, 4);
  token_loss(fsdp.forward(b.input.narrow(0, 2 * world.rank(), 2)), b.target.narrow(0, 2 * world.rank(), 2))
      .backward();
  std::size_t i = 0;
  for (const auto& item : model->named_parameters()) {
    ASSERT_LT(i, names.size());
    EXPECT_EQ(item.key(), names[i]);
    EXPECT_EQ(item.value().unsafeGetTensorImpl(), impls[i]) << item.key();
    EXPECT_EQ(item.value().numel(), 0) << item.key() << " is freed between steps";
    EXPECT_FALSE(item.value().grad().defined()) << "gradients live in the shards, not the parameters";
    ++i;
  }
  EXPECT_EQ(i, names.size());
  EXPECT_EQ(model->blocks[0]->fc->weight.unsafeGetTensorImpl(), blocks_before);
  {
    auto full = fsdp.summon_full_params();
    i = 0;
    for (const auto& item : model->named_parameters()) EXPECT_EQ(item.value().sizes().vec(), shapes[i++]);
  }
}

// Ranks that wrap different models, or the same model with another strategy, are
// refused at wrap time on every rank, naming the first difference and the rank.
TEST(FullyShard, DifferentModelsOrStrategiesAcrossRanksAreRefused) {
  FLATSHARD_RUN_RANKS({2, 3});
  auto world = flatshard::init();
  const bool odd_one = world.rank() == world.world_size() - 1;
  const std::string last = std::to_string(world.world_size() - 1);
  {
    GPTConfig c;
    if (odd_one) c.layers = 2;  // one block fewer
    GPT model(c);
    try {
      flatshard::FullyShard<GPT> fsdp(model, world, {});
      FAIL() << "FullyShard accepted different models";
    } catch (const flatshard::InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("differs across ranks"), std::string::npos) << what;
      EXPECT_NE(what.find("rank " + last + " has"), std::string::npos) << what;
    }
  }
  {
    GPT model = gpt_factory()();
    flatshard::FullyShardOptions options;
    options.strategy = odd_one ? Strategy::ShardGradOp : Strategy::FullShard;
    try {
      flatshard::FullyShard<GPT> fsdp(model, world, options);
      FAIL() << "FullyShard accepted different strategies";
    } catch (const flatshard::InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("rank 0 has strategy FullShard"), std::string::npos) << what;
      EXPECT_NE(what.find("rank " + last + " has strategy ShardGradOp"), std::string::npos) << what;
    }
  }
  // Frozen parameters are laid out apart from trained ones: a rank that freezes another
  // parameter would make other collectives.
  for (Strategy strategy : {Strategy::FullShard, Strategy::NoShard}) {
    GPT model = gpt_factory()();
    if (odd_one) model->named_parameters()["h0.attn.qkv.weight"].requires_grad_(false);
    try {
      flatshard::FullyShard<GPT> fsdp(model, world, options_for(strategy));
      FAIL() << "FullyShard accepted different frozen parameters under " << to_string(strategy);
    } catch (const flatshard::InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("rank 0 has parameter 'h0.attn.qkv.weight' Float 96x32, rank " + last +
                          " has parameter 'h0.attn.qkv.weight' Float 96x32 frozen"),
                std::string::npos)
          << what;
    }
  }
}

// A CUDA device the process cannot see (no GPU, a build without CUDA, or an index past
// the visible ones) is refused when the wrapper is made, naming the device, what the
// process sees and what to do, before anything is placed or any collective is made.
TEST(FullyShard, ADeviceTheProcessCannotSeeIsRefused) {
  flatshard::World world;  // one rank
  for (auto strategy : {Strategy::FullShard, Strategy::NoShard}) {
    GPT model = gpt_factory()();
    flatshard::FullyShardOptions options;
    options.strategy = strategy;
    options.device = c10::Device(c10::kCUDA, 100);
    try {
      flatshard::FullyShard<GPT> fsdp(model, world, options);
      FAIL() << "FullyShard accepted cuda:100";
    } catch (const flatshard::InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("rank 0/1"), std::string::npos) << what;
      EXPECT_NE(what.find("cuda:100,"), std::string::npos) << what;
      EXPECT_NE(what.find("CUDA device"), std::string::npos) << what;
      EXPECT_NE(what.find("CUDA_VISIBLE_DEVICES"), std::string::npos) << what;
    }
    // The model is untouched: it still trains on the CPU.
    flatshard::FullyShard<GPT> fsdp(model, world, {});
    const auto b = gpt_batch(0, 2);
    EXPECT_TRUE(std::isfinite(token_loss(fsdp.forward(b.input), b.target).item<double>()));
  }
}

// The engine's byte counts agree with the flat layout, the report shows them, and the
// counting allocator sees at least what the engine holds.
TEST(FullyShard, MemoryAccounting) {
  FLATSHARD_RUN_RANKS({1, 2, 4});
  flatshard::memory::install_counting_allocator();
  auto world = flatshard::init();
  GPT model = gpt_factory()();
  std::int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  flatshard::FullyShard<GPT> fsdp(model, world, {});
  flatshard::optim::AdamW opt(fsdp, {});
  flatshard::memory::reset_allocator_peak();
  const auto b = gpt_batch(0, 4 * world.world_size());
  auto x = b.input.narrow(0, 4 * world.rank(), 4), y = b.target.narrow(0, 4 * world.rank(), 4);
  token_loss(fsdp.forward(x), y).backward();
  opt.step();
  const auto m = fsdp.memory();
  std::int64_t shard_numel = 0;
  for (const auto& s : fsdp.shards()) shard_numel += s.numel();
  EXPECT_EQ(m.param_shard_bytes, shard_numel * 4);
  EXPECT_EQ(m.grad_shard_bytes, shard_numel * 4);  // every unit ran: every shard has a gradient
  EXPECT_EQ(opt.state_bytes(), 2 * shard_numel * 4);
  // Shards are 1/N of the padded model: padding adds less than 16 bytes per rank and unit.
  EXPECT_GE(shard_numel * world.world_size(), numel);
  EXPECT_LT(shard_numel * world.world_size(), numel + fsdp.num_units() * 4 * world.world_size());
  EXPECT_EQ(m.unsharded_param_bytes, 0) << "everything is resharded after backward";
  EXPECT_EQ(m.unsharded_grad_bytes, 0);
  EXPECT_GT(m.peak_unsharded_param_bytes, 0);
  const auto a = flatshard::memory::allocator_stats();
  EXPECT_GE(a.peak_bytes, m.peak_unsharded_param_bytes);
  const std::string report = fsdp.memory_report(opt.state_bytes());
  EXPECT_NE(report.find("param shards"), std::string::npos) << report;
  EXPECT_NE(report.find("optimizer states"), std::string::npos) << report;
  EXPECT_NE(report.find("allocator"), std::string::npos) << report;
  if (world.rank() == 0) std::printf("%s\n", report.c_str());
}

// The full state dict: gathered on rank 0, saved, and read by Python's torch.load with
// the names, shapes and values, element by element, of the same model trained in one
// process.
TEST(FullyShard, FullStateDictIsReadableByTorchLoad) {
  FLATSHARD_RUN_RANKS({2, 3});
  auto world = flatshard::init();
  // The true weights: the same step, single-process, on the whole batch.
  GPT reference = gpt_factory()();
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.5));
  GPT model = gpt_factory()();
  flatshard::FullyShard<GPT> fsdp(model, world, {});
  flatshard::optim::SGD opt(fsdp, {0.5});
  const int rows = 2 * world.world_size();
  const auto b = gpt_batch(0, rows);
  token_loss(fsdp.forward(b.input.narrow(0, 2 * world.rank(), 2)), b.target.narrow(0, 2 * world.rank(), 2))
      .backward();
  opt.step();
  token_loss(reference->forward(b.input), b.target).backward();
  ref_opt.step();
  const auto state = flatshard::checkpoint::full_state_dict(fsdp, *model, 0);
  if (world.rank() != 0) {
    EXPECT_TRUE(state.empty());
    return;
  }
  ASSERT_EQ(state.size(), model->named_parameters().size());
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("flatshard_full_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string file = (dir / "state.pt").string();
  flatshard::checkpoint::save_tensors(state, file);
  // The reference as raw fp32, written without FlatShard's writer.
  std::map<std::string, std::string> expected;  // name -> shape; sorted as the script prints
  for (const auto& item : reference->named_parameters()) {
    const at::Tensor w = item.value().detach().contiguous();
    std::ofstream out(dir / (item.key() + ".f32"), std::ios::binary);
    out.write(static_cast<const char*>(w.data_ptr()), static_cast<std::streamsize>(w.nbytes()));
    std::string shape;
    for (auto d : w.sizes()) shape += (shape.empty() ? "" : "x") + std::to_string(d);
    expected[item.key()] = shape;
  }
  const auto r =
      run_command({FLATSHARD_PYTHON, std::string(FLATSHARD_TESTS_DIR) + "/multirank/check_full_state_dict.py",
                   file, dir.string()});
  std::filesystem::remove_all(dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::istringstream lines(r.output);
  std::string name, shape;
  double diff;
  std::map<std::string, std::string> got;
  while (lines >> name >> shape >> diff) {
    got[name] = shape;
    // A slice in the wrong place is off by the weights themselves (about 0.02-1); the
    // gradients' summation order differs by float rounding only.
    EXPECT_LE(diff, 1e-6) << name;
  }
  EXPECT_EQ(got, expected) << r.output;
}

// The optimizer state over shards, consolidated, equals torch::optim::AdamW's own state
// after the same training, in every strategy at every world size.
TEST(FullyShard, ConsolidatedOptimizerStateMatchesTorchOptim) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const int n = world.world_size();
  for (Strategy strategy : every_strategy(n)) {
    SCOPED_TRACE(to_string(strategy));
    GPT reference = gpt_factory()();
    torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
    GPT model = gpt_factory()();
    flatshard::FullyShard<GPT> fsdp(model, world, options_for(strategy, n));
    flatshard::optim::AdamW opt(fsdp, {1e-3, 0.9, 0.999, 1e-8, 0.1});
    for (int step = 0; step < 3; ++step) {
      const auto b = gpt_batch(step, 4 * n);
      ref_opt.zero_grad();
      token_loss(reference->forward(b.input), b.target).backward();
      ref_opt.step();
      token_loss(fsdp.forward(b.input.narrow(0, 4 * world.rank(), 4)),
                 b.target.narrow(0, 4 * world.rank(), 4))
          .backward();
      opt.step();
      opt.zero_grad();
    }
    const auto state = flatshard::checkpoint::full_optimizer_state_dict(fsdp, opt, 0);
    if (world.rank() != 0) {
      EXPECT_TRUE(state.empty());
      continue;
    }
    // "step", each parameter's exp_avg, exp_avg_sq and step, the default group's five
    // hyperparameters.
    EXPECT_EQ(state.size(), 1 + 3 * reference->parameters().size() + 5);
    for (const auto& item : reference->named_parameters())
      EXPECT_EQ(state.at(item.key() + ".step").item<std::int64_t>(), 3) << item.key();
    EXPECT_DOUBLE_EQ(state.at("param_groups.default.weight_decay").item<double>(), 0.1);
    expect_adamw_state_matches(state, reference, ref_opt, 3);
  }
}

// bf16 parameters and gradients with fp32 master shards and optimizer states, reduced
// in fp32 or in bf16, against fp32 single-process training. See Note [bf16 tolerance].
// CPU offload keeps master shards, their gradients and the optimizer's state in host
// memory and moves shards and reduced gradients through staging copies: the arithmetic
// is the same, so training is bit for bit what it is without offload (gradient
// accumulation, clipping, bf16 compute and both strategies included).
TEST(FullyShard, CpuOffloadTrainsBitForBitAsWithout) {
  FLATSHARD_RUN_RANKS({1, 2, 3}, std::chrono::seconds(240));
  auto world = flatshard::init();
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp}) {
    for (auto dtype : {std::optional<at::ScalarType>{}, std::optional<at::ScalarType>{at::kBFloat16}}) {
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = OptKind::AdamW;
      spec.steps = 4;
      spec.global_batch = 24;
      spec.micro_batches = 2;
      spec.clip = 0.25;
      spec.param_dtype = dtype;
      spec.reduce_dtype = at::kFloat;
      const auto batch = [](int s) { return gpt_batch(s, 24); };
      const auto plain = train_and_compare<GPT>(world, gpt_factory(), batch, token_loss, spec);
      spec.cpu_offload = true;
      spec.build_on_host = true;  // options.device = the CPU: the same placement, said explicitly
      const auto offloaded = train_and_compare<GPT>(world, gpt_factory(), batch, token_loss, spec);
      SCOPED_TRACE(::testing::Message() << (strategy == Strategy::FullShard ? "full shard" : "shard grad op")
                                        << (dtype ? " bf16" : " fp32") << " world " << world.world_size());
      EXPECT_TRUE(offloaded.shard_device.is_cpu());
      EXPECT_EQ(offloaded.global_rel_weight_diff, plain.global_rel_weight_diff);
      EXPECT_EQ(offloaded.max_rel_weight_diff, plain.max_rel_weight_diff);
      EXPECT_EQ(offloaded.max_rel_loss_diff, plain.max_rel_loss_diff);
      EXPECT_EQ(offloaded.max_grad_norm, plain.max_grad_norm);
      EXPECT_GT(offloaded.max_grad_norm, spec.clip) << "the test must actually clip";
      EXPECT_LE(offloaded.global_rel_weight_diff, dtype ? 5e-3 : kFp32Tolerance);
    }
  }
}

// A user's optimizer over the wrapper that knows nothing of the bf16 copies: plain SGD,
// writing the masters through raw pointers as FlatShard's kernels do.
// It throws instead of stepping its run number `fail_at` (counted from 0; -1: never).
class RawSgd final : public flatshard::optim::ShardOptimizer {
 public:
  RawSgd(flatshard::FullyShardBase& fsdp, double lr, int fail_at = -1)
      : ShardOptimizer(fsdp, {}, "RawSgd"), lr_(lr), fail_at_(fail_at) {}
  std::int64_t state_bytes() const override { return 0; }
  double lr(std::size_t) const override { return lr_; }
  void set_lr(std::size_t, double lr) override { lr_ = lr; }
  std::map<std::string, double> hyperparameters(std::size_t) const override { return {{"lr", lr_}}; }
  void set_hyperparameters(std::size_t, const std::map<std::string, double>& v) override { lr_ = v.at("lr"); }
  std::vector<std::pair<std::string, at::Tensor>> named_state(std::size_t) const override { return {}; }
  std::vector<std::string> state_names() const override { return {}; }
  at::Tensor mutable_state(std::size_t, const std::string&) override { return {}; }

 private:
  void step_run(std::size_t i, const at::Tensor& grad, const Run& run) override {
    if (runs_++ == fail_at_) throw std::runtime_error("RawSgd: this run fails");
    float* p = shards_[i].data_ptr<float>() + run.offset;
    const float* g = grad.data_ptr<float>() + run.offset;
    for (std::int64_t k = 0; k < run.numel; ++k) p[k] -= static_cast<float>(lr_) * g[k];
  }
  void ensure_state(std::size_t) override {}
  double lr_;
  int fail_at_;
  int runs_ = 0;
};

// Note [The bf16 copy of an offloaded master]: the gathers send the masters' bf16 copies
// only while no other write reached the masters. Between steps of FlatShard's AdamW, the
// masters are scaled in place (as a user's code or a loaded checkpoint writes them) and
// stepped by optimizers that know nothing of the copies (one over the bare shards, one of
// the user's own over the wrapper): training must stay bit for bit what it is without
// offload, under every strategy, and the copies must exist only where they are asked for.
TEST(FullyShard, OffloadedBf16CopiesAreNeverSentStale) {
  FLATSHARD_RUN_RANKS({1, 2}, std::chrono::seconds(240));
  auto world = flatshard::init();
  for (Strategy strategy :
       {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard, Strategy::ShardOptimizerState}) {
    struct Run {
      std::vector<float> losses;
      std::vector<at::Tensor> shards;
      std::int64_t copy_bytes = 0;
    };
    auto train = [&](bool offload, bool copies) {
      auto model = gpt_factory()();
      flatshard::FullyShardOptions options;
      options.strategy = strategy;
      options.mixed_precision.param = at::kBFloat16;
      options.mixed_precision.reduce = at::kFloat;
      options.cpu_offload = offload;
      options.offload_bf16_copy = copies;
      options.comm.timeout = std::chrono::seconds(60);
      flatshard::FullyShard<GPT> fsdp(model, world, options);
      flatshard::optim::AdamW adamw(fsdp, {});
      Run r;
      for (int step = 0; step < 6; ++step) {
        const auto b = gpt_batch(step, 4 * world.world_size());
        const auto rows = [&](const at::Tensor& t) { return t.narrow(0, 4 * world.rank(), 4); };
        const auto loss = token_loss(fsdp.forward(rows(b.input)), rows(b.target));
        loss.backward();
        r.losses.push_back(loss.item<float>());
        if (step == 3) {  // an optimizer over the shards alone: it writes the masters, not the copies
          flatshard::optim::SGD sgd(fsdp.shards(), {0.05});
          sgd.step();
        } else if (step == 2) {
          RawSgd(fsdp, 0.05).step();
        } else {
          adamw.step();
        }
        adamw.zero_grad();
        if (step == 1) {  // a write of the user's own
          at::NoGradGuard no_grad;
          for (auto& shard : fsdp.shards()) shard.mul_(0.75);
        }
        r.copy_bytes = std::max(r.copy_bytes, fsdp.memory().bf16_copy_bytes);
      }
      for (const auto& shard : fsdp.shards()) r.shards.push_back(shard.clone());
      return r;
    };
    const Run plain = train(false, true), offloaded = train(true, true), without = train(true, false);
    SCOPED_TRACE(::testing::Message() << to_string(strategy) << " world " << world.world_size());
    EXPECT_EQ(plain.copy_bytes, 0);
    EXPECT_EQ(without.copy_bytes, 0);
    std::int64_t shard_numel = 0;
    for (const auto& shard : plain.shards) shard_numel += shard.numel();
    EXPECT_EQ(offloaded.copy_bytes, 2 * shard_numel) << "a bf16 copy of every master shard";
    for (const Run* r : {&offloaded, &without}) {
      EXPECT_EQ(r->losses, plain.losses);
      ASSERT_EQ(r->shards.size(), plain.shards.size());
      for (std::size_t i = 0; i < plain.shards.size(); ++i)
        EXPECT_TRUE(at::equal(r->shards[i], plain.shards[i])) << i;
    }
  }
}

// Note [Offloaded steps beside backward]: under offload each unit steps on the engine's
// host thread while backward goes on. Backward returns with every unit stepped and no
// gradient shard left; a step that fails surfaces from backward, on the thread that ran
// it, after the rest of backward's work (the other units still step), and training goes on.
TEST(FullyShard, OffloadedStepsBesideBackwardFinishInIt) {
  FLATSHARD_RUN_RANKS({1, 2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  for (int fail_at : {-1, 2}) {
    SCOPED_TRACE(::testing::Message() << "fail at " << fail_at << " world " << world.world_size());
    auto model = gpt_factory()();
    flatshard::FullyShardOptions options;
    options.cpu_offload = true;
    options.mixed_precision.param = at::kBFloat16;
    options.comm.timeout = std::chrono::seconds(60);
    flatshard::FullyShard<GPT> fsdp(model, world, options);
    RawSgd opt(fsdp, 0.05, fail_at);
    fsdp.step_in_backward(&opt);
    const auto before = fsdp.shards().front().clone();
    const auto backward = [&](int step) {
      const auto b = gpt_batch(step, 4 * world.world_size());
      const auto rows = [&](const at::Tensor& t) { return t.narrow(0, 4 * world.rank(), 4); };
      token_loss(fsdp.forward(rows(b.input)), rows(b.target)).backward();
    };
    if (fail_at < 0) {
      backward(0);
    } else {
      try {
        backward(0);
        ADD_FAILURE() << "the failed step was not reported";
      } catch (const std::exception& e) {
        EXPECT_NE(std::string(e.what()).find("RawSgd: this run fails"), std::string::npos) << e.what();
      }
    }
    // Every unit stepped in backward: no gradient shard is left for a step after it, but the
    // failed one's (a unit's shard steps in one run here).
    int left = 0;
    for (const auto& shard : fsdp.shards()) left += shard.grad().defined() ? 1 : 0;
    EXPECT_EQ(left, fail_at < 0 ? 0 : 1);
    EXPECT_FALSE(at::equal(before, fsdp.shards().front())) << "the root unit stepped";
    opt.zero_grad();
    backward(1);  // and training goes on
    EXPECT_EQ(fsdp.memory().grad_shard_bytes, 0);
  }
}

// Stepping in backward (Note [Step in backward]) is the step after backward, bit for bit,
// with gradient accumulation, under both strategies and with offload; it leaves no
// gradient shard behind, and refuses what needs every gradient first.
TEST(FullyShard, StepInBackwardTrainsBitForBitAsAStepAfter) {
  FLATSHARD_RUN_RANKS({1, 2, 4}, std::chrono::seconds(240));
  auto world = flatshard::init();
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp}) {
    for (bool offload : {false, true}) {
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = OptKind::AdamW;
      spec.steps = 4;
      spec.global_batch = 8;
      spec.micro_batches = 2;
      spec.param_dtype = at::kBFloat16;
      spec.reduce_dtype = at::kFloat;
      spec.cpu_offload = offload;
      spec.build_on_host = offload;
      const auto batch = [](int s) { return gpt_batch(s, 8); };
      const auto after = train_and_compare<GPT>(world, gpt_factory(), batch, token_loss, spec);
      spec.step_in_backward = true;
      const auto in = train_and_compare<GPT>(world, gpt_factory(), batch, token_loss, spec);
      SCOPED_TRACE(::testing::Message()
                   << to_string(strategy) << (offload ? " offload" : "") << " world " << world.world_size());
      ASSERT_EQ(after.weights.size(), in.weights.size());
      for (const auto& [name, w] : after.weights) EXPECT_TRUE(at::equal(w, in.weights.at(name))) << name;
      EXPECT_EQ(after.max_rel_loss_diff, in.max_rel_loss_diff);
      EXPECT_LE(in.global_rel_weight_diff, 5e-3);
    }
  }
  // No gradient shard outlives backward; clipping and a skipping policy are refused.
  auto model = gpt_factory()();
  flatshard::FullyShard<GPT> fsdp(model, world);
  flatshard::optim::AdamW opt(fsdp, {});
  fsdp.step_in_backward(&opt);
  const auto b = gpt_batch(0, 4 * world.world_size());
  token_loss(fsdp.forward(b.input.narrow(0, 4 * world.rank(), 4)), b.target.narrow(0, 4 * world.rank(), 4))
      .backward();
  EXPECT_EQ(fsdp.memory().grad_shard_bytes, 0);
  EXPECT_GT(opt.steps(0), 0) << "the root unit stepped in backward";
  EXPECT_THROW(fsdp.clip_grad_norm(1.0), flatshard::InvalidArgument);
  flatshard::optim::AdamW other(std::vector<at::Tensor>{fsdp.shards().front()}, {});
  EXPECT_THROW(fsdp.step_in_backward(&other), flatshard::InvalidArgument);
  flatshard::FullyShardOptions skipping;
  skipping.nonfinite_grads = flatshard::NonFiniteGrads::Skip;
  flatshard::FullyShard<GPT> guarded(gpt_factory()(), world, skipping);
  flatshard::optim::AdamW guarded_opt(guarded, {});
  EXPECT_THROW(guarded.step_in_backward(&guarded_opt), flatshard::InvalidArgument);
  // A unit steps before the ranks could agree which of its parameters any rank used.
  flatshard::FullyShardOptions finding;
  finding.find_unused_parameters = true;
  flatshard::FullyShard<GPT> unused(gpt_factory()(), world, finding);
  flatshard::optim::AdamW unused_opt(unused, {});
  if (world.world_size() > 1) EXPECT_THROW(unused.step_in_backward(&unused_opt), flatshard::InvalidArgument);
}

// Note [Communication wait]: in every mode, a rank that is late to each step (slow data,
// a slower host) makes the others wait at the engine's collectives; the wait clock charges
// the delay to the ranks that waited, not to the late one.
TEST(FullyShard, CommunicationWaitChargesALateRanksDelayToTheOthers) {
  FLATSHARD_RUN_RANKS({2, 3}, std::chrono::seconds(240));
  auto world = flatshard::init();
  const bool late = world.rank() == 1;
  constexpr int kSteps = 3;
  constexpr double kLateMs = 150;
  for (Strategy strategy :
       {Strategy::NoShard, Strategy::ShardOptimizerState, Strategy::ShardGradOp, Strategy::FullShard}) {
    SCOPED_TRACE(::testing::Message() << to_string(strategy) << " world " << world.world_size());
    flatshard::FullyShardOptions options;
    options.strategy = strategy;
    flatshard::FullyShard<GPT> fsdp(gpt_factory()(), world, options);
    flatshard::optim::AdamW opt(fsdp, {});
    auto step = [&](int s) {
      const auto b = gpt_batch(s, 4 * world.world_size());
      const auto rows = [&](const at::Tensor& t) { return t.narrow(0, 4 * world.rank(), 4); };
      token_loss(fsdp.forward(rows(b.input)), rows(b.target)).backward();
      fsdp.clip_grad_norm(1.0);
      opt.step();
      opt.zero_grad();
    };
    step(0);
    EXPECT_EQ(fsdp.communication_wait().waits, 0) << "timed while off";
    fsdp.time_communication_waits(true);
    for (int s = 1; s <= kSteps; ++s) {
      if (late) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(kLateMs));
      step(s);
    }
    const flatshard::CommunicationWait w = fsdp.communication_wait();
    EXPECT_GE(w.waits, kSteps) << "every step waits for its collectives";
    if (late) {
      EXPECT_LT(w.ms, 0.5 * kSteps * kLateMs) << "rank 1 was the one the others waited for";
    } else {
      EXPECT_GE(w.ms, 0.8 * kSteps * kLateMs) << "rank " << world.rank() << " waited for rank 1";
    }
    // Note [Waiting for peers]: that wait was for a peer, not for the bytes.
    const flatshard::PeerWait split = fsdp.communication_wait_for_peers();
    EXPECT_EQ(split.ms, w.ms);
    EXPECT_EQ(split.waits, w.waits);
    EXPECT_GE(split.peer_ms, 0.0);
    EXPECT_EQ(fsdp.communication_wait_for_peers().peer_ms, split.peer_ms) << "read twice, nothing between";
    if (late) {
      EXPECT_LT(split.peer_ms, 0.5 * kSteps * kLateMs);
    } else {
      EXPECT_GE(split.peer_ms, 0.8 * kSteps * kLateMs) << "rank " << world.rank() << " waited for rank 1";
    }
    fsdp.reset_communication_wait();
    EXPECT_EQ(fsdp.communication_wait().waits, 0);
    fsdp.time_communication_waits(false);
    step(kSteps + 1);
    EXPECT_EQ(fsdp.communication_wait().waits, 0);
  }
}

TEST(FullyShard, Bf16ParametersWithFp32Masters) {
  FLATSHARD_RUN_RANKS({1, 2, 4}, std::chrono::seconds(180));
  auto world = flatshard::init();
  for (auto [reduce, opt] :
       {std::pair{at::kFloat, OptKind::AdamW}, std::pair{at::kBFloat16, OptKind::AdamW},
        std::pair{at::kFloat, OptKind::PlainSGD}, std::pair{at::kBFloat16, OptKind::PlainSGD}}) {
    SCOPED_TRACE(::testing::Message() << "reduce " << c10::toString(reduce) << ", " << to_string(opt));
    TrainSpec spec;
    spec.optimizer = opt;
    spec.param_dtype = at::kBFloat16;
    spec.reduce_dtype = reduce;
    // AdamW with clipping over fp32 shard gradients of bf16 parameters; plain SGD without,
    // where a wrong averaging divisor moves the masters in proportion (clipping every step
    // would cancel it).
    spec.clip = opt == OptKind::AdamW ? 0.25 : 0;
    const auto r = train_and_compare<GPT>(
        world, gpt_factory(), [&](int s) { return gpt_batch(s, 12); }, token_loss, spec);
    if (world.rank() == 0) {
      std::printf(
          "bf16 (reduce %s, %s) world %d: model rel weight diff %.3g, masters %.3g, worst tensor %.3g (%s), "
          "rel "
          "loss diff %.3g\n",
          reduce == at::kFloat ? "fp32" : "bf16", to_string(opt), world.world_size(),
          r.global_rel_weight_diff, r.global_rel_master_diff, r.max_rel_weight_diff, r.worst_param.c_str(),
          r.max_rel_loss_diff);
    }
    // Note [bf16 tolerance]
    // bf16 keeps 8 significant bits: each gathered weight is rounded by up to 2^-9
    // (2e-3) relative, and every activation and gradient op rounds again, so losses
    // differ from fp32 training by about 2e-4 relative (measured). The parameters a user
    // reads back are the bf16 ones, so over the whole model they differ from fp32
    // training by their own rounding: 1.6-1.7e-3 (measured at worlds 1-4, whatever the
    // optimizer), bounded at 5e-3. That floor would hide a wrong averaging divisor, so the
    // fp32 masters are compared too: plain SGD moves each by lr times a gradient bf16
    // rounded, 0.9-2.0e-5 of the model after 4-10 steps (bounded at 5e-5); AdamW turns the
    // gradients' rounding into sign flips of lr-sized updates on small-gradient elements,
    // 3.1-4e-4 (bounded at 1e-3). Summing instead of averaging across two replicas moves
    // the masters by 2e-3 under plain SGD; skipping one unit's gradient for the 10 steps
    // moves the weights by about 1e-2.
    EXPECT_LE(r.global_rel_weight_diff, kBf16Tolerance) << r.worst_param;
    EXPECT_LE(r.max_rel_loss_diff, kBf16Tolerance);
    EXPECT_LE(r.global_rel_master_diff, bf16_master_tolerance(opt));
    // And bf16 is really in use: fp32 runs agree to 1e-6.
    EXPECT_GT(r.max_rel_loss_diff, 1e-6);
    if (spec.clip > 0) EXPECT_GT(r.max_grad_norm, spec.clip) << "the test must actually clip";
  }
}

// A block whose fp32 buffer promotes its bf16 output to fp32, so that the next unit's
// input is fp32 while its weights are bf16, and which takes an optional fp32 gate; the
// head is a unit too.
struct ShiftedBlockImpl : torch::nn::Module {
  explicit ShiftedBlockImpl(int dim)
      : lin(register_module("lin", torch::nn::Linear(dim, dim))),
        shift(register_buffer("shift", torch::full({dim}, 0.25))) {}
  // `gate`, fp32 and optional, scales the input of the matrix product.
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& gate = std::nullopt) {
    return torch::tanh(lin(gate ? x * *gate : x)) + shift;
  }
  torch::nn::Linear lin;
  at::Tensor shift;
};
TORCH_MODULE(ShiftedBlock);

struct ShiftedNetImpl : torch::nn::Module {
  ShiftedNetImpl() {
    for (int i = 0; i < 3; ++i)
      blocks.push_back(register_module("b" + std::to_string(i), flatshard::Unit<ShiftedBlock>(6)));
    head = register_module("head", flatshard::Unit<torch::nn::Linear>(6, 2));
  }
  at::Tensor forward(at::Tensor x) {
    const std::optional<at::Tensor> gate = torch::full({x.size(-1)}, 0.5);
    for (auto& b : blocks) x = b(x, gate);
    return head(x);
  }
  std::vector<flatshard::Unit<ShiftedBlock>> blocks;
  flatshard::Unit<torch::nn::Linear> head{nullptr};
};
TORCH_MODULE(ShiftedNet);

// Note [Casting forward inputs]: under bf16 compute, fp32 features enter the wrapper and an
// fp32 buffer promotes each block's output, yet every unit computes in bf16 and training
// matches fp32 single-process training within bf16's tolerance; the outputs come back in
// MixedPrecision::output. Without the casts the first matrix product refuses the mix.
TEST(FullyShard, MixedPrecisionCastsFloatingInputsToTheComputeDtype) {
  FLATSHARD_RUN_RANKS({1, 2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  auto make = [] {
    torch::manual_seed(5);
    return ShiftedNet();
  };
  auto batch = [](int step, int rows) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(4000 + step);
    return Batch{at::randn({rows, 6}, g), at::randn({rows, 2}, g)};
  };
  for (Strategy strategy : {Strategy::FullShard, Strategy::NoShard}) {
    SCOPED_TRACE(to_string(strategy));
    TrainSpec spec;
    spec.strategy = strategy;
    spec.param_dtype = at::kBFloat16;
    spec.output_dtype = at::kFloat;  // the harness checks every output's dtype
    const auto r = train_and_compare<ShiftedNet>(
        world, make, [&](int s) { return batch(s, spec.global_batch); }, mse, spec);
    EXPECT_LE(r.global_rel_weight_diff, 5e-3) << r.worst_param;  // Note [bf16 tolerance]
    EXPECT_LE(r.max_rel_loss_diff, 5e-3);
    EXPECT_GT(r.max_rel_loss_diff, 1e-6) << "bf16 must really be in use";

    auto options = options_for(strategy);
    options.mixed_precision.param = at::kBFloat16;
    const auto x = batch(0, 4).input;
    {
      auto model = make();
      flatshard::FullyShard<ShiftedNet> fsdp(model, world, options);
      EXPECT_EQ(fsdp.forward(x).scalar_type(), at::kBFloat16) << "no output dtype: as computed";
    }
    options.mixed_precision.cast_forward_inputs = false;
    {
      auto model = make();
      flatshard::FullyShard<ShiftedNet> fsdp(model, world, options);
      EXPECT_THROW(fsdp.forward(x), c10::Error) << "fp32 features against bf16 weights";
    }
    options.mixed_precision.cast_forward_inputs = true;
    options.mixed_precision.output = at::kLong;
    try {
      auto model = make();
      flatshard::FullyShard<ShiftedNet> fsdp(model, world, options);
      ADD_FAILURE() << "an integer output dtype was accepted";
    } catch (const flatshard::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("mixed_precision.output is Long"), std::string::npos) << e.what();
    }
  }
}

// Note [Frozen units]: a GPT fine-tuned with its first block frozen trains as single-process
// training does, and that block costs no gradient: no reduce-scatter (the bytes sent fall
// by exactly one reduce-scatter of its flat buffer), no gradient shard, no optimizer state.
TEST(FullyShard, FrozenUnitsGetNoGradientReductionOrState) {
  FLATSHARD_RUN_RANKS({1, 2, 3}, std::chrono::seconds(120));
  auto world = flatshard::init();
  auto frozen = [](const std::string& name) { return name.rfind("h0.", 0) == 0; };
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp}) {
    SCOPED_TRACE(to_string(strategy));
    // AdamW (its state), and plain SGD, which moves by the gradient itself: a frozen
    // layout that reduced with Sum instead of Avg would show there.
    for (OptKind opt : {OptKind::AdamW, OptKind::PlainSGD}) {
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = opt;
      spec.frozen = frozen;
      const auto r = train_and_compare<GPT>(
          world, gpt_factory(), [&](int s) { return gpt_batch(s, spec.global_batch); }, token_loss, spec);
      EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << to_string(opt) << ": " << r.worst_param;
      EXPECT_LE(r.max_rel_loss_diff, kFp32Tolerance) << to_string(opt);
    }

    struct Step {
      std::uint64_t bytes_sent = 0;
      std::int64_t grad_shard_bytes = 0, state_bytes = 0;
      std::vector<bool> has_grad;
      std::int64_t h0_padded_numel = 0, h0_shard_numel = 0;
    };
    auto step = [&](bool freeze) {
      auto model = gpt_factory()();
      for (auto& item : model->named_parameters()) {
        if (freeze && frozen(item.key())) item.value().requires_grad_(false);
      }
      flatshard::FullyShard<GPT> fsdp(model, world, options_for(strategy));
      flatshard::optim::AdamW opt(fsdp, flatshard::optim::AdamWOptions{1e-3});
      const auto b = gpt_batch(0, 2 * world.world_size());
      const auto rows = [&](const at::Tensor& t) { return t.narrow(0, 2 * world.rank(), 2); };
      Step out;
      const auto before = fsdp.bytes_sent();
      token_loss(fsdp.forward(rows(b.input)), rows(b.target)).backward();
      out.bytes_sent = fsdp.bytes_sent() - before;
      out.grad_shard_bytes = fsdp.memory().grad_shard_bytes;
      const auto shards = fsdp.shards();
      const auto layout = fsdp.layout();
      for (std::size_t k = 0; k < shards.size(); ++k) {
        out.has_grad.push_back(shards[k].grad().defined());
        if (layout[k].params.front().name.rfind("h0.", 0) == 0) {
          out.h0_padded_numel = layout[k].padded_numel;
          out.h0_shard_numel = layout[k].shard_numel;
        }
      }
      opt.step();
      out.state_bytes = opt.state_bytes();
      return out;
    };
    const Step trained = step(false), tuned = step(true);
    ASSERT_GT(tuned.h0_shard_numel, 0);
    for (std::size_t k = 0; k < tuned.has_grad.size(); ++k) EXPECT_TRUE(trained.has_grad[k]) << "shard " << k;
    EXPECT_EQ(std::count(tuned.has_grad.begin(), tuned.has_grad.end(), false), 1)
        << "only h0's shard has none";
    EXPECT_EQ(trained.grad_shard_bytes - tuned.grad_shard_bytes, 4 * tuned.h0_shard_numel);
    EXPECT_EQ(trained.state_bytes - tuned.state_bytes, 8 * tuned.h0_shard_numel) << "AdamW's two moments";
    // What one reduce-scatter of h0's flat gradient sends from this rank (0 over one rank).
    auto comm_options = options_for(strategy).comm;
    comm_options.name = "probe";
    auto comm = flatshard::Communicator::create(world, comm_options);
    const auto input = at::zeros({tuned.h0_padded_numel});
    const auto output = at::empty({tuned.h0_shard_numel});
    const auto before = comm->bytes_sent();
    if (world.world_size() > 1) comm->reduce_scatter(output, input, flatshard::ReduceOp::Avg).wait();
    EXPECT_EQ(trained.bytes_sent - tuned.bytes_sent, comm->bytes_sent() - before);
  }
}

// Low-rank adapters (LoRA) as units of their own inside frozen blocks: each block's unit
// holds only frozen weights, so it gets no gradient shard, while the adapters train.
struct AdapterImpl : torch::nn::Module {
  AdapterImpl(int dim, int rank)
      : down(register_module("down", torch::nn::Linear(torch::nn::LinearOptions(dim, rank).bias(false)))),
        up(register_module("up", torch::nn::Linear(torch::nn::LinearOptions(rank, dim).bias(false)))) {}
  at::Tensor forward(const at::Tensor& x) { return up(down(x)); }
  torch::nn::Linear down, up;
};
TORCH_MODULE(Adapter);

struct AdaptedBlockImpl : torch::nn::Module {
  explicit AdaptedBlockImpl(int dim)
      : base(register_module("base", torch::nn::Linear(dim, dim))),
        adapter(register_module("adapter", flatshard::Unit<Adapter>(dim, 2))) {}
  at::Tensor forward(const at::Tensor& x) { return torch::tanh(base(x) + adapter(x)); }
  torch::nn::Linear base;
  flatshard::Unit<Adapter> adapter;
};
TORCH_MODULE(AdaptedBlock);

// `blocks` units of Block(dim), then a linear head to 3 outputs.
template <typename Block>
struct BlockStackImpl : torch::nn::Module {
  BlockStackImpl(int dim, int count) : head(register_module("head", torch::nn::Linear(dim, 3))) {
    for (int i = 0; i < count; ++i)
      blocks.push_back(register_module("b" + std::to_string(i), flatshard::Unit<Block>(dim)));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = b(x);
    return head(x);
  }
  std::vector<flatshard::Unit<Block>> blocks;
  torch::nn::Linear head;
};
template <typename Block>
struct BlockStack : torch::nn::ModuleHolder<BlockStackImpl<Block>> {
  using torch::nn::ModuleHolder<BlockStackImpl<Block>>::ModuleHolder;
};
using AdaptedNet = BlockStack<AdaptedBlock>;

// A regression batch for a BlockStack of width `dim`, drawn from `seed`.
Batch stack_batch(std::uint64_t seed, int rows, int dim) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return Batch{at::randn({rows, dim}, g), at::randn({rows, 3}, g)};
}

// A fine-tuning (AdamW, the parameters frozen() names frozen) under a strategy matches the
// same fine-tuning in a single process; batch(step, rows) makes a step's global batch.
template <typename Net>
void expect_fine_tuning_matches(const flatshard::World& world, const std::function<Net()>& make,
                                const std::function<Batch(int, int)>& batch,
                                const std::function<bool(const std::string&)>& frozen, Strategy strategy,
                                bool recompute = false) {
  TrainSpec spec;
  spec.strategy = strategy;
  spec.optimizer = OptKind::PlainSGD;  // moves by the gradient: a wrong divisor shows
  spec.frozen = frozen;
  spec.recompute = recompute;
  const auto r = train_and_compare<Net>(
      world, make, [&](int s) { return batch(s, spec.global_batch); }, mse, spec);
  EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << r.worst_param;
  EXPECT_LE(r.max_rel_loss_diff, kFp32Tolerance);
}

TEST(FullyShard, AdaptersAsNestedUnitsTrainBesideFrozenBlocks) {
  FLATSHARD_RUN_RANKS({1, 2, 3}, std::chrono::seconds(120));
  auto world = flatshard::init();
  auto make = [] {
    torch::manual_seed(9);
    return AdaptedNet(8, 3);
  };
  auto batch = [](int step, int rows) { return stack_batch(5000 + step, rows, 8); };
  auto frozen = [](const std::string& name) { return name.find(".base.") != std::string::npos; };
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp}) {
    SCOPED_TRACE(to_string(strategy));
    expect_fine_tuning_matches<AdaptedNet>(world, make, batch, frozen, strategy);
    // Recomputed, the adapters' hooks fire inside each block's reentrant grad, a backward
    // nested in the live one (Note [A backward that failed]: not a failed one).
    expect_fine_tuning_matches<AdaptedNet>(world, make, batch, frozen, strategy, /*recompute=*/true);

    auto model = make();
    for (auto& item : model->named_parameters()) {
      if (frozen(item.key())) item.value().requires_grad_(false);
    }
    flatshard::FullyShard<AdaptedNet> fsdp(model, world, options_for(strategy));
    const auto b = batch(0, world.world_size());
    mse(fsdp.forward(b.input.narrow(0, world.rank(), 1)), b.target.narrow(0, world.rank(), 1)).backward();
    const auto shards = fsdp.shards();
    const auto layout = fsdp.layout();
    ASSERT_EQ(shards.size(), 7u) << "the root, three blocks and three adapters";
    for (std::size_t k = 0; k < shards.size(); ++k) {
      const bool block = frozen(layout[k].params.front().name);
      EXPECT_EQ(shards[k].grad().defined(), !block) << layout[k].params.front().name;
    }
  }
}

// LoRA as PEFT writes it: the adapter is a plain submodule of the block, beside the frozen
// base weight, in one unit. Its backward reaches the adapter's weights before the base
// weight's product has run (autograd runs the later-made nodes first), so the unit's
// frozen weights must stay gathered until the whole unit's backward is done.
struct LoraBlockImpl : torch::nn::Module {
  explicit LoraBlockImpl(int dim)
      : base(register_module("base", torch::nn::Linear(dim, dim))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        down(register_module("down", torch::nn::Linear(torch::nn::LinearOptions(dim, 2).bias(false)))),
        up(register_module("up", torch::nn::Linear(torch::nn::LinearOptions(2, dim).bias(false)))) {}
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor frozen = base(norm(x));  // first, as PEFT's LoRA layers do
    return x + torch::tanh(frozen + up(down(x)));
  }
  torch::nn::Linear base;
  torch::nn::LayerNorm norm;
  torch::nn::Linear down, up;
};
TORCH_MODULE(LoraBlock);

using LoraNet = BlockStack<LoraBlock>;

// Note [Partly frozen units]: each block's frozen base weights form a part of their own,
// gathered and resharded with the block, that gets no gradient, no reduce-scatter, no
// gradient shard and no optimizer state; the adapters and the head train as in a single
// process.
TEST(FullyShard, PartlyFrozenUnitsKeepGradientsAndStateForTheTrainedParametersOnly) {
  FLATSHARD_RUN_RANKS({1, 2, 3}, std::chrono::seconds(120));
  auto world = flatshard::init();
  auto make = [] {
    torch::manual_seed(11);
    return LoraNet(16, 4);
  };
  auto batch = [](int step, int rows) { return stack_batch(7000 + step, rows, 16); };
  auto frozen = [](const std::string& name) {
    return name.find(".base.") != std::string::npos || name.find(".norm.") != std::string::npos;
  };
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp}) {
    for (bool recompute : {false, true}) {
      SCOPED_TRACE(::testing::Message() << to_string(strategy) << (recompute ? " recompute" : ""));
      expect_fine_tuning_matches<LoraNet>(world, make, batch, frozen, strategy, recompute);
    }

    auto model = make();
    std::int64_t trained = 0;
    for (auto& item : model->named_parameters()) {
      if (frozen(item.key())) {
        item.value().requires_grad_(false);
      } else {
        trained += item.value().numel();
      }
    }
    flatshard::FullyShard<LoraNet> fsdp(model, world, options_for(strategy));
    EXPECT_EQ(fsdp.num_units(), 5) << "the root and four blocks";
    flatshard::optim::AdamW opt(fsdp, flatshard::optim::AdamWOptions{1e-3});
    const auto b = batch(0, world.world_size());
    mse(fsdp.forward(b.input.narrow(0, world.rank(), 1)), b.target.narrow(0, world.rank(), 1)).backward();
    const auto shards = fsdp.shards();
    const auto layout = fsdp.layout();
    std::int64_t grad_numel = 0, padded_trained = 0;
    for (std::size_t k = 0; k < shards.size(); ++k) {
      bool any_frozen = false, any_trained = false;
      for (const auto& p : layout[k].params) (frozen(p.name) ? any_frozen : any_trained) = true;
      EXPECT_FALSE(any_frozen && any_trained) << "shard " << k << " mixes frozen and trained parameters";
      EXPECT_EQ(shards[k].grad().defined(), any_trained) << layout[k].params.front().name;
      if (shards[k].grad().defined()) grad_numel += shards[k].grad().numel();
      if (any_trained) padded_trained += layout[k].padded_numel;
    }
    EXPECT_EQ(grad_numel * world.world_size(), padded_trained);
    EXPECT_LT(padded_trained, trained + static_cast<std::int64_t>(shards.size()) * 4 * world.world_size());
    EXPECT_EQ(fsdp.memory().grad_shard_bytes, 4 * grad_numel);
    opt.step();
    EXPECT_EQ(opt.state_bytes(), 8 * grad_numel) << "AdamW's two moments, for the trained parameters only";
  }
}

// Note [Inputs by forward]: both micro-batches' forwards run before either backward. Each
// backward reaches one forward's graph, and a partly frozen block stays gathered until that
// forward's inputs have their gradients (its base weight's product runs after the
// adapters' gradients are in), with or without no_sync between the backwards.
TEST(FullyShard, PartlyFrozenUnitsWaitForTheForwardEachBackwardReaches) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  auto make = [] {
    torch::manual_seed(13);
    return LoraNet(16, 3);
  };
  for (bool reduce_every : {false, true}) {
    SCOPED_TRACE(reduce_every ? "reduce every micro-batch" : "no_sync");
    TrainSpec spec;
    spec.optimizer = OptKind::AdamW;
    spec.frozen = [](const std::string& name) {
      return name.find(".base.") != std::string::npos || name.find(".norm.") != std::string::npos;
    };
    spec.steps = 4;
    spec.micro_batches = 2;
    spec.forwards_first = true;
    spec.reduce_every_micro_batch = reduce_every;
    const auto r = train_and_compare<LoraNet>(
        world, make, [&](int s) { return stack_batch(7100 + s, spec.global_batch, 16); }, mse, spec);
    EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << r.worst_param;
    EXPECT_LE(r.max_rel_loss_diff, kFp32Tolerance);
    if (!reduce_every) expect_no_sync_sends_no_reduction(r, spec, world.world_size());
  }
}

// A wholly frozen unit called twice in one forward (its weights shared, an op between the
// calls): the backward of the second call is done, and the unit resharded, before the
// backward reaches the first call, which gathers it again (Note [Inputs by forward]).
struct CalledTwiceImpl : torch::nn::Module {
  CalledTwiceImpl()
      : first(register_module("first", flatshard::Unit<torch::nn::Linear>(8, 8))),
        shared(register_module("shared", flatshard::Unit<torch::nn::Linear>(8, 8))),
        head(register_module("head", torch::nn::Linear(8, 3))) {}
  at::Tensor forward(at::Tensor x) {
    x = shared(first(x));
    return head(shared(torch::tanh(x)));
  }
  flatshard::Unit<torch::nn::Linear> first, shared;
  torch::nn::Linear head;
};
TORCH_MODULE(CalledTwice);

TEST(FullyShard, AFrozenUnitCalledTwiceIsGatheredForEachCallsBackward) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  auto make = [] {
    torch::manual_seed(17);
    return CalledTwice();
  };
  auto batch = [](int step, int rows) { return stack_batch(7200 + step, rows, 8); };
  auto frozen = [](const std::string& name) { return name.rfind("shared.", 0) == 0; };
  for (Strategy strategy : {Strategy::FullShard, Strategy::ShardGradOp}) {
    SCOPED_TRACE(to_string(strategy));
    expect_fine_tuning_matches<CalledTwice>(world, make, batch, frozen, strategy);
  }
}

// Prefix tuning: a trained vector of the root is passed to every block, whose weights are
// frozen (wholly, or but for a low-rank adapter beside them). The blocks wait for their
// inputs' gradients (Note [Partly frozen units]), and the prefix is a leaf that every
// block uses.
struct PrefixBlockImpl : torch::nn::Module {
  explicit PrefixBlockImpl(int dim)
      : base(register_module("base", torch::nn::Linear(dim, dim))),
        down(register_module("down", torch::nn::Linear(torch::nn::LinearOptions(dim, 2).bias(false)))),
        up(register_module("up", torch::nn::Linear(torch::nn::LinearOptions(2, dim).bias(false)))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& prefix) {
    const at::Tensor frozen = base(x + prefix);
    return x + torch::tanh(frozen + up(down(x)));
  }
  torch::nn::Linear base;
  torch::nn::Linear down, up;
};
TORCH_MODULE(PrefixBlock);

struct PrefixNetImpl : torch::nn::Module {
  PrefixNetImpl(int dim, int count)
      : prefix(register_parameter("prefix", 0.1 * torch::randn({dim}))),
        head(register_module("head", torch::nn::Linear(dim, 3))) {
    for (int i = 0; i < count; ++i)
      blocks.push_back(register_module("b" + std::to_string(i), flatshard::Unit<PrefixBlock>(dim)));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = b(x, prefix);
    return head(x);
  }
  at::Tensor prefix;
  std::vector<flatshard::Unit<PrefixBlock>> blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(PrefixNet);

// The hooks autograd holds on a tensor (a leaf keeps them for good).
std::size_t tensor_hooks(const at::Tensor& t) {
  const auto* meta = torch::autograd::impl::get_autograd_meta(t);
  return meta != nullptr && meta->cpp_hooks_list_ ? meta->cpp_hooks_list_->size() : 0;
}

// Note [Watching a unit's inputs]: a leaf passed to a unit that waits for its inputs'
// gradients is watched through an alias, so no hook stays on it from step to step and each
// block is resharded once its own uses of the leaf are done, not once every block's are.
TEST(FullyShard, ALeafPassedToFrozenUnitsGetsNoHooksAndKeepsNoUnitGathered) {
  FLATSHARD_RUN_RANKS({1, 2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  auto make = [] {
    torch::manual_seed(13);
    return PrefixNet(8, 4);
  };
  auto batch = [](int step, int rows) { return stack_batch(8000 + step, rows, 8); };
  const std::vector<std::pair<std::string, std::function<bool(const std::string&)>>> freezes = {
      {"base weights (adapters train)",
       [](const std::string& n) { return n.find(".base.") != std::string::npos; }},
      {"whole blocks", [](const std::string& n) { return n.rfind("b", 0) == 0; }},
  };
  for (const auto& [what, frozen] : freezes) {
    for (Strategy strategy :
         {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard, Strategy::ShardOptimizerState}) {
      for (bool recompute : {false, true}) {
        if (recompute && strategy != Strategy::FullShard) continue;
        SCOPED_TRACE(::testing::Message()
                     << what << ", " << to_string(strategy) << (recompute ? " recompute" : ""));
        expect_fine_tuning_matches<PrefixNet>(world, make, batch, frozen, strategy, recompute);
      }
    }

    SCOPED_TRACE(what);
    auto model = make();
    for (auto& item : model->named_parameters()) {
      if (frozen(item.key())) item.value().requires_grad_(false);
    }
    flatshard::FullyShard<PrefixNet> fsdp(model, world, options_for(Strategy::FullShard));
    flatshard::optim::AdamW opt(fsdp, flatshard::optim::AdamWOptions{1e-3});
    const at::Tensor prefix = fsdp.module()->prefix;
    ASSERT_TRUE(prefix.is_leaf() && prefix.requires_grad());
    std::size_t hooks_after_first = 0;
    for (int step = 0; step < 6; ++step) {
      const auto b = batch(step, world.world_size());
      opt.zero_grad();
      const at::Tensor loss =
          mse(fsdp.forward(b.input.narrow(0, world.rank(), 1)), b.target.narrow(0, world.rank(), 1));
      fsdp.reset_peaks();
      loss.backward();
      EXPECT_LE(fsdp.peak_gathered_units(), 2)
          << "step " << step << ": the prefetch bound of 1 holds in backward";
      opt.step();
      if (step == 0) hooks_after_first = tensor_hooks(prefix);
    }
    EXPECT_EQ(tensor_hooks(prefix), hooks_after_first) << "hooks pile up on the prefix step after step";
  }
}

}  // namespace

namespace {

// Note [Freezing after wrapping]: a parameter frozen or unfrozen after the wrapper was made
// is refused at the next forward, in every mode, on every rank, naming it; set back, the
// training goes on.
TEST(FullyShard, FreezingOrUnfreezingAfterWrappingIsRefused) {
  FLATSHARD_RUN_RANKS({1, 2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const std::string name = "h0.attn.qkv.weight";
  for (Strategy strategy :
       {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard, Strategy::ShardOptimizerState}) {
    for (bool frozen_before : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << to_string(strategy) << (frozen_before ? ", unfrozen" : ", frozen"));
      GPT model = gpt_factory()();
      at::Tensor param = model->named_parameters()[name];
      param.requires_grad_(!frozen_before);
      flatshard::FullyShard<GPT> fsdp(model, world, options_for(strategy));
      flatshard::optim::AdamW opt(fsdp, flatshard::optim::AdamWOptions{1e-3});
      auto step = [&](int s) {
        const auto b = gpt_batch(s, 2);
        opt.zero_grad();
        token_loss(fsdp.forward(b.input), b.target).backward();
        opt.step();
      };
      step(0);
      param.requires_grad_(frozen_before);
      try {
        step(1);
        FAIL() << "a forward ran with '" << name << "' " << (frozen_before ? "unfrozen" : "frozen")
               << " after wrapping";
      } catch (const flatshard::InvalidArgument& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("parameter '" + name + "' was " + (frozen_before ? "unfrozen" : "frozen") +
                            " (requires_grad set to " + (frozen_before ? "true" : "false") +
                            ") after the model was wrapped"),
                  std::string::npos)
            << what;
        EXPECT_NE(what.find("Set requires_grad before wrapping"), std::string::npos) << what;
      }
      param.requires_grad_(!frozen_before);
      step(2);
    }
  }
}

}  // namespace
