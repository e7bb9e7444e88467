// Sharded checkpoints: exact resumption, resharding across world sizes and modes,
// crash safety (a killed save, a full disk), corruption and mismatches.
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "src/io/shard_files.h"
#include "tests/support/cases.h"
#include "tests/support/multirank.h"
#include "tests/support/wrapped.h"

namespace {

using namespace flatshard::testing;
namespace ckpt = flatshard::checkpoint;
namespace fs = std::filesystem;

using flatshard::mode_name;
using flatshard::Strategy;

Strategy mode_named(const std::string& name) {
  Strategy m;
  if (!flatshard::parse_strategy(name, m)) throw std::invalid_argument("unknown mode " + name);
  return m;
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

constexpr int kGlobalBatch = 12;  // divisible by world sizes 1 to 4
constexpr double kLr = 1e-3, kWeightDecay = 0.1;

// The saving side's seed; every loading side builds its model with kOtherSeed, so that a
// weight or buffer the checkpoint leaves out keeps another value and fails the comparison.
constexpr int kSeed = 11, kOtherSeed = 4242;

// The test model with a buffer (GPTConfig::position_scale_buffer).
GPTConfig checkpoint_config() {
  GPTConfig c = gpt_config();
  c.position_scale_buffer = true;
  return c;
}

GPT seeded_gpt(const GPTConfig& config, int seed = kSeed) {
  torch::manual_seed(seed);
  return GPT(config);
}

flatshard::testing::WrappedOptions test_options() {
  flatshard::testing::WrappedOptions o;
  o.adamw = {kLr, 0.9, 0.999, 1e-8, kWeightDecay};
  o.fully_shard.comm.timeout = std::chrono::seconds(60);
  o.fully_shard.first_bucket_bytes = 2 << 10;  // several buckets
  o.fully_shard.bucket_bytes = 16 << 10;
  return o;
}

// The test model with its first block frozen (fine-tuning): requires_grad off.
// Fine-tuning: the first block frozen, and every block's attention (partly frozen units).
bool frozen_in_fine_tuning(const std::string& name) {
  return name.rfind("h0.", 0) == 0 || name.find(".attn.") != std::string::npos;
}

GPT frozen_for_fine_tuning(GPT model) {
  for (auto& item : model->named_parameters()) {
    if (frozen_in_fine_tuning(item.key())) item.value().requires_grad_(false);
  }
  return model;
}

// The GPT-style test model trained with AdamW under one mode.
struct Trainer : flatshard::testing::Wrapped<GPT> {
  Trainer(const flatshard::World& w, Strategy m, const GPTConfig& config = checkpoint_config(),
          bool freeze = false, int seed = kSeed)
      : Wrapped(freeze ? frozen_for_fine_tuning(seeded_gpt(config, seed)) : seeded_gpt(config, seed), w, m,
                test_options()),
        world(w) {}

  void train(int first_step, int steps) {
    const int n = world.world_size(), local = kGlobalBatch / n;
    for (int s = first_step; s < first_step + steps; ++s) {
      const auto b = gpt_batch(s, kGlobalBatch);
      token_loss(forward(b.input.narrow(0, world.rank() * local, local)),
                 b.target.narrow(0, world.rank() * local, local))
          .backward();
      step();
    }
  }

  flatshard::World world;
};

void expect_identical(const std::map<std::string, at::Tensor>& got,
                      const std::map<std::string, at::Tensor>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << what << ": " << name;
    EXPECT_TRUE(at::equal(got.at(name).to(t.scalar_type()), t)) << what << ": " << name << " differs";
  }
}

void expect_close(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want,
                  double tolerance, const std::string& what) {
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << what << ": " << name;
    const double rel = (got.at(name).to(at::kFloat) - t.to(at::kFloat)).norm().item<double>() /
                       std::max(t.to(at::kFloat).norm().item<double>(), 1e-12);
    EXPECT_LE(rel, tolerance) << what << ": " << name;
  }
}

// Single-process AdamW training on the whole global batch.
std::map<std::string, at::Tensor> reference_params(int steps) {
  auto model = seeded_gpt(checkpoint_config());
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay));
  for (int s = 0; s < steps; ++s) {
    const auto b = gpt_batch(s, kGlobalBatch);
    opt.zero_grad();
    token_loss(model->forward(b.input), b.target).backward();
    opt.step();
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model->named_parameters()) out[item.key()] = item.value().detach().clone();
  for (const auto& item : model->named_buffers()) out[item.key()] = item.value().detach().clone();
  return out;
}

std::string scratch_dir(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return (fs::temp_directory_path() / fmt::format("flatshard-{}-{}-{}", info->name(), name, ::getpid()))
      .string();
}

