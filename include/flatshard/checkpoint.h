// Checkpoints: full state dicts that Python's torch.load reads, written atomically.
//
//   auto state = flatshard::checkpoint::full_state_dict(fsdp, *model);   // a collective
//   if (world.rank() == 0) flatshard::checkpoint::save_tensors(state, "model.pt");
//   # python: torch.load("model.pt", weights_only=True) -> {name: tensor}
//
// A file is written to a temporary name beside it, flushed to disk (fsync), renamed
// over the target and the directory synced: after a crash the path holds either the
// old complete file or the new complete one.
//
// Sharded checkpoints (every rank writes its own shards, in parallel; they load at any
// world size and under any mode):
//   flatshard::checkpoint::save_sharded("ckpt", fsdp, &opt, {.step = 100});
//   flatshard::checkpoint::load_sharded("ckpt", fsdp, &opt);   // the newest one
// See docs/checkpoints.md.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "flatshard/errors.h"
#include "flatshard/fully_shard.h"
#include "flatshard/grad_scaler.h"
#include "flatshard/optim.h"
#include "flatshard/schedule.h"

namespace flatshard::data {
class DistributedSampler;
}

namespace flatshard::checkpoint {

// Saving or loading failed: the path, the system's reason and what to do. A failed
// save leaves the previous file at the path untouched.
class CheckpointError : public Error {
 public:
  CheckpointError(std::string path, const std::string& message) : Error(message), path_(std::move(path)) {}
  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
};

// The model's parameters (under their own names) and buffers, at full size and in the
// parameters' dtype, on rank `to` (every rank when to == -1; empty elsewhere). A
// collective: every rank calls it. Streamed one flat group at a time: besides its shards a
// rank holds one group at full size, and only rank `to` the whole dict.
std::map<std::string, at::Tensor> full_state_dict(FullyShardBase& fsdp, torch::nn::Module& model, int to = 0);

// The optimizer's state over FullyShard's shards, consolidated: "<parameter>.<state>"
// (exp_avg, exp_avg_sq, momentum_buffer) at the parameter's shape, "<parameter>.step",
// "step" (the most of any parameter), and each group's hyperparameters as
// "param_groups.<group>.<name>" (lr, weight_decay, ...); with a scheduler,
// "scheduler.steps" and "scheduler.base_lr.<group>"; with a scaler, "scaler.scale" and
// "scaler.growth_tracker". On rank `to` (every rank when to == -1; empty elsewhere). A
// collective.
std::map<std::string, at::Tensor> full_optimizer_state_dict(FullyShardBase& fsdp,
                                                            const optim::ShardOptimizer& optimizer,
                                                            int to = 0,
                                                            const optim::LRScheduler* scheduler = nullptr,
                                                            const optim::GradScaler* scaler = nullptr);

// The fp32 master values, what the optimizer steps, at full size under the parameters'
// names: the model's full-precision weights, where full_state_dict gives the parameters
// as computed with (rounded to bf16 under mixed_precision.param = kBFloat16). Every
// parameter that trains, and the frozen ones. On rank `to` (every rank when to == -1;
// empty elsewhere). A collective.
std::map<std::string, at::Tensor> full_master_state_dict(FullyShardBase& fsdp, int to = 0);

// A dict of tensors in the format of torch.save, written atomically.
void save_tensors(const std::map<std::string, at::Tensor>& tensors, const std::string& path);
// Reads what save_tensors (or Python's torch.save of a dict of tensors) wrote.
std::map<std::string, at::Tensor> load_tensors(const std::string& path);

// How far a sharded save has got (SaveOptions::on_stage). The stages of Note [Checkpoint
// directories] in src/io/shard_save.cpp.
enum class SaveStage {
  Copied,           // every rank: writing begins (an AsyncSaver's: its host copy is made)
  ShardWritten,     // every rank: its shard file is written and synced in root/.step-<S>.tmp/
  MetadataWritten,  // rank 0: metadata.json too; complete, not yet in place
  Renamed,          // rank 0: root/step-<S>/ is in place; root/latest still names the previous
  Published,        // rank 0: root/latest names it; older ones beyond keep_last go next
};

struct SaveOptions {
  // Training step: recorded in the metadata, and names the directory (step-<step>).
  std::int64_t step = 0;
  // Complete checkpoints kept under the root, this one included (0: keep all).
  int keep_last = 2;
  // Saved with the optimizer's groups (their hyperparameters) when given.
  const optim::LRScheduler* scheduler = nullptr;
  const optim::GradScaler* scaler = nullptr;
  // The data's position (data.h): a run resumed from it sees the batches this one would.
  const data::DistributedSampler* sampler = nullptr;
  // Called on each rank as its part of the save passes each stage: progress reports, and
  // the crash tests' points to kill a job at. It must not throw.
  std::function<void(SaveStage)> on_stage;
};

// What load_sharded restores besides the model and the optimizer.
struct LoadOptions {
  optim::LRScheduler* scheduler = nullptr;      // its step and base rates
  optim::GradScaler* scaler = nullptr;          // its scale and growth tracker
  data::DistributedSampler* sampler = nullptr;  // its epoch and position (at any world size)
};

// What was saved or loaded.
struct CheckpointInfo {
  std::string path;  // the step directory
  std::int64_t step = 0;
  int world_size = 0;  // of the run that saved it
  std::string mode;    // the saving run's strategy ("FullShard", "NoShard", ...)
};

// Sharded checkpoint under `root`: root/step-<step>/ holds metadata.json (names, shapes,
// dtypes, element ranges, files, CRC-32s, world size, strategy, step, the buckets' order,
// format version) and one shard file per rank; root/latest names the newest complete
// one. Each rank writes what it owns: its slice of every flat group (ranks holding the
// same slice, under HybridShard and NoShard, write a share of it each); rank 0 also the
// buffers. Parameters are saved in fp32 (the masters). The registered communication
// hook's state (comm_hooks.h: error-feedback residuals, PowerSGD's factors) is saved per
// rank, and load_sharded gives it back to the hook registered then, at the same world
// size (at another the hook starts afresh). A collective; a failure on any
// rank throws CheckpointError on every rank and leaves the previous checkpoint as it was.
CheckpointInfo save_sharded(const std::string& root, FullyShardBase& fsdp,
                            const optim::ShardOptimizer* optimizer, const SaveOptions& options = {});

// Asynchronous sharded checkpoints: save() blocks only while this rank's share of the
// shards, the optimizer state and the buffers is copied to host memory (page-locked on a
// GPU), then a thread of this saver writes, checksums and commits it (save_sharded's
// format and crash safety; the previous checkpoint stays the latest until every rank's
// files are complete) while training goes on. What is saved is the state at the call:
// training may change every weight as soon as save() returns.
//
//   flatshard::checkpoint::AsyncSaver saver(fsdp);   // a collective: its own communicator
//   for (...) {
//     ... step ...
//     if (step % 100 == 0) saver.save("ckpt", &opt, {.step = step});
//   }
//   saver.wait();                                     // the last one complete
//
// The commit is collective over the saver's own communicator (never the one training
// uses), so the writing thread's messages never interleave with training's. One save at a
// time: the next save() (and wait()) first waits for the one in flight, and a failure in
// the background (a full disk, a dead rank) surfaces there, as CheckpointError on every
// rank naming the file. SaveOptions::on_stage runs on the writing thread. See
// docs/checkpoints.md#asynchronous-saves.
struct AsyncSaverOptions {
  // The deadline of the saver's collectives: how long a rank waits for the other ranks'
  // files (one that hangs mid-save). At least 30 minutes unless FLATSHARD_IO_TIMEOUT_S
  // says otherwise (Note [Waiting for the other ranks' files] in src/io/shard_save.cpp).
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
};

class AsyncSaver {
 public:
  explicit AsyncSaver(FullyShardBase& fsdp, const AsyncSaverOptions& options = {});
  // Waits for a save in flight; its failure is logged, not thrown.
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  // A collective: every rank calls it with the same step.
  void save(const std::string& root, const optim::ShardOptimizer* optimizer, const SaveOptions& options = {});
  // Waits for the save in flight and returns what it saved (the last save's when none is in
  // flight); its failure throws CheckpointError, on every rank alike (the commit agreed on it).
  CheckpointInfo wait();
  bool in_flight() const;  // a save not yet waited for
  // How long the last save() blocked its caller (ms): the host copy, and the wait for the
  // save before it.
  double last_blocking_ms() const;
  // The bytes of the last host copy (this rank's).
  std::int64_t last_copy_bytes() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Loads a sharded checkpoint saved at any world size and under any strategy. `path` is a
// root (its latest checkpoint) or a step directory. Names and shapes must match the
// model: the first mismatch is named. Every piece read is checked against its CRC-32.
// The optimizer (may be null) must keep the kinds of state that were saved; without
// optimizer state in the checkpoint it is left as it is. A collective.
// The optimizer's groups are matched by name and get their saved hyperparameters (the
// learning rate included), as torch's load_state_dict restores param_groups.
CheckpointInfo load_sharded(const std::string& path, FullyShardBase& fsdp, optim::ShardOptimizer* optimizer,
                            const LoadOptions& options = {});

// --- whole models from and to files (docs/hugging-face.md) ---------------------------------

struct LoadModelOptions {
  // Tensors in the source that the model lacks: refused, naming the first (false), or
  // skipped (true).
  bool ignore_unexpected = false;
};

// Loads a whole model's tensors into the wrapped model, under every strategy: its
// parameters into the fp32 masters (converting from the source's dtype: a bf16 file into
// fp32 masters) and its buffers where the source holds them. Each rank reads only the
// elements it holds, so no rank ever holds the whole model (the replicated strategies
// hold whole tensors, as they always do). Every parameter must be in the source with its
// shape: the first one missing or of another shape is named. A collective: a failure on
// any rank throws CheckpointError on every rank. `path` is a Hugging Face model directory
// (model.safetensors, or model.safetensors.index.json and the files it names) or one
// .safetensors file.
void load_hf(const std::string& path, FullyShardBase& fsdp, const LoadModelOptions& options = {});
// The same from a whole state dict in memory, on every rank (a torch.save file read with
// load_tensors, a full_state_dict): each rank copies the elements it holds.
void load_full_state_dict(const std::map<std::string, at::Tensor>& state, FullyShardBase& fsdp,
                          const LoadModelOptions& options = {});

struct SaveModelOptions {
  // config.json's text, written beside the weights when not empty (the model's
  // configuration: LlamaConfig::hf_config_json() in models/llama.h).
  std::string config_json;
  // The files' floating-point dtype (kBFloat16 halves them); the masters are fp32.
  at::ScalarType dtype = at::kFloat;
  // A model whose files would exceed this is split into model-0000k-of-0000n.safetensors
  // with model.safetensors.index.json, as save_pretrained splits it.
  std::int64_t max_file_bytes = std::int64_t{5} << 30;
  int to = 0;  // the rank that writes
};

// Writes the whole model as a Hugging Face model directory: safetensors files of the
// parameters (from the fp32 masters, in `dtype`) and buffers under their names, and
// config.json. Streamed one flat group at a time through rank `to` (Note [Streaming full
// state dicts]): its peak is one group at full size beyond its shards. Each file appears
// whole or not at all. A collective; a failure on rank `to` (a full disk) throws
// CheckpointError on every rank.
void save_hf(const std::string& dir, FullyShardBase& fsdp, const SaveModelOptions& options = {});

}  // namespace flatshard::checkpoint
