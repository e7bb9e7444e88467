// Token files, samples and the distributed sampler (Note [Sampling by global position]),
// swept over dataset sizes (0, 1, primes, uneven), batch sizes and world sizes 1-8.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "flatshard/checkpoint.h"
#include "flatshard/data.h"

using flatshard::data::DistributedSampler;
using flatshard::data::SamplerOptions;

namespace {

// Every rank's batches for the rest of the epoch, rank by rank, step by step.
std::vector<std::vector<std::vector<std::int64_t>>> rest_of_epoch(std::vector<DistributedSampler>& ranks) {
  std::vector<std::vector<std::vector<std::int64_t>>> out(ranks.size());
  while (ranks[0].batches_left() > 0) {
    for (std::size_t r = 0; r < ranks.size(); ++r) out[r].push_back(ranks[r].next());
  }
  for (auto& s : ranks) EXPECT_TRUE(s.next().empty());
  return out;
}

std::vector<DistributedSampler> world_of(std::int64_t n, int world, SamplerOptions o) {
  std::vector<DistributedSampler> ranks;
  for (int r = 0; r < world; ++r) ranks.emplace_back(n, r, world, o);
  return ranks;
}

std::string temp_file(const std::string& name) {
  return (std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid()))).string();
}

}  // namespace

TEST(Sampler, RanksGetDisjointBatchesThatCoverTheDataOncePerEpoch) {
  for (std::int64_t n : {0, 1, 2, 7, 13, 64, 97}) {
    for (int world = 1; world <= 8; ++world) {
      for (std::int64_t batch : {1, 3, 8}) {
        for (bool drop_last : {false, true}) {
          SamplerOptions o;
          o.batch_size = batch;
          o.drop_last = drop_last;
          o.seed = 5;
          const std::int64_t global = batch * world;
          if (drop_last ? n < global : n == 0) {  // an epoch of no batch: the loop would never end
            EXPECT_THROW(DistributedSampler(n, 0, world, o), flatshard::InvalidArgument)
                << n << " " << global;
            continue;
          }
          auto ranks = world_of(n, world, o);
          const auto batches = rest_of_epoch(ranks);
          std::multiset<std::int64_t> seen;
          for (const auto& rank : batches) {
            for (const auto& b : rank) {
              EXPECT_LE(static_cast<std::int64_t>(b.size()), batch);
              seen.insert(b.begin(), b.end());
            }
          }
          const std::int64_t expected = drop_last ? n / global * global : n;
          EXPECT_EQ(static_cast<std::int64_t>(seen.size()), expected) << n << " " << world << " " << batch;
          EXPECT_EQ(std::set<std::int64_t>(seen.begin(), seen.end()).size(), seen.size()) << "a sample twice";
          for (auto i : seen) EXPECT_TRUE(i >= 0 && i < n);
          // Full batches everywhere but in the last step, where later ranks get fewer.
          for (const auto& rank : batches) {
            for (std::size_t k = 0; k + 1 < rank.size(); ++k)
              EXPECT_EQ(static_cast<std::int64_t>(rank[k].size()), batch);
          }
        }
      }
    }
  }
}