// Training K steps equals training K/2, saving, loading into fresh objects and training
// K/2 more: bit for bit, at the same world size and mode.
void expect_resume_bit_identical(const flatshard::World& world, bool freeze) {
  constexpr int kSteps = 4;
  for (Strategy mode :
       {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard, Strategy::ShardOptimizerState}) {
    SCOPED_TRACE(mode_name(mode));
    const std::string root = fmt::format("/tmp/flatshard-resume-{}-{}{}-{}", mode_name(mode),
                                         world.world_size(), freeze ? "-frozen" : "", env("MASTER_PORT"));
    Trainer straight(world, mode, checkpoint_config(), freeze);
    straight.train(0, kSteps);
    const auto want = straight.params();
    const auto want_state = straight.adam_state();
    if (freeze) {
      for (const auto& item : seeded_gpt(checkpoint_config())->named_parameters()) {
        if (frozen_in_fine_tuning(item.key()))
          EXPECT_TRUE(at::equal(want.at(item.key()), item.value())) << item.key() << " is frozen";
      }
    }

    {
      Trainer first(world, mode, checkpoint_config(), freeze);
      first.train(0, kSteps / 2);
      const auto info = first.save(root, kSteps / 2);
      EXPECT_EQ(info.step, kSteps / 2);
    }
    Trainer resumed(world, mode, checkpoint_config(), freeze, kOtherSeed);
    const auto info = resumed.load(root);
    EXPECT_EQ(info.step, kSteps / 2);
    EXPECT_EQ(info.world_size, world.world_size());
    resumed.train(kSteps / 2, kSteps / 2);
    expect_identical(resumed.params(), want, "parameters");
    const auto state = resumed.adam_state();
    if (world.rank() == 0) expect_identical(state, want_state, "optimizer state");
    EXPECT_EQ(resumed.shard_optimizer()->state_bytes(), straight.shard_optimizer()->state_bytes())
        << "no state made for a frozen unit when loading";
    resumed.comm().barrier().wait();
    if (world.rank() == 0) fs::remove_all(root);
  }
}

TEST(Checkpoint, ResumeIsBitIdentical) {
  FLATSHARD_RUN_RANKS({1, 2, 3}, std::chrono::seconds(240));
  expect_resume_bit_identical(flatshard::init(), /*freeze=*/false);
}

// Fine-tuning with a frozen block and frozen attention in every block (Note [Frozen
// units], Note [Partly frozen units], Note [Frozen parameters in the replicated
// strategies]): the frozen parameters have no gradient and no optimizer state to save,
// and the resumed run still continues bit for bit, the frozen weights unchanged.
TEST(Checkpoint, ResumeWithFrozenParametersIsBitIdentical) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(240));
  expect_resume_bit_identical(flatshard::init(), /*freeze=*/true);
}

// A fine-tuning's checkpoint (the first block and every block's attention frozen) loads
// into a model that trains every parameter, in every mode: the weights are the saved
// ones, the state of the parameters trained before is the saved one, and the parameters
// frozen before start with no state, as torch::optim starts a parameter it has not stepped.
TEST(Checkpoint, AFineTuningsCheckpointLoadsIntoAFullyTrainedModel) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(240));
  auto world = flatshard::init();
  for (Strategy mode :
       {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard, Strategy::ShardOptimizerState}) {
    SCOPED_TRACE(mode_name(mode));
    const std::string root =
        fmt::format("/tmp/flatshard-unfreeze-{}-{}", mode_name(mode), env("MASTER_PORT"));
    Trainer tuned(world, mode, checkpoint_config(), /*freeze=*/true);
    tuned.train(0, 2);
    tuned.save(root, 2);
    const auto want = tuned.params();
    const auto want_state = tuned.adam_state();
    Trainer full(world, mode, checkpoint_config(), /*freeze=*/false, kOtherSeed);
    full.load(root);
    expect_identical(full.params(), want, "parameters");
    const auto state = full.adam_state();
    if (world.rank() == 0) {
      for (const auto& [name, t] : want_state) {
        ASSERT_TRUE(state.count(name)) << name;
        EXPECT_TRUE(at::equal(state.at(name), t)) << name;
      }
      EXPECT_EQ(state.size(), want_state.size()) << "no state made for the parameters frozen before";
    }
    full.train(2, 1);  // every parameter trains from here
    full.comm().barrier().wait();
    if (world.rank() == 0) fs::remove_all(root);
  }
}

// One phase of ReshardsAcrossWorldSizesAndModes, in its own launch (env says which).
void reshard_phase() {
  auto world = flatshard::init();
  const std::string root = env("FLATSHARD_CKPT_DIR");
  const Strategy mode = mode_named(env("FLATSHARD_CKPT_MODE"));
  constexpr int kSteps = 4;
  const bool saving = env("FLATSHARD_CKPT_PHASE") == "save";
  Trainer t(world, mode, checkpoint_config(), /*freeze=*/false, saving ? kSeed : kOtherSeed);
  if (saving) {
    t.train(0, kSteps / 2);
    t.save(root, kSteps / 2);
    // What was saved, at full size, to compare with after loading.
    auto params = t.params();
    auto state = t.adam_state();
    if (world.rank() == 0) {
      ckpt::save_tensors(params, root + "/expected_params.pt");
      ckpt::save_tensors(state, root + "/expected_state.pt");
    }
    t.comm().barrier().wait();
    return;
  }
  const auto info = t.load(root);
  EXPECT_EQ(info.step, kSteps / 2);
  EXPECT_EQ(info.world_size, std::stoi(env("FLATSHARD_CKPT_SAVED_WORLD")));
  // Loading copies values: exact, whatever the world size or mode that saved them.
  expect_identical(t.params(), ckpt::load_tensors(root + "/expected_params.pt"), "loaded parameters");
  const auto state = t.adam_state();
  if (world.rank() == 0)
    expect_identical(state, ckpt::load_tensors(root + "/expected_state.pt"), "loaded state");
  // Training on matches uninterrupted single-process training (fp32 rounding apart).
  t.train(kSteps / 2, kSteps / 2);
  expect_close(t.params(), reference_params(kSteps), 1e-5, "after resuming");
}

