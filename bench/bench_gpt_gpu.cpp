// A GPT-style model on one GPU under FullyShard (full shard, NCCL, bf16 compute, fp32
// master shards and reduction, AdamW): tokens/s, MFU and the caching allocator's peak.
// The model is built on the host and sharded onto the GPU (FullyShardOptions::device);
// --offload 1 keeps master shards, gradients and AdamW state on the host (CPU offload).
// bench/peer_fsdp2_gpu.py runs the same model and step under PyTorch FSDP2; scripts/gpu.sh
// runs both in one go and prints the table.
//
//   bench_gpt_gpu [--dim 2048] [--layers 18] [--heads 16] [--vocab 32768] [--context 1024]
//                 [--batch 4] [--warmup 3] [--steps 20] [--peak-tflops 989] [--offload 0|1]
//                 [--recompute 0|1] [--csv FILE] [--profile TRACE.json] [--mode full|ddp]
//                 [--step-in-backward 0|1] [--tag SUFFIX] [--bf16-copy 0|1]
//
// --bf16-copy 0 (with --offload 1) sends the fp32 masters to the GPU instead of their bf16
// copies (FullyShardOptions::offload_bf16_copy; scripts/gpu.sh tags that run "fp32send").
// --tag appends "-SUFFIX" to the CSV row's name (scripts/gpu.sh: "b1" for its batch-1 runs).
// --step-in-backward 1 (full shard) steps each unit's shard in backward
// (FullyShardBase::step_in_backward): the fp32 gradients never exist together.
// --mode ddp runs the NoShard strategy instead (bf16 parameters and
// gradients, fp32 all-reduce and masters, flatshard::optim::AdamW over the masters; the
// model moved to the GPU whole, or with --offload 1 built on the host with its fp32 master
// kept there); peer_fsdp2_gpu.py --mode ddp is PyTorch DDP's run.
//
// Each run also prints the host's time per step in forward, backward and the optimizer's
// step (peer_fsdp2_gpu.py prints the same): under CPU offload, where the host's step and its
// waits for the device set the pace, they say where a step's time goes.
//
// --profile writes a Chrome trace (LibTorch's Kineto profiler, CPU and CUDA activity) of
// three more steps after the timed ones; bench/trace_summary.py breaks it down by kernel kind.
#include <cuda_runtime.h>

#include <algorithm>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include "flatshard/flatshard.h"
#include "flatshard/memory.h"
#include "models/gpt.h"

