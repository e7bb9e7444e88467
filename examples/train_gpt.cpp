// Trains the GPT-style model in any mode, with a progress line, checkpoints and resume.
//
//   flatshard-run -n 4 build/examples/train_gpt --mode full --steps 100 --ckpt out/ckpt
//   flatshard-run -n 4 build/examples/train_gpt --mode full --steps 200 --ckpt out/ckpt --resume
//
// Options (defaults in brackets):
//   --mode full|zero2|zero1|ddp|hybrid [full]   full shard, shard-grad-op, DDP + ZeRO-1 optimizer,
//                           DDP, hybrid sharding
//   --shard-group N         hybrid: ranks per shard group [the ranks of a node]
//   --layers N [4] --dim N [256] --heads N [8] --vocab N [4096] --context N [64]
//   --batch N [4]           sequences per rank per step
//   --global-batch N        sequences per step over all ranks instead (each rank takes N / world):
//                           the same training at any world size, for a job that resumes at
//                           another one (flatshard-run --nnodes MIN:MAX)
//   --steps N [50] --lr X [3e-4]   peak learning rate: linear warm-up over --warmup steps,
//                           then cosine decay to --min-lr-ratio of it by the last step
//   --warmup N [steps / 10] --min-lr-ratio X [0.1]
//   --precision fp32|bf16|fp16 [fp32]   compute dtype (fp32 master weights and optimizer
//                           state either way); fp16 scales the loss (optim::GradScaler)
//   --data FILE             train on a text file (bytes as tokens: vocab becomes 256);
//                           without it, a generated corpus (a noisy repeating grammar)
//   --ckpt DIR              sharded checkpoints under DIR (every --save-every steps and at the end)
//   --save-every N [0]      0: only at the end
//   --resume                continue from DIR's latest checkpoint (any world size or mode);
//                           from step 0 when DIR has none yet
//   --budget-mib M          per-rank memory budget: refused at construction if the mode's
//                           model states need more (MemoryBudgetError); checked against
//                           the measured peak at the end, from before construction
//   --log-every N           a progress line every N steps [steps / 10]
//   --result                print one CSV line for scripts (RESULT,...; see below)
//   --recompute             every block recomputes its activations in backward (recompute.h)
//   --build-into-shards     build the model inside flatshard::BuildIntoShards (full, zero2):
//                           no rank ever holds it whole (build.h)
//   --embedding-units       the token embedding and the head are units of their own
//   --optimizer adamw|sgd [adamw]   adamw: weight decay 0.1 except biases, norms and embeddings
//                           (their own group, no decay); sgd: plain SGD, no optimizer state
//   --dropout P [0]         residual dropout
//   --freeze A,B,...        fine-tuning: parameters whose name contains one of these are frozen
//                           (requires_grad off before wrapping), e.g. .attn. for every block's
//                           attention (docs/fully-shard.md#frozen-parameters-fine-tuning)
//   --async-save            checkpoints through checkpoint::AsyncSaver: a save blocks only for the
//                           host copy and is written while training goes on
//   --save-timing           rank 0 prints SAVE,step,blocking_ms,copy_bytes for every save (the
//                           time the save kept training waiting; bench/async_checkpoint.sh)
//   --memory-every N        every N steps, rank 0 prints MEMORY,step,current_bytes,peak_bytes,rss_bytes
//                           (counting allocator, resident set; bench/soak.sh watches them for leaks)
//
// RESULT,mode,world,params,step_ms,peak_bytes,formula_bytes,planned_bytes,rank_peaks
// (peak: the counting allocator's, largest over ranks, from the second step on;
// planned: the planner's figure for training, construction aside; rank_peaks: every
// rank's, separated by ';').
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "flatshard/flatshard.h"
#include "flatshard/plan.h"
#include "models/gpt.h"

using flatshard::models::GPT;
using flatshard::models::GPTConfig;
namespace plan = flatshard::plan;