TEST(Checkpoint, ReshardsAcrossWorldSizesAndModes) {
  if (in_rank_mode()) {
    reshard_phase();
    return;
  }
  struct Plan {
    int world;
    Strategy mode;
    std::vector<std::pair<int, Strategy>> loads;
  };
  const std::vector<Plan> plans = {
      {4,
       Strategy::FullShard,
       {{2, Strategy::FullShard},
        {3, Strategy::FullShard},
        {2, Strategy::NoShard},
        {3, Strategy::ShardOptimizerState}}},
      {2, Strategy::FullShard, {{4, Strategy::FullShard}, {3, Strategy::ShardGradOp}}},
      {2, Strategy::NoShard, {{4, Strategy::FullShard}, {3, Strategy::ShardOptimizerState}}},
      {3,
       Strategy::ShardOptimizerState,
       {{4, Strategy::ShardGradOp}, {2, Strategy::NoShard}, {1, Strategy::FullShard}}},
  };
  for (const auto& plan : plans) {
    const std::string root = scratch_dir(fmt::format("{}-{}", plan.world, mode_name(plan.mode)));
    fs::remove_all(root);
    auto launch = [&](int world, Strategy mode, const std::string& phase) {
      LaunchSpec spec;
      spec.ranks = world;
      spec.deadline = std::chrono::seconds(120);
      spec.env = {{"FLATSHARD_CKPT_DIR", root},
                  {"FLATSHARD_CKPT_MODE", mode_name(mode)},
                  {"FLATSHARD_CKPT_PHASE", phase},
                  {"FLATSHARD_CKPT_SAVED_WORLD", std::to_string(plan.world)}};
      const auto r = launch_current_test(spec);
      EXPECT_EQ(r.exit_code, 0) << phase << " at world " << world << " under " << mode_name(mode)
                                << " (saved at world " << plan.world << " under " << mode_name(plan.mode)
                                << ")\n"
                                << r.output;
    };
    launch(plan.world, plan.mode, "save");
    for (const auto& [world, mode] : plan.loads) launch(world, mode, "load");
    fs::remove_all(root);
  }
}

