// End-to-end step time and per-rank peak memory of the GPT-style model under one
// strategy (start with flatshard-run -n N; bench/fully_shard.sh runs the grid).
//
//   bench_fully_shard --strategy full|grad [--layers 6 --dim 256 --vocab 4096
//                     --context 64 --batch 4 --steps 6]
//
// Rank 0 prints one CSV line: strategy,world,params,step_ms,peak_bytes,param_shard,
// grad_shard,optim_state,peak_unsharded_params,peak_unsharded_grads,formula_bytes
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "flatshard/flatshard.h"
#include "tests/support/models.h"

using flatshard::testing::GPT;
using flatshard::testing::GPTConfig;

int main(int argc, char** argv) {
  at::set_num_threads(1);
  flatshard::memory::install_counting_allocator();
  std::string strategy = "full";
  GPTConfig cfg{4096, 64, 256, 8, 6};
  int batch = 4, steps = 6;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (a == "--strategy") strategy = argv[i + 1];
    else if (a == "--layers") cfg.layers = v;
    else if (a == "--dim") cfg.dim = v;
    else if (a == "--vocab") cfg.vocab = v;
    else if (a == "--context") cfg.context = v;
    else if (a == "--batch") batch = v;
    else if (a == "--steps") steps = v;
  }
  auto world = flatshard::init();
  torch::manual_seed(0);
  GPT model(cfg);
  std::int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  flatshard::FullyShardOptions options;
  options.strategy = strategy == "full" ? flatshard::Strategy::FullShard : flatshard::Strategy::ShardGradOp;
  flatshard::FullyShard<GPT> fsdp(model, world, options);
  flatshard::optim::AdamW opt(fsdp.shards(), {3e-4});

  auto g = at::make_generator<at::CPUGeneratorImpl>(world.rank());
  double total_ms = 0;
  for (int step = 0; step <= steps; ++step) {
    auto tokens = at::randint(cfg.vocab, {batch, cfg.context + 1}, g);
    if (step == 1) {  // the first step allocates optimizer state: measure from the second on
      flatshard::memory::reset_allocator_peak();
      fsdp.reset_peaks();
      fsdp.comm().barrier().wait();
    }
    const auto start = std::chrono::steady_clock::now();
    auto logits = fsdp.forward(tokens.narrow(1, 0, cfg.context));
    auto loss = torch::cross_entropy_loss(logits.reshape({-1, cfg.vocab}), tokens.narrow(1, 1, cfg.context).reshape({-1}));
    loss.backward();
    opt.step();
    opt.zero_grad();
    if (step >= 1) total_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  }
  // Per-rank figures: the largest over ranks.
  const auto m = fsdp.memory();
  auto figures = at::tensor({static_cast<double>(flatshard::memory::allocator_stats().peak_bytes), total_ms / steps,
                             static_cast<double>(m.peak_unsharded_param_bytes),
                             static_cast<double>(m.peak_unsharded_grad_bytes)}, at::kDouble);
  auto gathered = at::zeros({4 * world.world_size()}, at::kDouble);
  fsdp.comm().all_gather(gathered, figures).wait();
  const auto worst = gathered.view({world.world_size(), 4}).amax(0);
  if (world.rank() == 0) {
    const double n = world.world_size();
    const double formula = options.strategy == flatshard::Strategy::FullShard ? 16.0 * params / n
                                                                              : 4.0 * params + 12.0 * params / n;
    std::printf("%s,%d,%lld,%.1f,%.0f,%lld,%lld,%lld,%.0f,%.0f,%.0f\n", strategy.c_str(), world.world_size(),
                static_cast<long long>(params), worst[1].item<double>(), worst[0].item<double>(),
                static_cast<long long>(m.param_shard_bytes), static_cast<long long>(m.param_shard_bytes),
                static_cast<long long>(opt.state_bytes()), worst[2].item<double>(), worst[3].item<double>(), formula);
  }
  return 0;
}