namespace {

struct Args {
  int dim = 2048, layers = 18, heads = 16, vocab = 32768, context = 1024, batch = 4;
  int warmup = 3, steps = 20;
  bool offload = false, recompute = false, step_in_backward = false, bf16_copy = true;
  double peak_tflops = 989;  // H100/H200 SXM dense bf16
  std::string csv, profile, mode = "full", tag;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--dim")
      a.dim = std::atoi(v);
    else if (k == "--layers")
      a.layers = std::atoi(v);
    else if (k == "--heads")
      a.heads = std::atoi(v);
    else if (k == "--vocab")
      a.vocab = std::atoi(v);
    else if (k == "--context")
      a.context = std::atoi(v);
    else if (k == "--batch")
      a.batch = std::atoi(v);
    else if (k == "--warmup")
      a.warmup = std::atoi(v);
    else if (k == "--steps")
      a.steps = std::atoi(v);
    else if (k == "--recompute")
      a.recompute = std::atoi(v) != 0;
    else if (k == "--offload")
      a.offload = std::atoi(v) != 0;
    else if (k == "--bf16-copy")
      a.bf16_copy = std::atoi(v) != 0;
    else if (k == "--peak-tflops")
      a.peak_tflops = std::atof(v);
    else if (k == "--csv")
      a.csv = v;
    else if (k == "--profile")
      a.profile = v;
    else if (k == "--mode")
      a.mode = v;
    else if (k == "--step-in-backward")
      a.step_in_backward = std::atoi(v) != 0;
    else if (k == "--tag")
      a.tag = v;
    else {
      std::fprintf(stderr, "bench_gpt_gpu: unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

// The process's peak resident set (VmHWM), GiB: host memory, where offload keeps state.
double host_peak_gib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::atof(line.c_str() + 6) / (1024.0 * 1024.0);
  }
  return 0;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_gpt_gpu: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  auto world = flatshard::init();
  // Ranks beyond the GPUs share them (flatshard-run --nccl-host-per-rank on one GPU).
  int devices = 0;
  check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  const int device = world.local_rank() % std::max(devices, 1);
  const c10::Device gpu(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
  check(cudaSetDevice(device), "cudaSetDevice");

  flatshard::models::GPTConfig cfg{a.vocab, a.context, a.dim, a.heads, a.layers};
  cfg.fused_attention = true;
  torch::manual_seed(0);
  flatshard::models::GPT model(cfg);
  flatshard::set_recompute(*model, a.recompute);
  std::int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();

  if (a.mode != "full" && a.mode != "ddp") {
    std::fprintf(stderr, "bench_gpt_gpu: --mode is full or ddp, not %s\n", a.mode.c_str());
    return 2;
  }
  const bool ddp_mode = a.mode == "ddp";
  const flatshard::optim::AdamWOptions adamw{3e-4, 0.9, 0.95, 1e-8, 0.1};
  flatshard::FullyShardOptions options;
  options.mixed_precision.param = at::kBFloat16;
  options.mixed_precision.reduce = at::kFloat;
  options.cpu_offload = a.offload;
  options.offload_bf16_copy = a.bf16_copy;
  if (ddp_mode && !a.offload) {
    model->to(gpu);  // a whole replica on the GPU, as DDP
  } else {
    options.device = gpu;  // built on the host, its masters kept there or sharded onto the GPU unit by unit
  }
  options.strategy = ddp_mode ? flatshard::Strategy::NoShard : flatshard::Strategy::FullShard;
  flatshard::FullyShard<flatshard::models::GPT> fsdp(model, world, options);
  auto adam = std::make_unique<flatshard::optim::AdamW>(fsdp, adamw);
  if (a.step_in_backward) fsdp.step_in_backward(adam.get());
  auto& opt = *adam;

  auto tokens =
      at::randint(a.vocab, {a.batch, a.context + 1}, at::TensorOptions().dtype(at::kLong).device(gpu));
  auto x = tokens.narrow(1, 0, a.context).contiguous(), y = tokens.narrow(1, 1, a.context).contiguous();
  // Host time per phase over the timed steps: where the host blocks (under offload, the
  // end of backward waiting for the device and the optimizer's step on the host) or falls
  // behind the GPU. Without offload the phases only queue work, and the GPU sets the pace.
  using Clock = std::chrono::steady_clock;
  double host_ms[3] = {0, 0, 0};  // forward and loss, backward, step and zero_grad
  bool time_phases = false;
  auto phase = [&](int i, Clock::time_point& since) {
    const auto now = Clock::now();
    if (time_phases) host_ms[i] += std::chrono::duration<double, std::milli>(now - since).count();
    since = now;
  };
  auto step = [&] {
    auto since = Clock::now();
    auto logits = fsdp.forward(x);
    auto loss = torch::cross_entropy_loss(logits.reshape({-1, a.vocab}).to(at::kFloat), y.reshape({-1}));
    phase(0, since);
    loss.backward();
    phase(1, since);
    opt.step();
    opt.zero_grad();
    phase(2, since);
    return loss;
  };
  for (int i = 0; i < a.warmup; ++i) step();
  check(cudaDeviceSynchronize(), "warm-up");
  flatshard::memory::reset_cuda_allocator_peak(gpu.index());

  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  check(cudaEventRecord(start, c10::cuda::getCurrentCUDAStream().stream()), "cudaEventRecord");
  at::Tensor loss;
  time_phases = true;
  for (int i = 0; i < a.steps; ++i) loss = step();
  time_phases = false;
  check(cudaEventRecord(stop, c10::cuda::getCurrentCUDAStream().stream()), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");

  // Note [Communication wait]: a few more steps with the waits timed (apart from the
  // timed steps above, which the timing events would slow): the share of the step in
  // which the compute stream waited for communication.
  const int wait_steps = std::min(a.steps, 5);
  fsdp.time_communication_waits(true);
  check(cudaEventRecord(start, c10::cuda::getCurrentCUDAStream().stream()), "cudaEventRecord");
  for (int i = 0; i < wait_steps; ++i) step();
  check(cudaEventRecord(stop, c10::cuda::getCurrentCUDAStream().stream()), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float wait_steps_ms = 0;
  check(cudaEventElapsedTime(&wait_steps_ms, start, stop), "cudaEventElapsedTime");
  const flatshard::CommunicationWait waited = fsdp.communication_wait();
  fsdp.time_communication_waits(false);
  const double wait_share = wait_steps_ms > 0 ? waited.ms / wait_steps_ms : 0;

  const double tokens_per_step = static_cast<double>(a.batch) * a.context * world.world_size();
  const double tokens_per_s = tokens_per_step * a.steps / (ms / 1000.0);
  // Training FLOPs per token: 6 per non-embedding parameter (forward 2, backward 4; the
  // token and position tables are lookups, the head a matmul), plus attention's score and
  // value products (12 * layers * context * dim, causal counted in full), as the step-time
  // model counts them (TransformerShape::forward_flops_per_token).
  const double matmul_params = static_cast<double>(params) - static_cast<double>(a.vocab + a.context) * a.dim;
  const double flops_per_token = 6.0 * matmul_params + 12.0 * a.layers * a.context * a.dim;
  const double mfu = tokens_per_s / world.world_size() * flops_per_token / (a.peak_tflops * 1e12);
  const auto mem = flatshard::memory::cuda_allocator_stats(gpu.index());
  const double gib = 1024.0 * 1024.0 * 1024.0;
  if (world.rank() == 0) {
    std::printf(
        "flatshard %s%s%s: %.3fB params, %.0f tokens/s, MFU %.1f%%, peak %.2f GiB (reserved %.2f "
        "GiB, "
        "%lld retries), host peak %.1f GiB, step %.1f ms, waiting for communication %.1f%% of it "
        "(%lld waits), loss %.3f\n",
        ddp_mode ? "DDP" : (a.step_in_backward ? "full shard, step in backward" : "full shard"),
        a.offload ? (a.bf16_copy ? " + CPU offload" : " + CPU offload (fp32 masters sent)") : "",
        a.recompute ? " + recompute" : "", params / 1e9, tokens_per_s, 100 * mfu, mem.peak_bytes / gib,
        mem.reserved_bytes / gib, static_cast<long long>(mem.alloc_retries), host_peak_gib(), ms / a.steps,
        100 * wait_share, static_cast<long long>(waited.waits), loss.item<double>());
    std::printf("  host ms per step: forward %.1f, backward %.1f, optimizer step %.1f\n",
                host_ms[0] / a.steps, host_ms[1] / a.steps, host_ms[2] / a.steps);
    if (!a.csv.empty()) {
      std::ofstream f(a.csv, std::ios::app);
      f << "flatshard" << (ddp_mode ? "-ddp" : "") << (a.step_in_backward ? "-stepinbwd" : "")
        << (a.offload ? "-offload" : "") << (a.recompute ? "-recompute" : "")
        << (a.tag.empty() ? "" : "-" + a.tag) << ',' << params << ',' << tokens_per_s << ',' << mfu << ','
        << mem.peak_bytes / gib << ',' << mem.reserved_bytes / gib << ',' << mem.alloc_retries << ','
        << ms / a.steps << ',' << wait_share << '\n';
    }
  }
  if (!a.profile.empty()) {
    namespace prof = torch::autograd::profiler;
    using torch::profiler::impl::ActivityType;
    const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
    const std::set<ActivityType> activities{ActivityType::CPU, ActivityType::CUDA};
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
    for (int i = 0; i < 3; ++i) step();
    check(cudaDeviceSynchronize(), "profiled steps");
    prof::disableProfiler()->save(a.profile +
                                  (world.world_size() > 1 ? "." + std::to_string(world.rank()) : ""));
  }
  return 0;
}