// Note [Checksums per chunk]: a GPT whose embedding and head are just over 8 MiB each (and their
// Adam states), saved at world 1, loads at world 4 reading only the chunks of each piece
// that hold the rank's elements: well under half of the file on every rank (reading each
// piece whole, every rank would read nearly all of it), with the values exact.
void chunked_phase() {
  auto world = flatshard::init();
  const std::string root = env("FLATSHARD_CKPT_DIR");
  GPTConfig big = checkpoint_config();
  big.vocab = 32771;  // pieces of 8 MiB and a few bytes: a short last chunk
  big.dim = 64;
  Trainer t(world, Strategy::FullShard, big);
  if (env("FLATSHARD_CKPT_PHASE") == "save") {
    t.train(0, 1);
    t.save(root, 1);
    if (world.rank() == 0) {
      ckpt::save_tensors(t.params(), root + "/expected_params.pt");
      ckpt::save_tensors(t.adam_state(), root + "/expected_state.pt");
    }
    return;
  }
  std::uintmax_t file_bytes = 0;
  for (const auto& entry : fs::directory_iterator(root + "/step-000000001"))
    if (entry.path().extension() == ".bin") file_bytes += entry.file_size();
  const std::uint64_t before = ckpt::shards::shard_bytes_read();
  t.load(root);
  const std::uint64_t read = ckpt::shards::shard_bytes_read() - before;
  EXPECT_LT(read, file_bytes * 4 / 10) << "rank " << world.rank() << " read " << read << " of " << file_bytes;
  expect_identical(t.params(), ckpt::load_tensors(root + "/expected_params.pt"), "loaded parameters");
  const auto state = t.adam_state();
  if (world.rank() == 0)
    expect_identical(state, ckpt::load_tensors(root + "/expected_state.pt"), "loaded state");
  // A flipped byte inside a chunk fails the load on every rank, naming the chunk.
  t.comm().barrier().wait();
  if (world.rank() == 0) {
    std::fstream f(root + "/step-000000001/shard-00000-of-00001.bin",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(file_bytes / 2));
    const char c = static_cast<char>(f.get() ^ 0x40);
    f.seekp(static_cast<std::streamoff>(file_bytes / 2));
    f.put(c);
  }
  t.comm().barrier().wait();
  try {
    t.load(root);
    ADD_FAILURE() << "a corrupt chunk loaded";
  } catch (const ckpt::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bytes ["), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, AReshardedLoadReadsOnlyTheChunksItNeeds) {
  if (in_rank_mode()) {
    chunked_phase();
    return;
  }
  const std::string root = scratch_dir("chunks");
  fs::remove_all(root);
  for (const auto& [world, phase] : {std::pair{1, "save"}, std::pair{4, "load"}}) {
    LaunchSpec spec;
    spec.ranks = world;
    spec.deadline = std::chrono::seconds(120);
    spec.env = {{"FLATSHARD_CKPT_DIR", root}, {"FLATSHARD_CKPT_PHASE", phase}};
    const auto r = launch_current_test(spec);
    EXPECT_EQ(r.exit_code, 0) << phase << " at world " << world << "\n" << r.output;
  }
  fs::remove_all(root);
}

// Corrupt bytes, a truncated file, broken metadata, another model: each load fails on
// every rank with a CheckpointError that says what is wrong.
TEST(Checkpoint, CorruptionAndMismatchesAreNamed) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const std::string root = fmt::format("/tmp/flatshard-corrupt-{}", env("MASTER_PORT"));
  Trainer t(world, Strategy::FullShard);
  t.train(0, 1);
  const auto info = t.save(root, 1);
  const std::string shard = info.path + "/shard-00001-of-00002.bin";
  const std::string meta = info.path + "/metadata.json";

  auto expect_load_error = [&](const std::string& needle, const std::string& what) {
    Trainer fresh(world, Strategy::FullShard);
    try {
      fresh.load(root);
      ADD_FAILURE() << what << ": loading succeeded";
    } catch (const ckpt::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
    }
  };
  auto on_rank0 = [&](const std::function<void()>& f) {
    t.comm().barrier().wait();
    if (world.rank() == 0) f();
    t.comm().barrier().wait();
  };
  const auto original = fs::file_size(shard);
  std::vector<char> saved(original);
  {
    std::ifstream in(shard, std::ios::binary);
    in.read(saved.data(), static_cast<std::streamsize>(saved.size()));
  }
  auto restore = [&] {
    std::ofstream out(shard, std::ios::binary | std::ios::trunc);
    out.write(saved.data(), static_cast<std::streamsize>(saved.size()));
  };

  on_rank0([&] {  // bytes spread through the file, so that some land in a piece, not in padding
    std::fstream f(shard, std::ios::binary | std::ios::in | std::ios::out);
    for (std::uintmax_t k = 1; k < 64; ++k) {
      f.seekp(static_cast<std::streamoff>(k * original / 64));
      f.put(static_cast<char>(saved[k * original / 64] ^ 0x5a));
    }
  });
  expect_load_error("checksum mismatch", "a flipped byte");
  on_rank0([&] {
    restore();
    fs::resize_file(shard, original / 3);
  });
  expect_load_error("truncated", "a truncated shard file");
  on_rank0(restore);
  {
    Trainer fresh(world, Strategy::FullShard);
    EXPECT_NO_THROW(fresh.load(root));  // restored: loads again, the values saved
    expect_identical(fresh.params(), t.params(), "the restored checkpoint");
  }

  std::string meta_text;
  on_rank0([&] {
    std::ifstream in(meta);
    meta_text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    std::ofstream(meta, std::ios::trunc) << meta_text.substr(0, meta_text.size() / 2);
  });
  expect_load_error("is corrupt", "half a metadata file");
  on_rank0([&] { std::ofstream(meta, std::ios::trunc) << meta_text; });

  // A change that still parses (the step, from 1 to 7) does not match the file's checksum.
  on_rank0([&] {
    auto j = nlohmann::json::parse(meta_text);
    j["step"] = 7;
    std::ofstream(meta, std::ios::trunc) << j.dump(1);
  });
  expect_load_error("does not match its checksum", "metadata.json changed");
  // The checksum is part of a checkpoint of format version 2: one copied without it, with
  // metadata.json as saved, is refused rather than loaded unchecked.
  std::string crc_text;
  on_rank0([&] {
    std::ifstream in(info.path + "/metadata.crc32");
    crc_text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    fs::remove(info.path + "/metadata.crc32");
    std::ofstream(meta, std::ios::trunc) << meta_text;
  });
  expect_load_error("metadata.crc32' is missing", "a checkpoint without its checksum");
  // An index that parses but lies, in a checkpoint of format version 1 (saved before the
  // checksum was): a piece listed twice (its elements would be read twice and others
  // never), a piece far larger than its tensor (one rank's allocation would fail alone),
  // training state of the wrong type (read after the values). Each fails every rank with a
  // CheckpointError naming the rank, within the test's deadline.
  auto with_meta = [&](const std::function<void(nlohmann::json&)>& edit) {
    on_rank0([&] {
      auto j = nlohmann::json::parse(meta_text);
      j["version"] = 1;
      edit(j);
      std::ofstream(meta, std::ios::trunc) << j.dump(1);
    });
  };
  with_meta([](nlohmann::json&) {});  // as saved, but version 1: loads without the checksum
  {
    Trainer fresh(world, Strategy::FullShard);
    EXPECT_NO_THROW(fresh.load(root)) << "a version-1 checkpoint has no checksum to check";
    expect_identical(fresh.params(), t.params(), "the version-1 checkpoint");
  }
  with_meta([](nlohmann::json& j) {
    auto& pieces = j["tensors"]["wte.weight"]["pieces"];
    pieces.push_back(pieces[0]);
  });
  expect_load_error("do not tile", "a piece listed twice");
  with_meta([](nlohmann::json& j) {
    for (auto& [key, t] : j["tensors"].items()) t["pieces"].back()["numel"] = std::int64_t{1} << 61;
  });
  expect_load_error("do not tile", "a piece larger than its tensor");
  with_meta([](nlohmann::json& j) { j["training"] = {{"synced_backwards", nullptr}}; });
  expect_load_error("restoring the training state failed on rank 0 of 2", "training state of the wrong type");
  on_rank0([&] {
    std::ofstream(meta, std::ios::trunc) << meta_text;
    std::ofstream(info.path + "/metadata.crc32", std::ios::trunc) << crc_text;
  });

  // Another model: a wider one (shapes differ) and a deeper one (an extra block).
  GPTConfig wider = checkpoint_config();
  wider.dim = 48;
  GPTConfig deeper = checkpoint_config();
  deeper.layers = 4;
  for (const auto& [config, needle] :
       {std::pair{wider, std::string("parameter 'wte.weight' has shape [64, 48] "
                                     "in the model but [64, 32] in the checkpoint")},
        std::pair{deeper, std::string("the model's parameter 'h3.")}}) {
    Trainer other(world, Strategy::FullShard, config);
    try {
      other.load(root);
      ADD_FAILURE() << "loading into another model succeeded";
    } catch (const ckpt::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  GPTConfig shallow = checkpoint_config();
  shallow.layers = 2;
  Trainer shallower(world, Strategy::NoShard, shallow);
  try {
    shallower.load(root);
    ADD_FAILURE() << "loading into a model with fewer blocks succeeded";
  } catch (const ckpt::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("has parameter 'h2."), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("which the model lacks"), std::string::npos) << e.what();
  }
  t.comm().barrier().wait();
  if (world.rank() == 0) fs::remove_all(root);
}

// Note [Waiting for the other ranks' files]: rank 1 writes its shard 5 seconds slower than
// rank 0 (a slow disk: Note [Injected checkpoint faults]), longer than the training
// collectives' 3-second deadline; the save waits for it and succeeds on both. With
// FLATSHARD_IO_TIMEOUT_S=1 that wait is one second: rank 0 fails with a timeout well before
// rank 1 is done.
TEST(Checkpoint, ASaveWaitsForASlowRankPastTheTrainingDeadline) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const std::string root = fmt::format("/tmp/flatshard-slow-{}", env("MASTER_PORT"));
  auto options = test_options();
  options.fully_shard.comm.timeout = std::chrono::seconds(3);
  Wrapped<GPT> t(seeded_gpt(checkpoint_config(), kSeed), world, Strategy::FullShard, options);
  if (world.rank() == 0) fs::remove_all(root);
  if (world.rank() == 1) ::setenv("FLATSHARD_CHECKPOINT_FAULT", "slow", 1);
  ckpt::SaveOptions o;
  o.step = 1;
  t.comm().barrier().wait();
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(ckpt::save_sharded(root, t.fully_shard(), t.shard_optimizer(), o).path, root + "/step-000000001");
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << "rank 1 was not slow";
  EXPECT_TRUE(fs::exists(root + "/step-000000001/metadata.json"));

  ::setenv("FLATSHARD_IO_TIMEOUT_S", "1", 1);
  o.step = 2;
  t.comm().barrier().wait();
  start = std::chrono::steady_clock::now();
  try {
    ckpt::save_sharded(root, t.fully_shard(), t.shard_optimizer(), o);
    ADD_FAILURE() << "the save succeeded";
  } catch (const flatshard::CommError& e) {  // the communicator is closed from here on
    if (world.rank() == 0) {
      EXPECT_EQ(e.kind(), flatshard::CommError::Kind::Timeout) << e.what();
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4)) << e.what();
    }
  }
  ::unsetenv("FLATSHARD_IO_TIMEOUT_S");
  ::unsetenv("FLATSHARD_CHECKPOINT_FAULT");
  EXPECT_FALSE(fs::exists(root + "/step-000000002"));
  if (world.rank() == 1) {  // the last to finish
    std::error_code ignored;
    fs::remove_all(root, ignored);
  }
}

