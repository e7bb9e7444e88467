// One optimizer step over one flat fp32 shard: FlatShard's Thrust kernels (C++ back end
// on the CPU) against LibTorch's own torch::optim step on the same flat tensor.
// Single-threaded, as each rank runs. Bytes/s counts the tensors the step touches.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include "flatshard/optim.h"

namespace {

at::Tensor flat_param(std::int64_t numel) {
  auto p = at::randn({numel});
  p.mutable_grad() = at::randn({numel});
  return p;
}

void BM_Thrust_AdamW(benchmark::State& state) {
  auto p = flat_param(state.range(0));
  flatshard::optim::AdamW opt({p}, {});
  for (auto _ : state) opt.step();
  state.SetBytesProcessed(state.iterations() * state.range(0) * 4 * 5);  // p, g, m, v read; p, m, v written
}

void BM_LibTorch_AdamW(benchmark::State& state) {
  auto p = flat_param(state.range(0)).set_requires_grad(true);
  p.mutable_grad() = at::randn({state.range(0)});
  torch::optim::AdamW opt({p}, torch::optim::AdamWOptions(1e-3));
  for (auto _ : state) opt.step();
  state.SetBytesProcessed(state.iterations() * state.range(0) * 4 * 5);
}

void BM_Thrust_SGD(benchmark::State& state) {
  auto p = flat_param(state.range(0));
  flatshard::optim::SGD opt({p}, {0.01, 0.9, 0, 0.01, true});
  for (auto _ : state) opt.step();
  state.SetBytesProcessed(state.iterations() * state.range(0) * 4 * 4);
}

void BM_LibTorch_SGD(benchmark::State& state) {
  auto p = flat_param(state.range(0)).set_requires_grad(true);
  p.mutable_grad() = at::randn({state.range(0)});
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.01).momentum(0.9).nesterov(true).weight_decay(0.01));
  for (auto _ : state) opt.step();
  state.SetBytesProcessed(state.iterations() * state.range(0) * 4 * 4);
}

void sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t n : {std::int64_t{1} << 16, std::int64_t{1} << 20, std::int64_t{1} << 24}) b->Arg(n);
  b->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_Thrust_AdamW)->Apply(sizes);
BENCHMARK(BM_LibTorch_AdamW)->Apply(sizes);
BENCHMARK(BM_Thrust_SGD)->Apply(sizes);
BENCHMARK(BM_LibTorch_SGD)->Apply(sizes);

int main(int argc, char** argv) {
  at::set_num_threads(1);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