// The documented loop (epoch_done, then next) over uneven ends: a rank whose share of an
// epoch's last batch is empty still moves with the others, and every rank's position is
// the same at every step, so a checkpoint from any rank resumes the same data.
TEST(Sampler, EveryRankMovesTogetherThroughUnevenEnds) {
  SamplerOptions o;
  o.batch_size = 4;
  auto ranks = world_of(16, 3, o);  // epochs of one full global batch of 12, then 4 samples for rank 0 only
  std::vector<std::vector<std::int64_t>> sizes(3);
  for (int step = 0; step < 8;) {
    if (ranks[0].epoch_done()) {
      for (auto& s : ranks) {
        ASSERT_TRUE(s.epoch_done());
        s.set_epoch(s.epoch() + 1);
      }
      continue;
    }
    for (int r = 0; r < 3; ++r) sizes[r].push_back(static_cast<std::int64_t>(ranks[r].next().size()));
    for (auto& s : ranks) {
      EXPECT_EQ(s.epoch(), ranks[0].epoch());
      EXPECT_EQ(s.consumed(), ranks[0].consumed());
    }
    ++step;
  }
  EXPECT_EQ(sizes[0], (std::vector<std::int64_t>{4, 4, 4, 4, 4, 4, 4, 4}));
  EXPECT_EQ(sizes[1], (std::vector<std::int64_t>{4, 0, 4, 0, 4, 0, 4, 0}));
  EXPECT_EQ(sizes[2], (std::vector<std::int64_t>{4, 0, 4, 0, 4, 0, 4, 0}));
  EXPECT_EQ(ranks[0].epoch(), 3);
  auto bad = ranks[0].state();
  bad.consumed = -1;
  EXPECT_THROW(ranks[0].restore(bad), flatshard::InvalidArgument);
}

TEST(Sampler, ShufflesByEpochAndSeedTheSameOnEveryRank) {
  SamplerOptions o;
  o.batch_size = 4;
  o.seed = 1;
  auto epoch_order = [&](std::uint64_t seed, std::int64_t epoch, bool shuffle) {
    SamplerOptions s = o;
    s.seed = seed;
    s.shuffle = shuffle;
    DistributedSampler one(50, 0, 1, s);
    one.set_epoch(epoch);
    std::vector<std::int64_t> all;
    for (auto b = one.next(); !b.empty(); b = one.next()) all.insert(all.end(), b.begin(), b.end());
    return all;
  };
  EXPECT_EQ(epoch_order(1, 0, true), epoch_order(1, 0, true));
  EXPECT_NE(epoch_order(1, 0, true), epoch_order(1, 1, true));
  EXPECT_NE(epoch_order(1, 0, true), epoch_order(2, 0, true));
  std::vector<std::int64_t> in_order(50);
  std::iota(in_order.begin(), in_order.end(), 0);
  EXPECT_EQ(epoch_order(1, 3, false), in_order);
  EXPECT_NE(epoch_order(1, 0, true), in_order);
  // Two ranks together see the one-rank order, rank-major within each global batch.
  auto ranks = world_of(50, 2, [&] {
    SamplerOptions s = o;
    s.batch_size = 2;
    return s;
  }());
  std::vector<std::int64_t> together;
  for (auto a = ranks[0].next(), b = ranks[1].next(); !a.empty(); a = ranks[0].next(), b = ranks[1].next()) {
    together.insert(together.end(), a.begin(), a.end());
    together.insert(together.end(), b.begin(), b.end());
  }
  EXPECT_EQ(together, epoch_order(1, 0, true));
}

TEST(Sampler, ResumesAtTheSameOrAnotherWorldSize) {
  for (int saved_world = 1; saved_world <= 4; ++saved_world) {
    for (int resumed_world = 1; resumed_world <= 4; ++resumed_world) {
      SamplerOptions o;
      o.batch_size = 3;
      o.seed = 9;
      auto first = world_of(100, saved_world, o);
      std::set<std::int64_t> before;
      for (int step = 0; step < 3; ++step) {
        for (auto& s : first) {
          auto b = s.next();
          before.insert(b.begin(), b.end());
        }
      }
      const auto state = first[0].state();
      for (auto& s : first) EXPECT_EQ(s.consumed(), state.consumed);
      auto resumed = world_of(100, resumed_world, o);
      for (auto& s : resumed) s.restore(state);
      const auto after = rest_of_epoch(resumed);
      std::set<std::int64_t> all = before;
      std::size_t count = before.size();
      for (const auto& rank : after) {
        for (const auto& b : rank) {
          all.insert(b.begin(), b.end());
          count += b.size();
        }
      }
      EXPECT_EQ(count, 100u) << saved_world << " -> " << resumed_world << ": no sample skipped or repeated";
      EXPECT_EQ(all.size(), 100u);
      if (resumed_world == saved_world) {
        const auto uninterrupted = rest_of_epoch(first);
        EXPECT_EQ(after, uninterrupted) << "the same batches at the same world size";
      }
    }
  }
  DistributedSampler s(100, 0, 1, {});
  auto other = s.state();
  other.dataset_size = 99;
  EXPECT_THROW(s.restore(other), flatshard::InvalidArgument);
  EXPECT_THROW(DistributedSampler(10, 2, 2, {}), flatshard::InvalidArgument);
  EXPECT_THROW(s.set_epoch(-1), flatshard::InvalidArgument);
}

