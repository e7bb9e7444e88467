// Data that resumes: a run stopped at a checkpoint and resumed (new model, optimizer and
// sampler, loaded from it) sees exactly the batches of the run that did not stop, across an
// epoch boundary, and trains to bit-identical weights.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tests/support/cases.h"
#include "tests/support/multirank.h"

namespace {

using namespace flatshard::testing;
namespace ckpt = flatshard::checkpoint;
namespace data = flatshard::data;
namespace fs = std::filesystem;

// A token file of `n` tokens below the test GPT's vocabulary, written by this rank.
std::string token_file(int rank, std::int64_t n) {
  const auto path = fs::temp_directory_path() / fmt::format("flatshard_tokens_{}_{}", ::getpid(), rank);
  std::vector<std::uint16_t> tokens(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    tokens[i] = static_cast<std::uint16_t>((i * 7 + i / 13) % gpt_config().vocab);
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(tokens.data()), n * 2);
  return path.string();
}

struct Training {
  GPT model{nullptr};
  std::unique_ptr<flatshard::FullyShard<GPT>> fsdp;
  std::unique_ptr<flatshard::optim::AdamW> opt;
  std::unique_ptr<data::DistributedSampler> sampler;
  std::int64_t step = 0;
  std::vector<std::vector<std::int64_t>> seen;  // this rank's batches, step by step

  Training(const flatshard::World& world, flatshard::Strategy strategy, std::int64_t samples, int seed) {
    torch::manual_seed(seed);
    model = GPT(gpt_config());
    fsdp =
        std::make_unique<flatshard::FullyShard<GPT>>(model, world, options_for(strategy, world.world_size()));
    opt = std::make_unique<flatshard::optim::AdamW>(*fsdp, flatshard::optim::AdamWOptions{1e-2});
    data::SamplerOptions o;
    o.batch_size = 2;
    o.seed = 17;
    o.drop_last = true;
    sampler = std::make_unique<data::DistributedSampler>(samples, world, o);
  }
  void train_until(std::int64_t last, const data::TokenDataset& dataset) {
    while (step < last) {
      if (sampler->epoch_done()) {
        sampler->set_epoch(sampler->epoch() + 1);
        continue;
      }
      auto batch = sampler->next();
      seen.push_back(batch);
      const auto b = dataset.get(batch);
      token_loss(fsdp->forward(b.input), b.target).backward();
      opt->step();
      opt->zero_grad();
      ++step;
    }
  }
};

}  // namespace

TEST(Data, AResumedRunSeesTheSameBatchesAndTrainsToTheSameWeights) {
  FLATSHARD_RUN_RANKS({2, 3}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const std::string path = token_file(world.rank(), 350);
  data::TokenDatasetOptions o;
  o.seq_len = gpt_config().context;
  const data::TokenDataset dataset(std::make_shared<data::TokenFile>(path), o);
  ASSERT_EQ(dataset.size(), 21);  // (350 - 17) / 16 + 1: 5 (world 2) or 3 (world 3) global batches an epoch
  const std::string root =
      (fs::temp_directory_path() / fmt::format("flatshard_data_{}", world.world_size())).string();
  for (auto strategy : {flatshard::Strategy::FullShard, flatshard::Strategy::NoShard}) {
    if (world.rank() == 0) fs::remove_all(root);
    constexpr std::int64_t kStop = 5, kSteps = 12;  // stops at an epoch's end (world 2) or inside one (3)
    Training whole(world, strategy, dataset.size(), 11);
    whole.train_until(kSteps, dataset);

    Training first(world, strategy, dataset.size(), 11);
    first.train_until(kStop, dataset);
    ckpt::SaveOptions save;
    save.step = kStop;
    save.sampler = first.sampler.get();
    ckpt::save_sharded(root, *first.fsdp, first.opt.get(), save);

    Training resumed(world, strategy, dataset.size(),
                     4242);  // another seed: everything comes from the checkpoint
    ckpt::LoadOptions load;
    load.sampler = resumed.sampler.get();
    resumed.step = ckpt::load_sharded(root, *resumed.fsdp, resumed.opt.get(), load).step;
    EXPECT_EQ(resumed.sampler->epoch(), first.sampler->epoch());
    EXPECT_EQ(resumed.sampler->consumed(), first.sampler->consumed());
    resumed.train_until(kSteps, dataset);

    auto batches = first.seen;
    batches.insert(batches.end(), resumed.seen.begin(), resumed.seen.end());
    EXPECT_EQ(batches, whole.seen) << flatshard::to_string(strategy);
    EXPECT_GE(whole.sampler->epoch(), 2) << "the run crosses epochs";
    const auto want = ckpt::full_master_state_dict(*whole.fsdp, -1);
    for (const auto& [name, t] : ckpt::full_master_state_dict(*resumed.fsdp, -1))
      EXPECT_TRUE(at::equal(t, want.at(name))) << name << " under " << flatshard::to_string(strategy);
    // A checkpoint without a sampler's position refuses to give one.
    ckpt::SaveOptions bare;
    bare.step = kSteps;
    ckpt::save_sharded(root, *whole.fsdp, whole.opt.get(), bare);
    EXPECT_THROW(ckpt::load_sharded(root, *resumed.fsdp, resumed.opt.get(), load), ckpt::CheckpointError);
    whole.fsdp->comm().barrier().wait();
  }
  if (world.rank() == 0) fs::remove_all(root);
  ::unlink(path.c_str());
}
