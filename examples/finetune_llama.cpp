// Fine-tunes a Hugging Face Llama-family model: loads its directory straight into shards,
// trains on a token file (a distributed sampler whose position checkpoints keep), saves
// sharded checkpoints and resumes from them, and exports a Hugging Face directory that
// transformers loads.
//
//   flatshard-run -n 4 build/examples/finetune_llama --model Llama-3.2-1B --data train.bin \
//       --steps 1000 --ckpt out/ckpt --save-every 100 --out out/tuned
//
// Options (defaults in brackets):
//   --model DIR             a Hugging Face Llama directory (config.json, safetensors)
//   --data FILE             tokens: raw uint16 (nanoGPT's .bin), llm.c's format, or raw
//                           uint32 with --tokens-u32
//   --mode full|zero2|zero1|ddp|hybrid [full]
//   --seq-len N [64] --batch N [2]   tokens per sample; samples per rank per step
//   --steps N [20] --lr X [1e-4] --warmup N [steps / 10] --min-lr-ratio X [0.1]
//                           AdamW (betas 0.9, 0.95; weight decay 0.1 except norms and
//                           embeddings), warm-up then cosine decay, gradients clipped to 1
//   --precision fp32|bf16 [fp32]   compute dtype (fp32 masters and optimizer state either way)
//   --freeze A,B,...        parameters whose name contains one of these stay as loaded
//   --ckpt DIR --save-every N [0] --resume   sharded checkpoints: model, optimizer, schedule
//                           and the data's position; --resume continues from DIR's latest
//   --stop-at N             save and stop after step N (an interrupted run, for resuming)
//   --out DIR               export the tuned model there (safetensors, config.json, and the
//                           source's generation_config.json and tokenizer files)
//   --export-dtype fp32|bf16 [fp32]
//   --logits FILE           rank 0 writes the tuned model's logits on the first sample and
//                           that sample's tokens ({"logits", "tokens"}, safetensors)
//   --embedding-units       the embedding and head as units of their own
//
// Prints the loss as it trains, and each rank's memory while loading and exporting (the
// counting allocator's peak above what the rank held before) against the whole model's
// fp32 size.
#include <ATen/Parallel.h>

#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "flatshard/flatshard.h"
#include "flatshard/plan.h"
#include "models/llama.h"

using flatshard::models::LlamaConfig;
using flatshard::models::LlamaForCausalLM;
namespace ckpt = flatshard::checkpoint;
namespace optim = flatshard::optim;

namespace {

struct Args {
  std::string model, data, mode = "full", ckpt, out, logits, precision = "fp32", export_dtype = "fp32";
  int seq_len = 64, batch = 2, steps = 20, warmup = -1, save_every = 0, stop_at = -1;
  double lr = 1e-4, min_lr_ratio = 0.1;
  std::vector<std::string> freeze;
  bool resume = false, tokens_u32 = false, embedding_units = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument("missing value for " + k);
      return argv[++i];
    };
    if (k == "--model")
      a.model = next();
    else if (k == "--data")
      a.data = next();
    else if (k == "--mode")
      a.mode = next();
    else if (k == "--seq-len")
      a.seq_len = std::stoi(next());
    else if (k == "--batch")
      a.batch = std::stoi(next());
    else if (k == "--steps")
      a.steps = std::stoi(next());
    else if (k == "--lr")
      a.lr = std::stod(next());
    else if (k == "--warmup")
      a.warmup = std::stoi(next());
    else if (k == "--min-lr-ratio")
      a.min_lr_ratio = std::stod(next());
    else if (k == "--precision")
      a.precision = next();
    else if (k == "--ckpt")
      a.ckpt = next();
    else if (k == "--save-every")
      a.save_every = std::stoi(next());
    else if (k == "--stop-at")
      a.stop_at = std::stoi(next());
    else if (k == "--resume")
      a.resume = true;
    else if (k == "--out")
      a.out = next();
    else if (k == "--export-dtype")
      a.export_dtype = next();
    else if (k == "--logits")
      a.logits = next();
    else if (k == "--tokens-u32")
      a.tokens_u32 = true;
    else if (k == "--embedding-units")
      a.embedding_units = true;
    else if (k == "--freeze") {
      std::stringstream list(next());
      for (std::string part; std::getline(list, part, ',');) {
        if (!part.empty()) a.freeze.push_back(part);
      }
    } else {
      throw std::invalid_argument("unknown option " + k +
                                  " (see the comment at the top of finetune_llama.cpp)");
    }
  }
  if (a.model.empty() || a.data.empty())
    throw std::invalid_argument("--model DIR and --data FILE are needed");
  if ((a.resume || a.stop_at >= 0 || a.save_every > 0) && a.ckpt.empty())
    throw std::invalid_argument("--resume, --stop-at and --save-every need --ckpt DIR");
  if (a.precision != "fp32" && a.precision != "bf16")
    throw std::invalid_argument("--precision is fp32 or bf16");
  if (a.export_dtype != "fp32" && a.export_dtype != "bf16")
    throw std::invalid_argument("--export-dtype is fp32 or bf16");
  if (a.warmup < 0) a.warmup = std::max(1, a.steps / 10);
  return a;
}