// A loop that calls set_epoch at the top of every epoch, as PyTorch's do, resumes where the
// checkpoint was saved (Note [set_epoch after restore]); one that names the epoch at every
// step goes on through it (Note [set_epoch names the epoch]).
TEST(Sampler, SetEpochRightAfterRestoreKeepsThePosition) {
  SamplerOptions o;
  o.batch_size = 2;
  o.seed = 4;
  auto run_from = [&](DistributedSampler& s, std::int64_t first_epoch) {
    std::vector<std::vector<std::int64_t>> seen;
    for (std::int64_t epoch = first_epoch; epoch < 3; ++epoch) {
      s.set_epoch(epoch);
      while (!s.epoch_done()) seen.push_back(s.next());
    }
    return seen;
  };
  DistributedSampler whole(20, 1, 2, o);
  const auto uninterrupted = run_from(whole, 0);
  ASSERT_EQ(uninterrupted.size(), 15u);  // 5 global batches an epoch, 3 epochs

  DistributedSampler saved(20, 1, 2, o);
  saved.set_epoch(1);
  std::vector<std::vector<std::int64_t>> before(uninterrupted.begin(), uninterrupted.begin() + 5);
  for (int i = 0; i < 2; ++i) before.push_back(saved.next());  // 2 batches into epoch 1
  DistributedSampler resumed(20, 1, 2, o);
  resumed.restore(saved.state());
  auto after = run_from(resumed, resumed.epoch());
  before.insert(before.end(), after.begin(), after.end());
  EXPECT_EQ(before, uninterrupted) << "no batch of the restored epoch is seen twice or skipped";

  // Once a batch has been dealt, naming the same epoch still keeps the position (Note
  // [set_epoch names the epoch]); another epoch starts from its beginning.
  DistributedSampler again(20, 1, 2, o);
  again.restore(saved.state());
  const auto third = again.next();
  EXPECT_EQ(third, uninterrupted[7]);
  again.set_epoch(1);
  EXPECT_EQ(again.consumed(), 12);
  EXPECT_EQ(again.next(), uninterrupted[8]);
  DistributedSampler other(20, 1, 2, o);
  other.restore(saved.state());
  other.set_epoch(2);
  EXPECT_EQ(other.next(), uninterrupted[10]);
  // Called again before a batch, it still keeps the position; a restore at an epoch's end
  // (a save after the epoch's last batch) goes on to the next epoch.
  DistributedSampler twice(20, 1, 2, o);
  twice.restore(saved.state());
  twice.set_epoch(1);
  twice.set_epoch(1);
  EXPECT_EQ(twice.consumed(), 8);
  EXPECT_EQ(twice.next(), uninterrupted[7]);
  // A loop that counts in steps and names the epoch at every step, as PyTorch's set_epoch
  // allows, sees every epoch's batches once, in order.
  DistributedSampler stepwise(20, 1, 2, o);
  std::vector<std::vector<std::int64_t>> by_step;
  for (int step = 0; step < 15; ++step) {
    stepwise.set_epoch(step / 5);
    by_step.push_back(stepwise.next());
  }
  EXPECT_EQ(by_step, uninterrupted);
  DistributedSampler ended(20, 1, 2, o);
  ended.set_epoch(1);
  while (!ended.epoch_done()) ended.next();
  DistributedSampler after_end(20, 1, 2, o);
  after_end.restore(ended.state());
  const auto rest = run_from(after_end, after_end.epoch());
  ASSERT_EQ(rest.size(), 5u);
  EXPECT_EQ(rest, std::vector<std::vector<std::int64_t>>(uninterrupted.begin() + 10, uninterrupted.end()));
}

