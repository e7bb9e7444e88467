// Token files, fixed-length samples and the distributed sampler (include/flatshard/data.h).
#include "flatshard/data.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "flatshard/checkpoint.h"
#include "flatshard/errors.h"
#include "src/io/files.h"

namespace flatshard::data {

using checkpoint::CheckpointError;

namespace {

// llm.c's token files: 256 int32s (magic, version, token count), then the tokens.
constexpr std::int32_t kLlmcMagic = 20240520;        // llm.c's GPT-2 files: version 1, uint16 tokens
constexpr std::int32_t kLlmcLlama3Magic = 20240801;  // its Llama 3 files: version 7, uint32 tokens
constexpr std::int64_t kLlmcHeaderBytes = 256 * 4;

// splitmix64: a small generator whose output is fixed by its seed on every platform (a
// sampler's order must be the same on every rank and after a restart).
std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

// --- TokenFile -----------------------------------------------------------------------------

TokenFile::TokenFile(const std::string& path, const TokenFileOptions& options)
    : path_(path), dtype_(options.dtype) {
  if (dtype_ != at::kUInt16 && dtype_ != at::kUInt32) {
    throw InvalidArgument(
        fmt::format("TokenFile '{}': tokens are kUInt16 or kUInt32, not {}", path, c10::toString(dtype_)));
  }
  const io::Mapping map = io::map_file(path);
  map_ = map.data;
  map_bytes_ = map.bytes;
  // The constructor's failures after the mapping: unmapped here (no destructor runs).
  auto refuse = [&](const std::string& message) {
    io::unmap_file({map_, map_bytes_});
    map_ = nullptr;
    throw CheckpointError(path, message);
  };
  std::int32_t header[3] = {0, 0, 0};
  if (map_bytes_ >= static_cast<std::size_t>(kLlmcHeaderBytes)) std::memcpy(header, map_, sizeof(header));
  std::int64_t data_bytes = static_cast<std::int64_t>(map_bytes_);
  if (header[0] == kLlmcMagic || header[0] == kLlmcLlama3Magic) {
    const bool llama3 = header[0] == kLlmcLlama3Magic;
    const int version = llama3 ? 7 : 1;
    if (header[1] != version) {
      refuse(
          fmt::format("'{}' is an llm.c {} token file of version {}; FlatShard reads version {} ({} tokens)",
                      path, llama3 ? "Llama 3" : "GPT-2", header[1], version, llama3 ? "uint32" : "uint16"));
    }
    dtype_ = llama3 ? at::kUInt32 : at::kUInt16;
    const std::int64_t token_bytes = llama3 ? 4 : 2;
    data_offset_ = kLlmcHeaderBytes;
    data_bytes = std::min<std::int64_t>(data_bytes - kLlmcHeaderBytes, std::int64_t{header[2]} * token_bytes);
    if (header[2] < 0 ||
        std::int64_t{header[2]} * token_bytes > static_cast<std::int64_t>(map_bytes_) - kLlmcHeaderBytes) {
      refuse(fmt::format("'{}' says it holds {} tokens but is {} bytes long: it is truncated", path,
                         header[2], map_bytes_));
    }
  }
  const std::int64_t element = static_cast<std::int64_t>(c10::elementSize(dtype_));
  if (data_bytes % element != 0) {
    refuse(
        fmt::format("'{}' is {} bytes, not a whole number of {}-byte tokens: is it a "
                    "token file, and of that dtype (TokenFileOptions::dtype)?",
                    path, data_bytes, element));
  }
  tokens_ = data_bytes / element;
}

TokenFile::~TokenFile() { io::unmap_file({map_, map_bytes_}); }

at::Tensor TokenFile::read(std::int64_t begin, std::int64_t n) const {
  if (begin < 0 || n < 0 || begin + n > tokens_) {
    throw InvalidArgument(
        fmt::format("TokenFile '{}': tokens [{}, {}) of {}", path_, begin, begin + n, tokens_));
  }
  const std::size_t element = c10::elementSize(dtype_);
  auto raw = at::empty({n}, at::TensorOptions().dtype(dtype_));
  if (n == 0) return raw.to(at::kLong);
  std::memcpy(raw.data_ptr(), map_ + data_offset_ + begin * static_cast<std::int64_t>(element),
              static_cast<std::size_t>(n) * element);
  return raw.to(at::kLong);
}

// --- TokenDataset ----------------------------------------------------------------------------

TokenDataset::TokenDataset(std::shared_ptr<const TokenFile> file, const TokenDatasetOptions& options)
    : file_(std::move(file)), options_(options) {
  if (options_.seq_len < 1 || options_.stride < 0) {
    throw InvalidArgument(fmt::format("TokenDataset: seq_len {} and stride {}: seq_len must be positive",
                                      options_.seq_len, options_.stride));
  }
  if (options_.stride == 0) options_.stride = options_.seq_len;
  // Each sample needs seq_len + 1 tokens (its last target).
  const std::int64_t usable = file_->size() - options_.seq_len - 1;
  samples_ = usable < 0 ? 0 : usable / options_.stride + 1;
}

TokenDataset::Batch TokenDataset::get(const std::vector<std::int64_t>& samples) const {
  const auto n = static_cast<std::int64_t>(samples.size());
  Batch b{at::empty({n, options_.seq_len}, at::kLong), at::empty({n, options_.seq_len}, at::kLong)};
  for (std::int64_t i = 0; i < n; ++i) {
    if (samples[i] < 0 || samples[i] >= samples_) {
      throw InvalidArgument(
          fmt::format("TokenDataset over '{}': sample {} of {}", file_->path(), samples[i], samples_));
    }
    const auto tokens = file_->read(samples[i] * options_.stride, options_.seq_len + 1);
    b.input[i].copy_(tokens.narrow(0, 0, options_.seq_len));
    b.target[i].copy_(tokens.narrow(0, 1, options_.seq_len));
  }
  return b;
}

// --- DistributedSampler ---------------------------------------------------------------------

DistributedSampler::DistributedSampler(std::int64_t dataset_size, int rank, int world_size,
                                       const SamplerOptions& options)
    : size_(dataset_size), rank_(rank), world_size_(world_size), options_(options) {
  if (size_ < 0 || world_size_ < 1 || rank_ < 0 || rank_ >= world_size_ || options_.batch_size < 1) {
    throw InvalidArgument(
        fmt::format("DistributedSampler: dataset size {}, rank {} of {}, batch size {}: the "
                    "size is not negative, the rank within the world, the batch positive",
                    size_, rank_, world_size_, options_.batch_size));
  }
  // An epoch without a batch would make the loop of docs/data.md turn epochs forever.
  const std::int64_t global = options_.batch_size * world_size_;
  if (options_.drop_last ? size_ < global : size_ == 0) {
    throw InvalidArgument(fmt::format(
        "DistributedSampler: {} samples make no batch of {} ({} ranks x batch size {}{}): an epoch would "
        "hold "
        "no step; use a smaller batch or fewer ranks, or more data (a token file shorter than seq_len + 1 "
        "holds no sample)",
        size_, global, world_size_, options_.batch_size, options_.drop_last ? ", drop_last" : ""));
  }
}

DistributedSampler::DistributedSampler(std::int64_t dataset_size, const World& world,
                                       const SamplerOptions& options)
    : DistributedSampler(dataset_size, world.rank(), world.world_size(), options) {}

const std::vector<std::int64_t>& DistributedSampler::order() {
  if (order_epoch_ == epoch_) return order_;
  order_.resize(static_cast<std::size_t>(size_));
  std::iota(order_.begin(), order_.end(), std::int64_t{0});
  if (options_.shuffle) {
    std::uint64_t state = options_.seed ^ (0xD1B54A32D192ED03ull * static_cast<std::uint64_t>(epoch_ + 1));
    for (std::int64_t i = size_ - 1; i > 0; --i) {  // Fisher-Yates
      const auto j = static_cast<std::int64_t>(splitmix64(state) % static_cast<std::uint64_t>(i + 1));
      std::swap(order_[i], order_[j]);
    }
  }
  order_epoch_ = epoch_;
  return order_;
}

std::int64_t DistributedSampler::batches_left() const {
  const std::int64_t global = options_.batch_size * world_size_;
  const std::int64_t left = size_ - consumed_;
  return options_.drop_last ? left / global : (left + global - 1) / global;
}

std::vector<std::int64_t> DistributedSampler::next() {
  if (batches_left() == 0) return {};
  const std::int64_t global = options_.batch_size * world_size_;
  const std::int64_t batch = std::min(global, size_ - consumed_);
  const std::int64_t begin = std::min(batch, rank_ * options_.batch_size);
  const std::int64_t end = std::min(batch, begin + options_.batch_size);
  const auto& o = order();
  std::vector<std::int64_t> mine(o.begin() + consumed_ + begin, o.begin() + consumed_ + end);
  consumed_ += batch;
  restored_ = false;
  return mine;
}

void DistributedSampler::set_epoch(std::int64_t epoch) {
  if (epoch < 0)
    throw InvalidArgument(fmt::format("DistributedSampler::set_epoch: epoch {} is negative", epoch));
  // Note [set_epoch after restore]: a training loop written as PyTorch's are,
  //   for (epoch = start; ...; ++epoch) { sampler.set_epoch(epoch); while (!epoch_done()) ... }
  // calls set_epoch with the restored epoch right after a checkpoint restored the sampler.
  // Starting that epoch over would train again on every sample the saved run had already
  // seen in it; so from restore() until the next batch is dealt, set_epoch naming the
  // restored epoch keeps the position, however often it is called.
  // Note [set_epoch names the epoch]: PyTorch's set_epoch changes nothing when called
  // again with the same epoch, and loops that count in steps call it at every step
  // (set_epoch(step / steps_per_epoch)). So naming the current epoch while batches of it
  // are left keeps the position too; another epoch, or the current one once it is done,
  // starts from the beginning.
  if ((restored_ || batches_left() > 0) && epoch == epoch_) return;
  restored_ = false;
  epoch_ = epoch;
  consumed_ = 0;
}

DistributedSampler::State DistributedSampler::state() const {
  return {epoch_, consumed_, size_, options_.seed, options_.shuffle};
}

void DistributedSampler::restore(const State& s) {
  if (s.epoch < 0 || s.consumed < 0 || s.consumed > s.dataset_size) {
    throw InvalidArgument(
        fmt::format("DistributedSampler (rank {} of {}): the saved position (epoch {}, {} of {} "
                    "samples) is not a position: the checkpoint is damaged",
                    rank_, world_size_, s.epoch, s.consumed, s.dataset_size));
  }
  if (s.dataset_size != size_ || s.seed != options_.seed || s.shuffle != options_.shuffle) {
    throw InvalidArgument(fmt::format(
        "DistributedSampler (rank {} of {}): the saved position is over {} samples with seed {} ({}), this "
        "sampler over {} with seed {} ({}): resume over the same data with the same sampler options",
        rank_, world_size_, s.dataset_size, s.seed, s.shuffle ? "shuffled" : "in order", size_, options_.seed,
        options_.shuffle ? "shuffled" : "in order"));
  }
  epoch_ = s.epoch;
  consumed_ = s.consumed;
  restored_ = true;
}

}  // namespace flatshard::data