// A save that cannot finish on rank 1 fails on every rank at once with a CheckpointError
// naming rank 1, leaves nothing under the root, and the previous checkpoint stays the
// latest: rank 1 hits its file-size limit (as on a full disk), its shard file's fsync
// fails (Note [Injected checkpoint faults]), or it cannot read its shards to save (out of
// memory, before save() starts there). A save that goes through afterwards, with keep_last
// 0, removes what a killed save left.
TEST(Checkpoint, AFailedSaveFailsEveryRankAndKeepsThePrevious) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const std::string root = fmt::format("/tmp/flatshard-fulldisk-{}", env("MASTER_PORT"));
  Trainer t(world, Strategy::FullShard);
  t.train(0, 1);
  t.save(root, 1);
  const auto before = t.params();
  t.train(1, 1);
  struct Case {
    const char* fault;  // FLATSHARD_CHECKPOINT_FAULT on rank 1; none: the file-size limit
    const char* on_rank_1;
  };
  for (const Case& c :
       {Case{nullptr, "ulimit -f"}, Case{"fsync", "flushing"},
        Case{"hold", "reading this rank's shards to save: std::bad_alloc (this rank's host memory"}}) {
    SCOPED_TRACE(c.fault ? c.fault : "file-size limit");
    rlimit old{};
    ::getrlimit(RLIMIT_FSIZE, &old);
    if (world.rank() == 1) {
      if (c.fault) {
        ::setenv("FLATSHARD_CHECKPOINT_FAULT", c.fault, 1);
      } else {
        rlimit small = old;
        small.rlim_cur = 4096;
        ::setrlimit(RLIMIT_FSIZE, &small);
      }
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      t.save(root, 2);
      ADD_FAILURE() << "the save succeeded";
    } catch (const ckpt::CheckpointError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("failed on rank 1 of 2"), std::string::npos) << what;  // on rank 1 too
      EXPECT_NE(what.find(c.on_rank_1), std::string::npos) << what;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20))
        << "a rank waited out a deadline";
    ::setrlimit(RLIMIT_FSIZE, &old);
    ::unsetenv("FLATSHARD_CHECKPOINT_FAULT");
    t.comm().barrier().wait();
    EXPECT_FALSE(fs::exists(root + "/step-000000002"));
    EXPECT_FALSE(fs::exists(root + "/.step-000000002.tmp"));
    Trainer fresh(world, Strategy::FullShard);
    EXPECT_EQ(fresh.load(root).step, 1);
    expect_identical(fresh.params(), before, "the previous checkpoint");
    t.comm().barrier().wait();
  }
  // Rank 1's shard file missing, or shorter than its pieces, where rank 0 looks (a root on
  // each node's own disk, writes that did not reach a shared file system): rank 0 refuses to
  // publish, naming rank 1's file, and the previous checkpoint stays the latest.
  for (const bool truncate : {false, true}) {
    ckpt::SaveOptions o;
    o.step = 2;
    o.on_stage = [&](ckpt::SaveStage stage) {
      if (stage != ckpt::SaveStage::ShardWritten || world.rank() != 1) return;
      const std::string mine = root + "/.step-000000002.tmp/shard-00001-of-00002.bin";
      if (truncate) {
        fs::resize_file(mine, fs::file_size(mine) / 2);
      } else {
        fs::remove(mine);
      }
    };
    try {
      ckpt::save_sharded(root, t.fully_shard(), t.shard_optimizer(), o);
      ADD_FAILURE() << "published without rank 1's shard";
    } catch (const ckpt::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(truncate ? "did not all reach" : "which rank 0 cannot see"),
                std::string::npos)
          << e.what();
    }
    t.comm().barrier().wait();
    EXPECT_FALSE(fs::exists(root + "/step-000000002"));
    EXPECT_EQ(Trainer(world, Strategy::FullShard).load(root).step, 1);
  }
  if (world.rank() == 0) fs::create_directories(root + "/.step-000000007.tmp/debris");  // a killed save's
  t.comm().barrier().wait();
  t.save(root, 3, /*keep_last=*/0);
  t.comm().barrier().wait();
  EXPECT_FALSE(fs::exists(root + "/.step-000000007.tmp")) << "a killed save's files stay with keep_last 0";
  EXPECT_TRUE(fs::exists(root + "/step-000000001"));
  EXPECT_TRUE(fs::exists(root + "/step-000000003"));
  t.comm().barrier().wait();
  if (world.rank() == 0) fs::remove_all(root);
}