double mib(std::int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// Runs f and returns the counting allocator's peak above what was live before it.
template <typename F>
std::int64_t peak_during(F&& f) {
  const auto before = flatshard::memory::allocator_stats().current_bytes;
  flatshard::memory::reset_allocator_peak();
  f();
  return flatshard::memory::allocator_stats().peak_bytes - before;
}

// Every rank's figure, on rank 0, as "a, b, c".
std::string per_rank(flatshard::Communicator& comm, std::int64_t mine) {
  auto all = at::empty({comm.world_size()}, at::kLong);
  comm.all_gather(all, at::tensor({mine}, at::kLong)).wait();
  std::string out;
  for (int r = 0; r < comm.world_size(); ++r)
    out += fmt::format("{}{:.2f}", r ? ", " : "", mib(all[r].item<std::int64_t>()));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "finetune_llama: %s\n", e.what());
    return 2;
  }
  at::set_num_threads(1);
  flatshard::memory::install_counting_allocator();
  try {
    auto world = flatshard::init();
    const int rank = world.rank();
    flatshard::FullyShardOptions options;
    if (!flatshard::parse_strategy(a.mode, options.strategy))
      throw flatshard::InvalidArgument("--mode is full, zero2, zero1, ddp or hybrid");
    if (a.precision == "bf16") {
      options.mixed_precision.param = at::kBFloat16;
      options.mixed_precision.reduce = at::kFloat;
    }
    LlamaConfig cfg = LlamaConfig::from_hf_config(a.model);
    cfg.embedding_units = a.embedding_units;
    const bool sharded = options.strategy != flatshard::Strategy::NoShard &&
                         options.strategy != flatshard::Strategy::ShardOptimizerState;

    // Built straight into shards (sharded strategies): no rank holds the whole model.
    LlamaForCausalLM model{nullptr};
    // The initial values are replaced by the loaded ones, but every rank builds the same
    // (BuildIntoShards compares the units across ranks as they are built).
    torch::manual_seed(0);
    if (sharded) {
      flatshard::BuildIntoShards build(world, options);
      model = LlamaForCausalLM(cfg);
    } else {
      model = LlamaForCausalLM(cfg);
    }
    int frozen = 0;  // tensors
    for (auto& item : model->named_parameters()) {
      for (const auto& part : a.freeze) {
        if (item.key().find(part) == std::string::npos) continue;
        item.value().requires_grad_(false);
        ++frozen;
        break;
      }
    }
    flatshard::FullyShard<LlamaForCausalLM> fsdp(model, world, options);
    const auto layout = fsdp.layout();
    std::int64_t params = 0;
    for (const auto& l : layout) {
      for (const auto& p : l.params) params += p.numel;
    }
    // The planner's figures for loading and exporting, from the wrapper's layout (the
    // parameters are already sharded: plan::shape_of would see them empty).
    flatshard::plan::ModelShape shape;
    for (std::size_t i = 0; i < layout.size(); ++i) {
      std::int64_t numel = 0;
      for (const auto& p : layout[i].params) {
        numel += p.numel;
        shape.largest_param_numel = std::max(shape.largest_param_numel, p.numel);
      }
      if (i == 0 && sharded) {
        shape.root_numel = numel;
      } else {
        shape.unit_numels.push_back(numel);
      }
    }
    flatshard::plan::PlanOptions po;
    po.strategy = options.strategy;
    po.world_size = world.world_size();
    const auto planned = flatshard::plan::predict(shape, po);
    const std::int64_t held = planned.params + planned.masters + planned.optimizer_state;
    auto& comm = fsdp.comm();
    const std::int64_t load_peak = peak_during([&] { ckpt::load_hf(a.model, fsdp); });
    const std::string load_peaks = per_rank(comm, load_peak);
    if (rank == 0) {
      std::printf(
          "loaded %s: %lld parameters (%.2f MiB in fp32; %d layers, dim %d, %d heads, %d kv heads, vocab "
          "%d), %s at %d ranks\n",
          a.model.c_str(), static_cast<long long>(params), mib(4 * params), cfg.layers, cfg.dim, cfg.heads,
          cfg.kv_heads, cfg.vocab, flatshard::to_string(options.strategy), world.world_size());
      if (frozen > 0) std::printf("frozen: %d parameter tensors (--freeze)\n", frozen);
      std::printf("load: each rank's allocations beyond its shards peaked at (MiB) %s; planned: %.2f\n",
                  load_peaks.c_str(), mib(planned.load_whole - held));
    }

    flatshard::data::TokenFileOptions token_options;
    if (a.tokens_u32) token_options.dtype = at::kUInt32;
    flatshard::data::TokenDatasetOptions dataset_options;
    dataset_options.seq_len = a.seq_len;
    const flatshard::data::TokenDataset dataset(
        std::make_shared<flatshard::data::TokenFile>(a.data, token_options), dataset_options);
    flatshard::data::SamplerOptions sampler_options;
    sampler_options.batch_size = a.batch;
    sampler_options.drop_last = true;  // every rank trains every step
    flatshard::data::DistributedSampler sampler(dataset.size(), world, sampler_options);
    if (sampler.batches_left() == 0) {
      throw flatshard::InvalidArgument(
          fmt::format("--data {} holds {} samples of {} tokens: fewer than one global batch ({} ranks x {})",
                      a.data, dataset.size(), a.seq_len, world.world_size(), a.batch));
    }

    const optim::AdamWOptions decay{a.lr, 0.9, 0.95, 1e-8, 0.1};
    optim::AdamWOptions no_decay = decay;
    no_decay.weight_decay = 0;
    optim::AdamW opt(fsdp, decay, {{"no_decay", optim::biases_norms_embeddings(), no_decay}});
    optim::LRScheduler schedule(
        opt, a.warmup < a.steps
                 ? optim::warmup_then(a.warmup, optim::cosine(a.steps - a.warmup, a.min_lr_ratio))
                 : optim::linear_warmup(a.warmup));
    auto save = [&](int step) {
      ckpt::SaveOptions so;
      so.step = step;
      so.scheduler = &schedule;
      so.sampler = &sampler;
      return ckpt::save_sharded(a.ckpt, fsdp, &opt, so);
    };
    int step = 0;
    if (a.resume && std::filesystem::exists(std::filesystem::path(a.ckpt) / "latest")) {
      ckpt::LoadOptions lo;
      lo.scheduler = &schedule;
      lo.sampler = &sampler;
      const auto info = ckpt::load_sharded(a.ckpt, fsdp, &opt, lo);
      step = static_cast<int>(info.step);
      if (rank == 0)
        std::printf("resumed from %s: step %d, epoch %lld, %lld samples into it\n", info.path.c_str(), step,
                    static_cast<long long>(sampler.epoch()), static_cast<long long>(sampler.consumed()));
    }

    auto loss_avg = at::zeros({1}, at::kDouble);
    const int last = a.stop_at >= 0 ? std::min(a.stop_at, a.steps) : a.steps;
    while (step < last) {
      if (sampler.epoch_done()) {
        sampler.set_epoch(sampler.epoch() + 1);
        continue;
      }
      const auto samples = sampler.next();
      const auto batch = dataset.get(samples);
      const auto logits = fsdp.forward(batch.input);
      auto loss = torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                            batch.target.reshape({-1}));
      loss.backward();
      fsdp.clip_grad_norm(1.0);
      const double lr = opt.lr(0);
      opt.step();
      schedule.step();
      opt.zero_grad();
      ++step;
      loss_avg.fill_(loss.item<double>());
      comm.all_reduce(loss_avg, flatshard::ReduceOp::Avg).wait();
      if (rank == 0 && (step % std::max(1, a.steps / 10) == 0 || step == last)) {
        std::printf("step %d/%d  loss %.4f  lr %.3g  epoch %lld\n", step, a.steps, loss_avg.item<double>(),
                    lr, static_cast<long long>(sampler.epoch()));
        std::fflush(stdout);
      }
      if (!a.ckpt.empty() && ((a.save_every > 0 && step % a.save_every == 0) || step == last)) {
        const auto info = save(step);
        if (rank == 0 && step == last) std::printf("saved %s\n", info.path.c_str());
      }
    }
    if (step < a.steps) return 0;  // --stop-at: resume later

    if (!a.out.empty()) {
      ckpt::SaveModelOptions so;
      so.config_json = cfg.hf_config_json(a.export_dtype == "bf16" ? "bfloat16" : "float32");
      so.dtype = a.export_dtype == "bf16" ? at::kBFloat16 : at::kFloat;
      const std::int64_t export_peak = peak_during([&] { ckpt::save_hf(a.out, fsdp, so); });
      const std::string export_peaks = per_rank(comm, export_peak);
      if (rank == 0) {
        // The files that make the export usable beside its weights: how to generate
        // (stop tokens) and the tokenizer, as the source model had them.
        namespace fs = std::filesystem;
        for (const char* name : {"generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                 "special_tokens_map.json", "tokenizer.model"}) {
          const fs::path from = fs::path(a.model) / name;
          if (fs::exists(from))
            fs::copy_file(from, fs::path(a.out) / name, fs::copy_options::overwrite_existing);
        }
        std::printf("exported %s (%s)\n", a.out.c_str(), a.export_dtype.c_str());
        std::printf(
            "export: each rank's allocations beyond its shards peaked at (MiB) %s; planned: %.2f; the whole "
            "model: %.2f\n",
            export_peaks.c_str(), mib(planned.export_whole - held), mib(4 * params));
      }
    }
    if (!a.logits.empty()) {
      const auto first = dataset.get({0}).input;
      at::Tensor logits;
      {
        torch::NoGradGuard no_grad;
        logits = fsdp.forward(first).to(at::kFloat);
      }
      if (rank == 0)
        flatshard::safetensors::save({{"logits", logits.contiguous()}, {"tokens", first}}, a.logits);
    }
    return 0;
  } catch (const flatshard::Error& e) {
    std::fprintf(stderr, "finetune_llama: %s\n", e.what());
    return 1;
  }
}