namespace {

struct Args {
  std::string mode = "full", data, ckpt;
  GPTConfig model{4096, 64, 256, 8, 4};
  int batch = 4, global_batch = 0, shard_group = 0, steps = 50, save_every = 0, log_every = 0,
      memory_every = 0;
  double lr = 3e-4, budget_mib = 0, min_lr_ratio = 0.1;
  int warmup = -1;
  std::string precision = "fp32";
  std::vector<std::string> freeze;
  bool resume = false, result = false, recompute = false, build_into_shards = false, sgd = false;
  bool async_save = false, save_timing = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument("missing value for " + k);
      return argv[++i];
    };
    if (k == "--mode")
      a.mode = next();
    else if (k == "--layers")
      a.model.layers = std::stoi(next());
    else if (k == "--dim")
      a.model.dim = std::stoi(next());
    else if (k == "--heads")
      a.model.heads = std::stoi(next());
    else if (k == "--vocab")
      a.model.vocab = std::stoi(next());
    else if (k == "--context")
      a.model.context = std::stoi(next());
    else if (k == "--batch")
      a.batch = std::stoi(next());
    else if (k == "--shard-group")
      a.shard_group = std::stoi(next());
    else if (k == "--global-batch")
      a.global_batch = std::stoi(next());
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
    else if (k == "--data")
      a.data = next();
    else if (k == "--ckpt")
      a.ckpt = next();
    else if (k == "--save-every")
      a.save_every = std::stoi(next());
    else if (k == "--log-every")
      a.log_every = std::stoi(next());
    else if (k == "--memory-every")
      a.memory_every = std::stoi(next());
    else if (k == "--budget-mib")
      a.budget_mib = std::stod(next());
    else if (k == "--resume")
      a.resume = true;
    else if (k == "--async-save")
      a.async_save = true;
    else if (k == "--save-timing")
      a.save_timing = true;
    else if (k == "--recompute")
      a.recompute = true;
    else if (k == "--dropout")
      a.model.dropout = std::stod(next());
    else if (k == "--result")
      a.result = true;
    else if (k == "--build-into-shards")
      a.build_into_shards = true;
    else if (k == "--embedding-units")
      a.model.embedding_units = true;
    else if (k == "--freeze") {
      std::stringstream list(next());
      for (std::string part; std::getline(list, part, ',');) {
        if (!part.empty()) a.freeze.push_back(part);
      }
    } else if (k == "--optimizer") {
      const auto v = next();
      if (v != "adamw" && v != "sgd") throw std::invalid_argument("--optimizer is adamw or sgd");
      a.sgd = v == "sgd";
    } else
      throw std::invalid_argument("unknown option " + k + " (see the comment at the top of train_gpt.cpp)");
  }
  flatshard::Strategy m;
  if (!flatshard::parse_strategy(a.mode, m))
    throw std::invalid_argument("--mode is full, zero2, zero1, ddp or hybrid");
  if (a.resume && a.ckpt.empty()) throw std::invalid_argument("--resume needs --ckpt DIR");
  if (!a.data.empty()) a.model.vocab = 256;
  if (a.log_every <= 0) a.log_every = std::max(1, a.steps / 10);
  if (a.warmup < 0) a.warmup = std::max(1, a.steps / 10);
  if (a.precision != "fp32" && a.precision != "bf16" && a.precision != "fp16")
    throw std::invalid_argument("--precision is fp32, bf16 or fp16");
  return a;
}

// The training tokens: a text file's bytes, or a generated corpus that a model can learn
// (a repeating grammar of short "words" with 10% noise), the same on every rank.
at::Tensor corpus(const Args& a) {
  if (!a.data.empty()) {
    std::ifstream in(a.data, std::ios::binary);
    if (!in) throw std::invalid_argument("cannot read --data " + a.data);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (text.size() < static_cast<std::size_t>(a.model.context + 2))
      throw std::invalid_argument("--data " + a.data + " is shorter than one context");
    auto t = at::empty({static_cast<std::int64_t>(text.size())}, at::kLong);
    for (std::size_t i = 0; i < text.size(); ++i) t[i] = static_cast<unsigned char>(text[i]);
    return t;
  }
  auto g = at::make_generator<at::CPUGeneratorImpl>(1234);
  const std::int64_t words = 64, length = 1 << 18;
  auto lexicon = at::randint(a.model.vocab, {words, 4}, g);
  auto order = at::randint(words, {length / 4}, g);
  auto tokens = lexicon.index_select(0, order).reshape({-1});
  auto noise = at::rand({tokens.numel()}, g) < 0.1;
  return at::where(noise, at::randint(a.model.vocab, {tokens.numel()}, g), tokens);
}

// This rank's sequences of a step: global batch = batch x world, rows of rank r.
std::pair<at::Tensor, at::Tensor> batch_of(const at::Tensor& tokens, int step, int rank, int world,
                                           const Args& a) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(10'000 + step);
  const std::int64_t rows = static_cast<std::int64_t>(a.batch) * world;
  auto starts =
      at::randint(tokens.numel() - a.model.context - 1, {rows}, g).narrow(0, rank * a.batch, a.batch);
  auto offsets = at::arange(a.model.context + 1, at::kLong);
  auto windows = tokens.index({(starts.unsqueeze(1) + offsets.unsqueeze(0))});
  return {windows.narrow(1, 0, a.model.context).contiguous(),
          windows.narrow(1, 1, a.model.context).contiguous()};
}