// Note [One step for every rank]: rank 0's `latest` names the step every rank loads, within
// each rank's own path (and a save sends no rank's index to the others). Here rank 0 loads a copy of the root
// whose `latest` names step 1, rank 1 the root itself, whose `latest` names step 2 (as if a save published it
// between the two reads): both load step 1.
TEST(Checkpoint, EveryRankLoadsTheStepRankZerosLatestNames) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const std::string root = fmt::format("/tmp/flatshard-onestep-{}", env("MASTER_PORT"));
  const std::string copy = root + "-copy";
  Trainer t(world, Strategy::FullShard);
  t.train(0, 1);
  t.save(root, 1, /*keep_last=*/0);
  const auto first = t.params();
  t.train(1, 1);
  // Note [Indexes beside the shards]: the ranks exchange only their failures, whatever the
  // size of their indexes (each several kilobytes here), and none is left beside the shards.
  const std::uint64_t sent = t.comm().bytes_sent();
  t.save(root, 2, /*keep_last=*/0);
  EXPECT_LT(t.comm().bytes_sent() - sent, 512u) << "the save sent its indexes to every rank";
  for (const auto& entry : fs::directory_iterator(root + "/step-000000002"))
    EXPECT_EQ(entry.path().string().find(".index.json"), std::string::npos) << entry.path();
  if (world.rank() == 0) {
    fs::remove_all(copy);
    fs::copy(root, copy, fs::copy_options::recursive);
    std::ofstream(copy + "/latest") << "step-000000001\n";
  }
  t.comm().barrier().wait();
  Trainer fresh(world, Strategy::FullShard);
  EXPECT_EQ(fresh.load(world.rank() == 0 ? copy : root).step, 1);
  expect_identical(fresh.params(), first, "step 1 on every rank");
  t.comm().barrier().wait();
  if (world.rank() == 0) {
    fs::remove_all(root);
    fs::remove_all(copy);
  }
}

// Note [Saving a step again]: a job resumed at its last save saves that step again. The
// step's directory is whole at every stage of the second save (swapped with the new one in
// one rename where the file system can), the second save's values are what loads after
// it, and nothing is left beside it. A save killed after moving the older copy aside (the
// way taken where directories cannot be swapped) leaves it as .step-S.old, and a load
// reads it there.
TEST(Checkpoint, SavingAStepAgainKeepsItWhole) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const std::string root = fmt::format("/tmp/flatshard-again-{}", env("MASTER_PORT"));
  const std::string step_dir = root + "/step-000000001";
  const GPTConfig config{64, 16, 64, 4, 2};  // parameters only: no buffer to fill
  Trainer t(world, Strategy::FullShard, config);
  auto save_filled = [&](float value, const std::function<void(ckpt::SaveStage)>& on_stage) {
    {
      at::NoGradGuard no_grad;
      for (auto& shard : t.fully_shard().shards()) shard.fill_(value);
    }
    ckpt::SaveOptions o;
    o.step = 1;
    o.on_stage = on_stage;
    ckpt::save_sharded(root, t.fully_shard(), t.shard_optimizer(), o);
  };
  auto expect_loads = [&](float value, const std::string& what) {
    Trainer fresh(world, Strategy::FullShard, config);
    EXPECT_EQ(fresh.load(root).step, 1) << what;
    for (const auto& [name, v] : fresh.params())
      EXPECT_TRUE(at::all(v == value).item<bool>()) << what << ": " << name << " does not hold " << value;
  };
  save_filled(1, {});
  std::vector<std::string> missing;  // stages of the second save at which step-1 was not whole
  save_filled(2, [&](ckpt::SaveStage stage) {
    if (world.rank() == 0 && !fs::exists(step_dir + "/metadata.json"))
      missing.push_back(std::to_string(static_cast<int>(stage)));
  });
  EXPECT_TRUE(missing.empty()) << "step-1 had no metadata.json at " << missing.size()
                               << " stages of its second save";
  expect_loads(2, "after saving step 1 again");
  t.comm().barrier().wait();
  for (const auto& entry : fs::directory_iterator(root))
    EXPECT_NE(entry.path().filename().string().rfind(".step-", 0), 0u) << entry.path() << " was left behind";
  t.comm().barrier().wait();
  if (world.rank() == 0) fs::rename(step_dir, root + "/.step-000000001.old");
  t.comm().barrier().wait();
  expect_loads(2, "killed with the older copy moved aside");
  t.comm().barrier().wait();
  if (world.rank() == 0) fs::remove_all(root);
}

