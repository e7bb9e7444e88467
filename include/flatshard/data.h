// Training data for language models: token files read through a memory map, fixed-length
// samples cut from them, and a distributed sampler whose position checkpoints save.
//
//   flatshard::data::TokenFile tokens("train.bin");                 // nanoGPT / llm.c format
//   flatshard::data::TokenDataset dataset(tokens, {.seq_len = 1024});
//   flatshard::data::DistributedSampler sampler(dataset.size(), world,
//                                               {.batch_size = 8, .seed = 0, .drop_last = true});
//   while (true) {
//     if (sampler.epoch_done()) { sampler.set_epoch(sampler.epoch() + 1); continue; }
//     auto batch = sampler.next();            // this rank's sample indices
//     auto [input, target] = dataset.get(batch);
//     ...
//   }
//   checkpoint::save_sharded(dir, fsdp, &opt, {.step = s, .sampler = &sampler});
//
// See docs/data.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "flatshard/world.h"

namespace flatshard::data {

struct TokenFileOptions {
  // Raw tokens of this dtype (kUInt16, as nanoGPT's prepare.py writes them, or kUInt32 for
  // vocabularies past 65536). A file that starts with llm.c's header (magic 20240520,
  // 256 int32s) is read by its header instead, whatever this says.
  at::ScalarType dtype = at::kUInt16;
};

// A file of tokens, memory-mapped read-only. Throws checkpoint::CheckpointError naming the
// file when it cannot be read or its size is not a whole number of tokens.
class TokenFile {
 public:
  explicit TokenFile(const std::string& path, const TokenFileOptions& options = {});
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  std::int64_t size() const { return tokens_; }  // tokens
  at::ScalarType dtype() const { return dtype_; }
  // Tokens [begin, begin + n) as int64.
  at::Tensor read(std::int64_t begin, std::int64_t n) const;

 private:
  std::string path_;
  const char* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  std::int64_t data_offset_ = 0;  // bytes before the first token
  std::int64_t tokens_ = 0;
  at::ScalarType dtype_;
};

struct TokenDatasetOptions {
  std::int64_t seq_len = 256;  // tokens per sample (and as many targets, shifted by one)
  // Tokens between the starts of consecutive samples (0: seq_len, samples that do not overlap).
  std::int64_t stride = 0;
};

// Fixed-length samples of a token file: sample i is tokens [i * stride, i * stride +
// seq_len) and, as its targets, the same shifted by one token.
class TokenDataset {
 public:
  TokenDataset(std::shared_ptr<const TokenFile> file, const TokenDatasetOptions& options);
  std::int64_t size() const { return samples_; }
  std::int64_t seq_len() const { return options_.seq_len; }
  struct Batch {
    at::Tensor input, target;  // [samples, seq_len] int64
  };
  Batch get(const std::vector<std::int64_t>& samples) const;

 private:
  std::shared_ptr<const TokenFile> file_;
  TokenDatasetOptions options_;
  std::int64_t samples_ = 0;
};

struct SamplerOptions {
  std::int64_t batch_size = 1;  // samples per rank per batch
  bool shuffle = true;          // a permutation per epoch, drawn from (seed, epoch)
  std::uint64_t seed = 0;
  // An epoch's last global batch, when smaller than world * batch_size: dropped (true), or
  // dealt out in order, so that later ranks get fewer samples or none (false; train through
  // it under flatshard::Join).
  bool drop_last = false;
};

// Note [Sampling by global position]: each epoch orders the dataset (a permutation drawn
// from the seed and the epoch, or in order); global batch k is the next world * batch_size
// samples of that order, and rank r takes the r-th run of batch_size of them. Every rank
// therefore gets disjoint samples, the world together sees each sample once per epoch,
// and the position is one number, the samples consumed this epoch: a run resumed from it
// sees exactly the batches of the run that saved it at the same world size, and at another
// world size continues with the next sample, skipping and repeating none.
class DistributedSampler {
 public:
  DistributedSampler(std::int64_t dataset_size, int rank, int world_size, const SamplerOptions& options = {});
  DistributedSampler(std::int64_t dataset_size, const World& world, const SamplerOptions& options = {});

  // Every global batch of this epoch has been dealt (set_epoch starts the next). The same
  // on every rank.
  bool epoch_done() const { return batches_left() == 0; }
  // This rank's next batch of sample indices; the position moves by the whole global
  // batch. Smaller, or empty, only in an epoch's last global batch without drop_last (train
  // through it under Join); empty too once the epoch is done.
  std::vector<std::int64_t> next();
  // Starts epoch `epoch` from its beginning, unless it names the current epoch while batches
  // of it are left: then the position stays, as PyTorch's set_epoch changes nothing when
  // called again (a loop may call it every step: Note [set_epoch names the epoch]); and
  // after restore(), naming the restored epoch keeps its restored position, so that a loop
  // that calls set_epoch at the top of every epoch resumes where the checkpoint was saved
  // (Note [set_epoch after restore]).
  void set_epoch(std::int64_t epoch);

  std::int64_t epoch() const { return epoch_; }
  std::int64_t consumed() const { return consumed_; }  // samples of this epoch, all ranks together
  std::int64_t dataset_size() const { return size_; }
  // Global batches left in this epoch (the last may be partial, unless dropped).
  std::int64_t batches_left() const;
  const SamplerOptions& options() const { return options_; }

  // The position, as checkpoints save it (SaveOptions::sampler), and back. Restoring checks
  // that the dataset size and seed are those saved (InvalidArgument otherwise).
  struct State {
    std::int64_t epoch = 0, consumed = 0, dataset_size = 0;
    std::uint64_t seed = 0;
    bool shuffle = true;
  };
  State state() const;
  void restore(const State& state);

 private:
  const std::vector<std::int64_t>& order();

  std::int64_t size_;
  int rank_, world_size_;
  SamplerOptions options_;
  std::int64_t epoch_ = 0, consumed_ = 0;
  bool restored_ = false;            // restore() ran and no batch has been dealt since
  std::vector<std::int64_t> order_;  // this epoch's, made when first needed
  std::int64_t order_epoch_ = -1;
};

}  // namespace flatshard::data
