// Communication hooks: how the replicated strategies (NoShard and ShardOptimizerState,
// DDP's and ZeRO-1's) reduce a bucket of gradients, as DDP's register_comm_hook.
//
//   flatshard::FullyShard fsdp(model, world, {.strategy = flatshard::Strategy::NoShard});
//   fsdp.register_comm_hook(flatshard::hooks::top_k({.ratio = 0.01}));   // every rank
//
// A hook gets each bucket as it is ready, in bucket order on every rank, starts its
// collectives on the wrapper's communicator (on any of its streams) and says what to do
// once they complete; the engine waits for them off the backward's path, as it waits for
// its own all-reduce. See docs/communication.md.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "flatshard/communicator.h"

namespace flatshard {

// One bucket of gradients, handed to a hook.
struct GradBucket {
  int index = 0;          // the bucket's number, the same on every rank
  std::int64_t step = 0;  // synced backwards before this one (0 in the first)
  at::Tensor buffer;      // this rank's flat gradients; the hook leaves their average over ranks here
  struct Param {
    std::string name;
    std::vector<std::int64_t> shape;
    std::int64_t offset = 0;  // in `buffer`, elements
  };
  std::vector<Param> params;  // the parameters in the bucket, in buffer order
};

// What a hook has started.
struct HookWork {
  std::vector<Work> works;       // the collectives, waited for in order
  std::function<void()> finish;  // then this, on the engine's thread: the average into the buffer
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  // The hook and its settings, the same on every rank (register_comm_hook checks).
  virtual std::string describe() const = 0;
  // Starts reducing `bucket` over `comm` (every rank calls it for the same buckets in the
  // same order).
  virtual HookWork reduce(Communicator& comm, const GradBucket& bucket) = 0;
  // What it carries from step to step (error-feedback residuals, PowerSGD's factors), by
  // name, for checkpoints; and its restoration.
  virtual std::map<std::string, at::Tensor> state() const { return {}; }
  virtual void load_state(const std::map<std::string, at::Tensor>& /*state*/) {}
  // Whether it reduces CUDA buckets. Every hook of flatshard::hooks does; a hook of one's
  // own that computes on host tensors says false, and register_comm_hook refuses it on a
  // CUDA wrapper.
  virtual bool runs_on_cuda() const { return true; }
};

namespace hooks {

// The plain average (what the engine does without a hook; bit for bit the same).
std::shared_ptr<CommHook> all_reduce();

// Gradients cross the wire in a 16-bit float type (bf16 or fp16), divided by the world
// size first so that fp16 sums do not overflow; PyTorch's bf16/fp16_compress_hook.
struct LowPrecisionOptions {
  at::ScalarType dtype = at::kBFloat16;
};
std::shared_ptr<CommHook> low_precision(const LowPrecisionOptions& options = {});

// 8-bit quantization: each chunk of `chunk_numel` elements is sent as int8 with one fp32
// scale (its largest magnitude / 127), all-gathered, and every rank averages the ranks'
// dequantized values. A chunk holding a NaN or an infinity averages to NaN, so that
// GradScaler and FullyShardOptions::nonfinite_grads see it.
struct QuantizeOptions {
  std::int64_t chunk_numel = 256;
};
std::shared_ptr<CommHook> quantize_8bit(const QuantizeOptions& options = {});

// Sparsification: of each bucket only k = ceil(ratio * numel) elements are sent. top_k
// sends the k largest in magnitude with their indices (all-gathered); random_k sends k
// elements at positions every rank draws alike from (seed, step, bucket), values only
// (all-reduced). With error feedback what was not sent is kept and added to the next
// step's gradient (EF-SGD), so nothing is lost, only delayed.
struct SparsifyOptions {
  double ratio = 0.01;
  bool error_feedback = true;
  std::uint64_t seed = 0;  // random_k only
};
std::shared_ptr<CommHook> top_k(const SparsifyOptions& options = {});
std::shared_ptr<CommHook> random_k(const SparsifyOptions& options = {});

// PowerSGD (Vogels et al., 2019; PyTorch's powerSGD_hook): each parameter of two or more
// dimensions, viewed as a matrix M (its first dimension by the rest), is sent as two
// thin factors of rank `rank`: P = M Q is averaged and orthonormalized, Q = M^T P is
// averaged, and every rank applies P Q^T. Q is kept from step to step (warm start);
// error feedback keeps M - P Q^T for the next step. Parameters of one dimension, and
// matrices too small to gain, are averaged uncompressed. The first `start_step` synced
// backwards are averaged uncompressed (the early gradients change too fast for a
// low-rank warm start).
struct PowerSGDOptions {
  int rank = 4;
  std::int64_t start_step = 10;
  bool warm_start = true;
  bool error_feedback = true;
  std::uint64_t seed = 0;  // Q's first values, the same on every rank
};
std::shared_ptr<CommHook> power_sgd(const PowerSGDOptions& options = {});

// A hook from a command-line spec: none (nullptr), all_reduce, bf16, fp16,
// int8[:CHUNK_NUMEL], top_k:RATIO, random_k:RATIO, power_sgd:RANK[:START_STEP]
// (sparsifiers with error feedback). Throws InvalidArgument for anything else.
std::shared_ptr<CommHook> parse(const std::string& spec);

}  // namespace hooks
}  // namespace flatshard