// keep_last keeps the newest checkpoints by step, and after a rewind (Note [Keeping
// checkpoints after a rewind]) keeps every one until the run it is on has the highest step
// again: the run it left is replaced step by step, never its own saves.
TEST(Checkpoint, KeepLastKeepsTheRunAJobIsOn) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const std::string root = fmt::format("/tmp/flatshard-keep-{}", env("MASTER_PORT"));
  const GPTConfig config{64, 16, 64, 4, 2};
  Trainer t(world, Strategy::FullShard, config);
  auto save = [&](std::int64_t step, float value) {
    {
      at::NoGradGuard no_grad;
      for (auto& shard : t.fully_shard().shards()) shard.fill_(value);
    }
    ckpt::SaveOptions o;
    o.step = step;
    o.keep_last = 2;
    ckpt::save_sharded(root, t.fully_shard(), t.shard_optimizer(), o);
  };
  auto steps_there = [&] {
    t.comm().barrier().wait();
    std::vector<std::int64_t> numbers;
    for (const auto& entry : fs::directory_iterator(root))
      if (entry.path().filename().string().rfind("step-", 0) == 0)
        numbers.push_back(std::stoll(entry.path().filename().string().substr(5)));
    std::sort(numbers.begin(), numbers.end());
    std::string out;
    for (const auto n : numbers) out += (out.empty() ? "" : " ") + std::to_string(n);
    return out;
  };
  for (int step = 1; step <= 4; ++step) save(step, static_cast<float>(step));
  EXPECT_EQ(steps_there(), "3 4");
  save(1, 11);  // went back to step 1: the run left had steps 3 and 4
  EXPECT_EQ(steps_there(), "1 3 4");
  save(2, 12);
  EXPECT_EQ(steps_there(), "1 2 3 4");
  save(3, 13);
  EXPECT_EQ(steps_there(), "1 2 3 4");
  save(4, 14);  // the highest step again: pruned to this run's newest two
  EXPECT_EQ(steps_there(), "3 4");
  for (const auto& [dir, value] :
       std::vector<std::pair<std::string, float>>{{"/step-000000003", 13}, {"", 14}}) {
    Trainer fresh(world, Strategy::FullShard, config);
    fresh.load(root + dir);
    for (const auto& [name, v] : fresh.params())
      EXPECT_TRUE(at::all(v == value).item<bool>())
          << root + dir << ": " << name << " does not hold " << value;
  }
  // Steps of ten digits and more (a step counted in tokens) are later than nine-digit ones,
  // though their names sort before them as text.
  save(999999999, 15);
  save(1000000000, 16);
  EXPECT_EQ(steps_there(), "999999999 1000000000");
  save(1000000001, 17);
  EXPECT_EQ(steps_there(), "1000000000 1000000001");
  {
    Trainer fresh(world, Strategy::FullShard, config);
    EXPECT_EQ(fresh.load(root).step, 1000000001);
  }
  t.comm().barrier().wait();
  if (world.rank() == 0) fs::remove_all(root);
}

// A checkpoint whose optimizer kept state (SGD's momentum buffer) does not load into an
// optimizer that keeps none: it would drop the buffer and then, its momentum restored
// from the checkpoint's groups, start a new one from zero. The same optimizer loads it.
TEST(Checkpoint, StateTheOptimizerWouldDropIsRefused) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const std::string root = fmt::format("/tmp/flatshard-momentum-{}", env("MASTER_PORT"));
  const GPTConfig config{64, 16, 64, 4, 2};
  auto with_sgd = [](double momentum) {
    auto o = test_options();
    o.sgd = flatshard::optim::SGDOptions{0.1, momentum};
    return o;
  };
  flatshard::testing::Wrapped<GPT> saved(seeded_gpt(config, kSeed), world, Strategy::FullShard,
                                         with_sgd(0.9));
  const auto b = gpt_batch(0, kGlobalBatch);
  const int local = kGlobalBatch / 2;
  token_loss(saved.forward(b.input.narrow(0, world.rank() * local, local)),
             b.target.narrow(0, world.rank() * local, local))
      .backward();
  saved.step();
  saved.save(root, 1);
  flatshard::testing::Wrapped<GPT> plain(seeded_gpt(config, kOtherSeed), world, Strategy::FullShard,
                                         with_sgd(0));
  try {
    plain.load(root);
    ADD_FAILURE() << "a momentum buffer was dropped";
  } catch (const ckpt::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("holds optimizer state 'momentum_buffer'"), std::string::npos)
        << e.what();
  }
  flatshard::testing::Wrapped<GPT> same(seeded_gpt(config, kOtherSeed), world, Strategy::FullShard,
                                        with_sgd(0.9));
  EXPECT_EQ(same.load(root).step, 1);
  saved.comm().barrier().wait();
  if (world.rank() == 0) fs::remove_all(root);
}