// After flatshard-run restarted the job (Note [Restarting a failed job]): how long the
// failure cost, from the moment it was seen to the end of the first step of this start.
void report_first_step_after_a_failure(int step) {
  const char* at = std::getenv("FLATSHARD_FAILED_AT_UNIX_MS");
  if (at == nullptr) return;
  const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  const char* cause = std::getenv("FLATSHARD_FAILURE_CAUSE");
  std::printf("first step after the failure (%s): step %d done %.1f s after it\n", cause ? cause : "?", step,
              static_cast<double>(now - std::atoll(at)) / 1000.0);
  std::fflush(stdout);
}

std::string bar(int done, int total) {
  const int width = 24, filled = total > 0 ? done * width / total : width;
  return std::string(filled, '#') + std::string(width - filled, '.');
}

double mib(std::int64_t b) { return static_cast<double>(b) / (1 << 20); }

// The process's resident set (/proc/self/status VmRSS), in bytes.
std::int64_t resident_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 2;
  }
  at::set_num_threads(1);
  flatshard::memory::install_counting_allocator();
  try {
    auto world = flatshard::init();
    const int rank = world.rank(), n = world.world_size();
    if (a.global_batch > 0) {
      if (a.global_batch % n != 0) {
        throw flatshard::InvalidArgument(fmt::format(
            "train_gpt: --global-batch {} does not split over {} ranks; give a multiple of every world size "
            "the job may run at",
            a.global_batch, n));
      }
      a.batch = a.global_batch / n;
    }
    flatshard::Strategy mode;
    flatshard::parse_strategy(a.mode, mode);
    const auto tokens = corpus(a);
    const auto base = flatshard::memory::allocator_stats().current_bytes;
    flatshard::memory::reset_allocator_peak();  // the whole run's peak: from before construction

    flatshard::MemoryBudget budget;
    budget.bytes = static_cast<std::int64_t>(a.budget_mib * (1 << 20));
    budget.optimizer_state_bytes = a.sgd ? 0 : 8;
    flatshard::FullyShardOptions options;  // every mode: the strategy is the one choice
    options.strategy = mode;
    options.shard_group_size = a.shard_group;
    options.memory_budget = budget;
    if (a.precision != "fp32") {
      options.mixed_precision.param = a.precision == "bf16" ? at::kBFloat16 : at::kHalf;
      options.mixed_precision.reduce = at::kFloat;
    }
    GPT model{nullptr};
    torch::manual_seed(42);
    if (a.build_into_shards) {
      flatshard::BuildIntoShards build(world, options);
      model = GPT(a.model);
    } else {
      model = GPT(a.model);
    }
    flatshard::set_recompute(*model, a.recompute);
    std::int64_t frozen = 0;
    for (auto& item : model->named_parameters()) {
      for (const auto& part : a.freeze) {
        if (item.key().find(part) == std::string::npos) continue;
        item.value().requires_grad_(false);
        frozen += item.value().numel();
        break;
      }
    }
    const auto shape = plan::shape_of(*model);  // before wrapping: FullyShard empties the parameters
    const std::int64_t params = shape.total();
    flatshard::FullyShard<GPT> run(model, world, options);
    namespace optim = flatshard::optim;
    std::unique_ptr<optim::ShardOptimizer> opt;
    if (a.sgd) {
      opt = std::make_unique<optim::SGD>(run, optim::SGDOptions{a.lr});
    } else {
      const optim::AdamWOptions decay{a.lr, 0.9, 0.95, 1e-8, 0.1};
      optim::AdamWOptions no_decay = decay;
      no_decay.weight_decay = 0;
      opt = std::make_unique<optim::AdamW>(run, decay,
                                           std::vector<optim::ParamGroup<optim::AdamWOptions>>{
                                               {"no_decay", optim::biases_norms_embeddings(), no_decay}});
    }
    // Warm-up, then cosine decay to min_lr_ratio by the last step (the first step trains at
    // lr / warmup).
    optim::LRScheduler schedule(
        *opt, a.warmup < a.steps
                  ? optim::warmup_then(a.warmup, optim::cosine(a.steps - a.warmup, a.min_lr_ratio))
                  : optim::linear_warmup(a.warmup));
    std::unique_ptr<optim::GradScaler> scaler;
    if (a.precision == "fp16") scaler = std::make_unique<optim::GradScaler>(run);
    auto& comm = run.comm();
    std::unique_ptr<flatshard::checkpoint::AsyncSaver> saver;
    if (a.async_save) saver = std::make_unique<flatshard::checkpoint::AsyncSaver>(run);
    auto save = [&](int step) {
      flatshard::checkpoint::SaveOptions so;
      so.step = step;
      so.scheduler = &schedule;
      so.scaler = scaler.get();
      const auto t0 = std::chrono::steady_clock::now();
      flatshard::checkpoint::CheckpointInfo info;
      std::int64_t copy_bytes = 0;
      if (saver) {
        saver->save(a.ckpt, opt.get(), so);
        copy_bytes = saver->last_copy_bytes();
        info.path = fmt::format("{}/step-{:09d} (being written)", a.ckpt, step);
      } else {
        info = flatshard::checkpoint::save_sharded(a.ckpt, run, opt.get(), so);
      }
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (a.save_timing && rank == 0) {
        std::printf("SAVE,%d,%.1f,%lld\n", step, ms, static_cast<long long>(copy_bytes));
        std::fflush(stdout);
      }
      return info;
    };

    int first = 0;
    // A job restarted before its first checkpoint (flatshard-run --max-restarts) starts over.
    if (a.resume && !std::filesystem::exists(std::filesystem::path(a.ckpt) / "latest")) {
      if (rank == 0) std::printf("no checkpoint in %s yet: starting at step 0\n", a.ckpt.c_str());
    } else if (a.resume) {
      flatshard::checkpoint::LoadOptions lo;
      lo.scheduler = &schedule;
      lo.scaler = scaler.get();
      const auto info = flatshard::checkpoint::load_sharded(a.ckpt, run, opt.get(), lo);
      first = static_cast<int>(info.step);
      if (rank == 0)
        std::printf("resumed from %s (step %d, saved at world %d under %s)\n", info.path.c_str(), first,
                    info.world_size, info.mode.c_str());
    }
    if (rank == 0) {
      std::printf(
          "GPT-style model: %lld parameters (%d layers, dim %d, vocab %d, context %d), mode %s, %d ranks, "
          "%d sequences per rank\n",
          static_cast<long long>(params), a.model.layers, a.model.dim, a.model.vocab, a.model.context,
          a.mode.c_str(), n, a.batch);
      if (frozen > 0) std::printf("frozen: %lld parameters (--freeze)\n", static_cast<long long>(frozen));
      std::fflush(stdout);
    }

    auto loss_sum = at::zeros({1}, at::kDouble);
    double timed_s = 0;
    int timed_steps = 0;
    std::int64_t whole_run_peak = 0;  // from before construction
    for (int step = first; step < a.steps; ++step) {
      if (step == first + 1) {
        whole_run_peak = flatshard::memory::allocator_stats().peak_bytes - base;
        flatshard::memory::reset_allocator_peak();  // the steady peak: from the second step on
      }
      const auto t0 = std::chrono::steady_clock::now();
      auto [x, y] = batch_of(tokens, step, rank, n, a);
      auto logits = run.forward(x);
      auto loss =
          torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), y.reshape({-1}));
      const double lr = opt->lr(0);  // this step's
      if (scaler) {
        scaler->scale(loss).backward();
        scaler->unscale(*opt);  // clip the true gradients
        run.clip_grad_norm(1.0);
        scaler->step(*opt);
        scaler->update();
      } else {
        loss.backward();
        run.clip_grad_norm(1.0);
        opt->step();
      }
      schedule.step();
      opt->zero_grad();
      loss_sum.fill_(loss.item<double>());
      comm.all_reduce(loss_sum, flatshard::ReduceOp::Avg).wait();
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (step > first) {
        timed_s += dt;
        ++timed_steps;
      }
      const int done = step + 1;
      if (step == first && rank == 0) report_first_step_after_a_failure(done);
      if (rank == 0 && (done % a.log_every == 0 || done == a.steps)) {
        std::printf("[%s] step %d/%d  loss %.4f  lr %.3g  %.0f tokens/s%s\n", bar(done, a.steps).c_str(),
                    done, a.steps, loss_sum.item<double>(), lr,
                    static_cast<double>(a.batch) * n * a.model.context / dt,
                    scaler ? fmt::format("  loss scale {:g}", scaler->scale()).c_str() : "");
        std::fflush(stdout);
      }
      if (rank == 0 && a.memory_every > 0 && done % a.memory_every == 0) {
        const auto m = flatshard::memory::allocator_stats();
        std::printf("MEMORY,%d,%lld,%lld,%lld\n", done, static_cast<long long>(m.current_bytes - base),
                    static_cast<long long>(m.peak_bytes - base), static_cast<long long>(resident_bytes()));
        std::fflush(stdout);
      }
      if (!a.ckpt.empty() && a.save_every > 0 && done % a.save_every == 0 && done < a.steps) save(done);
    }
    if (!a.ckpt.empty()) {
      auto info = save(a.steps);
      if (saver) info = saver->wait();
      if (rank == 0) std::printf("saved %s\n", info.path.c_str());
    }

    // Every rank's peaks (steady, whole run), on every rank.
    const std::int64_t steady_peak = flatshard::memory::allocator_stats().peak_bytes - base;
    whole_run_peak = std::max(whole_run_peak, steady_peak);
    auto mine = at::tensor({steady_peak, whole_run_peak}, at::kLong);
    auto all_peaks = at::empty({2 * n}, at::kLong);
    comm.all_gather(all_peaks, mine).wait();
    auto peaks = all_peaks.view({n, 2}).select(1, 0).contiguous();
    auto whole_peaks = all_peaks.view({n, 2}).select(1, 1).contiguous();
    const std::int64_t peak = peaks.max().item<std::int64_t>();
    const std::int64_t whole_peak = whole_peaks.max().item<std::int64_t>();
    plan::PlanOptions po;
    po.strategy = mode;
    po.world_size = n;
    po.optimizer_state_bytes = budget.optimizer_state_bytes;
    po.recompute = a.recompute;
    po.build_into_shards = a.build_into_shards;
    const auto planned = plan::predict(shape, po);
    const double step_ms = timed_steps > 0 ? 1000 * timed_s / timed_steps : 0;
    if (rank == 0) {
      std::string per_rank;
      for (int r = 0; r < n; ++r)
        per_rank += fmt::format("{}{:.1f}", r ? ", " : "", mib(peaks[r].item<std::int64_t>()));
      std::printf("peak memory per rank (MiB): %s; step %.0f ms; ZeRO formula %.1f MiB\n", per_rank.c_str(),
                  step_ms, mib(planned.zero_formula));
      if (budget.bytes > 0) {
        std::string per_rank_whole;
        for (int r = 0; r < n; ++r)
          per_rank_whole += fmt::format("{}{:.1f}", r ? ", " : "", mib(whole_peaks[r].item<std::int64_t>()));
        std::printf(
            "memory budget %.1f MiB; every rank's peak from before construction to the last step (MiB): "
            "%s: %s the budget (fp32 parameters alone: %.1f MiB)\n",
            a.budget_mib, per_rank_whole.c_str(), whole_peak <= budget.bytes ? "under" : "OVER",
            mib(4 * params));
        {
          const auto m = run.memory();
          const std::int64_t shards =
              m.param_shard_bytes + m.param_shard_bytes;  // masters and their gradients
          const std::int64_t state = opt->state_bytes();
          const std::int64_t gathered = m.peak_unsharded_param_bytes + m.peak_unsharded_grad_bytes;
          std::printf(
              "rank 0's peak %.1f MiB = shards %.1f (masters and gradients) + optimizer state %.1f + "
              "gathered "
              "units at most %.1f (%.1f parameters, %.1f gradients) + activations and temporaries %.1f\n",
              mib(whole_peaks[0].item<std::int64_t>()), mib(shards), mib(state), mib(gathered),
              mib(m.peak_unsharded_param_bytes), mib(m.peak_unsharded_grad_bytes),
              mib(whole_peaks[0].item<std::int64_t>() - shards - state - gathered));
        }
      }
      if (a.result) {
        std::string list;
        for (int r = 0; r < n; ++r) list += fmt::format("{}{}", r ? ";" : "", peaks[r].item<std::int64_t>());
        std::printf("RESULT,%s,%d,%lld,%.1f,%lld,%lld,%lld,%s\n", a.mode.c_str(), n,
                    static_cast<long long>(params), step_ms, static_cast<long long>(peak),
                    static_cast<long long>(planned.zero_formula), static_cast<long long>(planned.training()),
                    list.c_str());
      }
      std::fflush(stdout);
    }
    return budget.bytes > 0 && whole_peak > budget.bytes ? 3 : 0;
  } catch (const flatshard::MemoryBudgetError& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 3;
  } catch (const flatshard::Error& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 1;
  }
}
