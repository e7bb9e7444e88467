// One optimizer step over one flat fp32 shard: FlatShard's step kernels against
// PyTorch's fused CPU kernels (at::_fused_adamw_ and at::_fused_sgd_, what
// torch.optim.AdamW(fused=True) and SGD(fused=True) run, and FSDP2's CPU offload step)
// and LibTorch's torch::optim classes, on the same sizes.
// Each runs at 1 and 2 intra-op threads, and at every core of a larger machine (the second
// argument): one thread is a rank of a CPU run, every core a CPU-offloaded rank's step.
// 2^26 elements is the size of a transformer block's shard (a 1B GPT's block holds 50M
// parameters). Bytes/s counts the tensors the step touches.
// FlatShard_AdamW_Bf16Copy is CPU offload's step under bf16 compute: AdamW that also
// writes the masters' bf16 copies, which the gathers send (FullyShardOptions::offload_bf16_copy).
// The optimizers that allocate their state in their first step take that step before the
// timed loop: the fused kernels' state is allocated up front, and zeroing half a gigabyte
// of fresh pages is no part of a step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <thread>
#include <vector>

#include "flatshard/optim.h"
#include "optim/step_kernels.h"

namespace {

constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.999, kDecay = 0.01, kEps = 1e-8;

struct Shard {
  at::Tensor param, grad, exp_avg, exp_avg_sq;
  explicit Shard(std::int64_t numel)
      : param(at::randn({numel})),
        grad(at::randn({numel})),
        exp_avg(at::zeros({numel})),
        exp_avg_sq(at::zeros({numel})) {}
};

void set_threads(const benchmark::State& state) { at::set_num_threads(static_cast<int>(state.range(1))); }

void BM_FlatShard_AdamW(benchmark::State& state) {
  set_threads(state);
  auto p = at::randn({state.range(0)});
  p.mutable_grad() = at::randn({state.range(0)});
  flatshard::optim::AdamW opt(
      {p}, {.lr = kLr, .beta1 = kBeta1, .beta2 = kBeta2, .eps = kEps, .weight_decay = kDecay});
  opt.step();  // the state is allocated (and zeroed) by the first step, untimed as the peer's
  for (auto _ : state) opt.step();
  state.SetBytesProcessed(state.iterations() * state.range(0) * 4 * 7);  // p, g, m, v read; p, m, v written
}

void BM_FlatShard_AdamW_Bf16Copy(benchmark::State& state) {
  set_threads(state);
  Shard s(state.range(0));
  std::vector<std::uint16_t> copy(static_cast<std::size_t>(state.range(0)));
  flatshard::optim::kernels::AdamHyper h;
  h.lr = kLr;
  h.beta1 = kBeta1;
  h.beta2 = kBeta2;
  h.eps = kEps;
  h.weight_decay = kDecay;
  h.decoupled_weight_decay = true;
  h.step = 0;
  for (auto _ : state) {
    ++h.step;
    flatshard::optim::kernels::adam_step(s.param.data_ptr<float>(), s.grad.data_ptr<float>(),
                                         s.exp_avg.data_ptr<float>(), s.exp_avg_sq.data_ptr<float>(),
                                         state.range(0), h, copy.data());
  }
  state.SetBytesProcessed(state.iterations() * state.range(0) * (4 * 7 + 2));  // and the copy written
}

void BM_PyTorchFused_AdamW(benchmark::State& state) {
  set_threads(state);
  Shard s(state.range(0));
  auto step = at::zeros({}, at::kFloat);
  for (auto _ : state) {
    step.add_(1);
    at::_fused_adamw_({s.param}, {s.grad}, {s.exp_avg}, {s.exp_avg_sq}, {}, {step}, kLr, kBeta1, kBeta2,
                      kDecay, kEps, /*amsgrad=*/false, /*maximize=*/false);
  }
  state.SetBytesProcessed(state.iterations() * state.range(0) * 4 * 7);
}

void BM_LibTorch_AdamW(benchmark::State& state) {
  set_threads(state);
  auto p = at::randn({state.range(0)}).set_requires_grad(true);
  p.mutable_grad() = at::randn({state.range(0)});
  torch::optim::AdamW opt({p}, torch::optim::AdamWOptions(kLr).weight_decay(kDecay));
  opt.step();
  for (auto _ : state) opt.step();
  state.SetBytesProcessed(state.iterations() * state.range(0) * 4 * 7);
}

void BM_FlatShard_SGD(benchmark::State& state) {
  set_threads(state);
  auto p = at::randn({state.range(0)});
  p.mutable_grad() = at::randn({state.range(0)});
  flatshard::optim::SGD opt({p}, {0.01, 0.9, 0, 0.01, true});
  opt.step();
  for (auto _ : state) opt.step();
  state.SetBytesProcessed(state.iterations() * state.range(0) * 4 * 5);  // p, g, buf read; p, buf written
}

void BM_PyTorchFused_SGD(benchmark::State& state) {
  set_threads(state);
  Shard s(state.range(0));
  bool first = true;
  for (auto _ : state) {
    at::_fused_sgd_({s.param}, {s.grad}, {s.exp_avg}, /*weight_decay=*/0.01, /*momentum=*/0.9, /*lr=*/0.01,
                    /*dampening=*/0, /*nesterov=*/true, /*maximize=*/false, /*is_first_step=*/first);
    first = false;
  }
  state.SetBytesProcessed(state.iterations() * state.range(0) * 4 * 5);
}

void BM_LibTorch_SGD(benchmark::State& state) {
  set_threads(state);
  auto p = at::randn({state.range(0)}).set_requires_grad(true);
  p.mutable_grad() = at::randn({state.range(0)});
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.01).momentum(0.9).nesterov(true).weight_decay(0.01));
  opt.step();
  for (auto _ : state) opt.step();
  state.SetBytesProcessed(state.iterations() * state.range(0) * 4 * 5);
}

void sizes(benchmark::internal::Benchmark* b) {
  std::vector<int> threads{1, 2};
  if (std::thread::hardware_concurrency() > 2)
    threads.push_back(static_cast<int>(std::thread::hardware_concurrency()));
  for (int t : threads) {
    for (std::int64_t n :
         {std::int64_t{1} << 16, std::int64_t{1} << 20, std::int64_t{1} << 24, std::int64_t{1} << 26}) {
      b->Args({n, t});
    }
  }
  b->ArgNames({"numel", "threads"});
  b->Unit(benchmark::kMillisecond);
  b->UseRealTime();
}

}  // namespace

BENCHMARK(BM_FlatShard_AdamW)->Apply(sizes);
BENCHMARK(BM_FlatShard_AdamW_Bf16Copy)->Apply(sizes);
BENCHMARK(BM_PyTorchFused_AdamW)->Apply(sizes);
BENCHMARK(BM_LibTorch_AdamW)->Apply(sizes);
BENCHMARK(BM_FlatShard_SGD)->Apply(sizes);
BENCHMARK(BM_PyTorchFused_SGD)->Apply(sizes);
BENCHMARK(BM_LibTorch_SGD)->Apply(sizes);

BENCHMARK_MAIN();