// A buffer and a parameter with no elements are each saved as one empty piece, which the
// index check takes as tiling its nothing; their neighbours load as before. (Before, the
// empty parameter was written by no rank, and the checkpoint that saved without an error
// failed to load.)
TEST(Checkpoint, AnEmptyBufferAndAnEmptyParameterSaveAndLoad) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const std::string root = fmt::format("/tmp/flatshard-empty-{}", env("MASTER_PORT"));
  auto with_empty = [](int seed) {
    auto model = seeded_gpt(checkpoint_config(), seed);
    model->register_buffer("nothing", at::zeros({0}));
    model->register_parameter("none", at::zeros({0, 4}));
    return model;
  };
  flatshard::testing::Wrapped<GPT> saved(with_empty(kSeed), world, Strategy::FullShard, test_options());
  saved.save(root, 1);
  flatshard::testing::Wrapped<GPT> loaded(with_empty(kOtherSeed), world, Strategy::FullShard, test_options());
  EXPECT_EQ(loaded.load(root).step, 1);
  expect_identical(loaded.params(), saved.params(), "a model with an empty buffer");
  saved.comm().barrier().wait();
  if (world.rank() == 0) fs::remove_all(root);
}

// Ranks killed (SIGKILL, all at once: rank 0 kills the launcher, and every rank dies with
// it) inside the save of step kKilledStep, at each stage of Note [Checkpoint directories]:
// the root's latest checkpoint always loads, holds the values of the step it names, and
// names the step the stage implies.
constexpr int kKilledStep = 3;

TEST(Checkpoint, KilledDuringSaveLeavesALoadableCheckpoint) {
  const std::vector<std::pair<std::string, ckpt::SaveStage>> stages{
      {"shard-written", ckpt::SaveStage::ShardWritten},
      {"metadata-written", ckpt::SaveStage::MetadataWritten},
      {"renamed", ckpt::SaveStage::Renamed},
      {"published", ckpt::SaveStage::Published}};
  if (in_rank_mode()) {
    auto world = flatshard::init();
    const std::string root = env("FLATSHARD_CKPT_DIR");
    const std::string stage = env("FLATSHARD_CKPT_KILL_AT");
    Trainer t(world, Strategy::FullShard, GPTConfig{64, 16, 64, 4, 2});
    if (env("FLATSHARD_CKPT_PHASE") == "loop") {
      at::NoGradGuard no_grad;
      for (int step = 1; step <= kKilledStep; ++step) {
        for (auto& s : t.fully_shard().shards()) s.fill_(static_cast<float>(step));
        ckpt::SaveOptions o;
        o.step = step;
        if (world.rank() == 0 && step == kKilledStep) {
          o.on_stage = [&](ckpt::SaveStage reached) {
            for (const auto& [name, at] : stages) {
              if (name == stage && at == reached) {
                ::kill(::getppid(), SIGKILL);  // every rank dies with the launcher (PR_SET_PDEATHSIG)
                ::raise(SIGKILL);
              }
            }
          };
        }
        ckpt::save_sharded(root, t.fully_shard(), t.shard_optimizer(), o);
      }
      return;  // not killed: the parent's test fails on the exit code
    }
    const auto info = t.load(root);
    // Until root/latest names step 3, the last complete and published step is 2.
    EXPECT_EQ(info.step, stage == "published" ? kKilledStep : kKilledStep - 1);
    for (const auto& [name, value] : t.params()) {
      EXPECT_TRUE(at::all(value == static_cast<float>(info.step)).item<bool>())
          << name << " does not hold step " << info.step << "'s values";
    }
    return;
  }
  for (const auto& [stage, at] : stages) {
    SCOPED_TRACE("killed once the save reached: " + stage);
    const std::string root = scratch_dir("killed-" + stage);
    fs::remove_all(root);
    LaunchSpec loop;
    loop.ranks = 2;
    loop.deadline = std::chrono::seconds(60);
    loop.env = {
        {"FLATSHARD_CKPT_DIR", root}, {"FLATSHARD_CKPT_PHASE", "loop"}, {"FLATSHARD_CKPT_KILL_AT", stage}};
    const auto killed = launch_current_test(loop);
    EXPECT_EQ(killed.exit_code, 128 + SIGKILL) << killed.output;
    // What the kill left behind: the step's temporary directory until it is renamed.
    const bool left_tmp = fs::exists(fmt::format("{}/.step-{:09d}.tmp", root, kKilledStep));
    const bool in_place = fs::exists(fmt::format("{}/step-{:09d}", root, kKilledStep));
    const bool before_rename = stage == "shard-written" || stage == "metadata-written";
    EXPECT_EQ(left_tmp, before_rename);
    EXPECT_EQ(in_place, !before_rename);
    LaunchSpec check;
    check.ranks = 2;
    check.deadline = std::chrono::seconds(60);
    check.env = {
        {"FLATSHARD_CKPT_DIR", root}, {"FLATSHARD_CKPT_PHASE", "check"}, {"FLATSHARD_CKPT_KILL_AT", stage}};
    const auto r = launch_current_test(check);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    fs::remove_all(root);
  }
}

}  // namespace