TEST(TokenData, ReadsRawAndLlmcFilesIntoSamples) {
  const std::string raw = temp_file("tokens_u16");
  std::vector<std::uint16_t> tokens(101);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint16_t>(i * 613 % 65536);
  std::ofstream(raw, std::ios::binary).write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  const std::string llmc = temp_file("tokens_llmc");
  {
    std::int32_t header[256] = {20240520, 1, static_cast<std::int32_t>(tokens.size())};
    std::ofstream out(llmc, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
    out.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  }
  for (const auto& path : {raw, llmc}) {
    auto file = std::make_shared<flatshard::data::TokenFile>(path);
    ASSERT_EQ(file->size(), 101);
    flatshard::data::TokenDatasetOptions o;
    o.seq_len = 10;
    flatshard::data::TokenDataset dataset(file, o);
    EXPECT_EQ(dataset.size(), 10);  // 10 x (10 + 1) tokens need 101
    const auto b = dataset.get({3, 0});
    for (int t = 0; t < 10; ++t) {
      EXPECT_EQ(b.input[0][t].item<std::int64_t>(), tokens[30 + t]);
      EXPECT_EQ(b.target[0][t].item<std::int64_t>(), tokens[31 + t]);
      EXPECT_EQ(b.input[1][t].item<std::int64_t>(), tokens[t]);
    }
    EXPECT_THROW(dataset.get({10}), flatshard::InvalidArgument);
  }
  // Overlapping samples with a stride; a uint32 file; an odd-sized file refused.
  flatshard::data::TokenDatasetOptions o;
  o.seq_len = 10;
  o.stride = 5;
  EXPECT_EQ(flatshard::data::TokenDataset(std::make_shared<flatshard::data::TokenFile>(raw), o).size(), 19);
  const std::string wide = temp_file("tokens_u32");
  const std::vector<std::uint32_t> big = {70000, 5, 100000, 7};
  std::ofstream(wide, std::ios::binary).write(reinterpret_cast<const char*>(big.data()), big.size() * 4);
  flatshard::data::TokenFileOptions u32;
  u32.dtype = at::kUInt32;
  flatshard::data::TokenFile wide_file(wide, u32);
  EXPECT_TRUE(at::equal(wide_file.read(1, 3), at::tensor(std::vector<std::int64_t>{5, 100000, 7})));
  std::remove(wide.c_str());
  // llm.c's Llama 3 files (magic 20240801, version 7): uint32 tokens whatever the options say.
  const std::string llama3 = temp_file("tokens_llmc_llama3");
  {
    std::int32_t header[256] = {20240801, 7, static_cast<std::int32_t>(big.size())};
    std::ofstream out(llama3, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
    out.write(reinterpret_cast<const char*>(big.data()), big.size() * 4);
  }
  flatshard::data::TokenFile llama3_file(llama3);
  ASSERT_EQ(llama3_file.size(), 4);
  EXPECT_TRUE(at::equal(llama3_file.read(0, 4), at::tensor(std::vector<std::int64_t>{70000, 5, 100000, 7})));
  std::remove(llama3.c_str());
  std::ofstream(raw, std::ios::binary | std::ios::app).put('x');
  EXPECT_THROW(flatshard::data::TokenFile{raw}, flatshard::checkpoint::CheckpointError);
  std::remove(raw.c_str());
  std::remove(llmc.c_str());
}
