// GPU tests (run by scripts/gpu.sh on a GPU machine; compiled everywhere a CUDA toolkit
// is, registered with ctest only with FLATSHARD_GPU_TESTS=ON). Without a visible GPU
// they fail: a GPU run that sees no GPU is a broken run, not a pass.
//  - the CUDA step kernels against the CPU ones;
//  - the Communicator on CUDA tensors at world 1 over NCCL: results, Work::wait ordering
//    the caller's stream, argument errors, the caching allocator's figures, the compute
//    stream's stall at a wait timed by events;
//  - FullyShard on CUDA against single-process training on the same global batch: world
//    1 over NCCL (fp32, bf16 compute with fp32 or bf16 reduction; the model moved to the
//    GPU or built on the host and sharded onto it; CPU offload, its masters and gradients
//    page-locked at their size, its copies waiting for a lagging compute stream), world
//    2 over the TCP
//    rings through host memory (two ranks on one GPU, which NCCL refuses);
//  - NoShard (DDP) and ShardOptimizerState (ZeRO-1) on CUDA against single-process
//    training: world 1 over NCCL and world 2 over the TCP rings, fp32 and bf16 compute
//    with fp32 masters, with and without CPU offload;
//  - the planner's device figures (what the wrapper places, the peak), with and without
//    CPU offload, against the allocator's;
//  - hybrid sharding at world 2 over TCP on one GPU, groups of 1 and 2;
//  - a model built into shards onto the GPU (and offloaded), at worlds 1 and 2;
//  - activation recomputation with dropout on the GPU;
//  - sharded checkpoints of CUDA shards, loaded on the CPU and on the GPU with offload;
//    NoShard's and ShardOptimizerState's saved on the GPU and loaded on the CPU.
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "flatshard/flatshard.h"
#include "flatshard/memory.h"
#include "flatshard/plan.h"
#include "optim/step_kernels.h"
#include "src/memory/pinned_host.h"
#include "tests/support/cases.h"
#include "tests/support/mixes.h"
#include "tests/support/multirank.h"

namespace {

namespace kernels = flatshard::optim::kernels;
using flatshard::testing::gpt_batch;
using flatshard::testing::gpt_factory;
using flatshard::testing::OptKind;
using flatshard::testing::token_loss;
using flatshard::testing::TrainSpec;

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define REQUIRE_GPU()                                             \
  do {                                                            \
    if (!have_gpu()) GTEST_FAIL() << "no CUDA device is visible"; \
  } while (0)

const c10::Device kGpu(c10::kCUDA, 0);

// Note [NCCL between ranks on one GPU]: with each rank its own NCCL host id (scripts/gpu.sh
// launches the tests so), worlds 2-4 run over NCCL on the one GPU, through NCCL's network
// transport; otherwise worlds above 1 run over the TCP rings through host memory.
flatshard::Transport gpu_transport(const flatshard::World& world) {
  return world.world_size() == 1 || flatshard::testing::nccl_host_per_rank() ? flatshard::Transport::Nccl
                                                                             : flatshard::Transport::Tcp;
}

// The worlds a multi-rank GPU test runs at: 1-4 where NCCL joins ranks on one GPU (those
// of `worlds` and every larger one up to 4), `worlds` otherwise.
std::vector<int> gpu_worlds(std::vector<int> worlds) {
  if (!flatshard::testing::nccl_host_per_rank()) return worlds;
  for (int n = worlds.back() + 1; n <= 4; ++n) worlds.push_back(n);
  return worlds;
}

TEST(CudaKernels, AdamWMatchesTheCpuKernel) {
  REQUIRE_GPU();
  const std::int64_t n = (1 << 20) + 7;
  auto p = at::randn({n}), g = at::randn({n}), m = at::randn({n}).abs(), v = at::randn({n}).abs();
  auto dp = p.cuda(), dg = g.cuda(), dm = m.cuda(), dv = v.cuda();
  kernels::AdamHyper h;
  h.lr = 1e-3f;
  h.weight_decay = 0.1f;
  h.decoupled_weight_decay = true;
  h.step = 3;
  kernels::adam_step(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n,
                     h);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  kernels::cuda::adam_step(dp.data_ptr<float>(), dg.data_ptr<float>(), dm.data_ptr<float>(),
                           dv.data_ptr<float>(), n, h, s);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_LE((dp.cpu() - p).abs().max().item<float>(), 1e-6f);
  EXPECT_LE((dv.cpu() - v).abs().max().item<float>(), 1e-6f);
  EXPECT_NEAR(kernels::cuda::sum_of_squares(dg.data_ptr<float>(), n, s),
              kernels::sum_of_squares(g.data_ptr<float>(), n), 1e-6 * n);
  cudaStreamDestroy(s);
}

TEST(CudaCommunicator, WorldOneOverNccl) {
  REQUIRE_GPU();
  flatshard::World world;  // one rank, no store
  flatshard::CommunicatorOptions options;
  options.timeout = std::chrono::seconds(60);
  options.name = "test";
  options.device = kGpu;
  auto comm = flatshard::Communicator::create(world, options);
  flatshard::memory::reset_cuda_allocator_peak(0);
  const auto retries_before =
      flatshard::memory::cuda_allocator_stats(0).alloc_retries;  // the process's count

  // The op waits for the work queued on the current stream before it was issued, and
  // the current stream waits for the op after wait(): no host synchronisation between.
  auto t = at::zeros({1 << 20}, at::TensorOptions().device(kGpu));
  t.add_(1.0);
  auto w = comm->all_reduce(t, flatshard::ReduceOp::Sum);
  w.wait();
  t.mul_(2.0);
  auto full = at::empty({1 << 20}, t.options());
  comm->all_gather(full, t).wait();
  auto out = at::empty({1 << 20}, t.options());
  comm->reduce_scatter(out, full, flatshard::ReduceOp::Avg).wait();
  comm->broadcast(out, 0).wait();
  comm->barrier().synchronize();
  EXPECT_TRUE(at::equal(out.cpu(), at::full({1 << 20}, 2.0f)));
  EXPECT_EQ(comm->issued(), 5u);
  auto both = at::full({2 << 20}, -1.0f, t.options());  // one rank is both its neighbours
  comm->neighbor_exchange(both, out).wait();
  const auto got = both.cpu();
  for (int half = 0; half < 2; ++half) {
    const auto h = got.narrow(0, half * (1 << 20), 1 << 20);
    EXPECT_TRUE(at::equal(h, at::full({1 << 20}, 2.0f)))
        << "half " << half << ": min " << h.min().item<float>() << ", max " << h.max().item<float>();
  }

  const auto stats = flatshard::memory::cuda_allocator_stats(0);
  EXPECT_GE(stats.peak_bytes, 3 * (1 << 20) * 4);
  EXPECT_GE(stats.reserved_bytes, stats.current_bytes);
  EXPECT_EQ(stats.alloc_retries, retries_before) << "a few MiB should never need the allocator to retry";

  EXPECT_THROW(comm->all_reduce(at::zeros({4}), flatshard::ReduceOp::Sum), flatshard::InvalidArgument);
}

// Note [Communication wait] on the device: timing events on the compute stream measure
// how long it sits at a wait. A collective held back behind long work on another stream
// stalls it for about that long; one that finished while the compute stream was still
// busy with its own work does not stall it.
TEST(CudaCommunicator, WaitTimeIsTheComputeStreamsStall) {
  REQUIRE_GPU();
  flatshard::World world;
  flatshard::CommunicatorOptions options;
  options.timeout = std::chrono::seconds(60);
  options.name = "wait";
  options.device = kGpu;
  auto comm = flatshard::Communicator::create(world, options);
  auto a = at::randn({4096, 4096}, at::TensorOptions().device(kGpu));
  auto c = at::empty_like(a);
  auto busy = [&](int n) {
    for (int i = 0; i < n; ++i) at::mm_out(c, a, a);
  };
  busy(2);  // library handles, kernels loaded
  cudaEvent_t from, to;
  ASSERT_EQ(cudaEventCreate(&from), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&to), cudaSuccess);
  const auto side = c10::cuda::getStreamFromPool();
  auto t = at::ones({1024}, a.options());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  comm->time_waits(true);
  std::optional<flatshard::Work> held;
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    ASSERT_EQ(cudaEventRecord(from, side.stream()), cudaSuccess);
    busy(40);
    ASSERT_EQ(cudaEventRecord(to, side.stream()), cudaSuccess);
    held = comm->all_reduce(t, flatshard::ReduceOp::Sum);  // waits for the side stream's work
  }
  held->wait();  // the compute stream, idle, waits for it
  const flatshard::CommunicationWait stalled = comm->waited();
  float busy_ms = 0;
  ASSERT_EQ(cudaEventElapsedTime(&busy_ms, from, to), cudaSuccess);
  EXPECT_EQ(stalled.waits, 1);
  EXPECT_GE(stalled.ms, 0.5 * busy_ms) << "the side stream was busy for " << busy_ms << " ms";
  EXPECT_LE(stalled.ms, busy_ms + 1000.0);

  comm->reset_waited();
  auto hidden = comm->all_reduce(t, flatshard::ReduceOp::Sum);  // waits for nothing queued
  busy(40);                                                     // the compute stream's own work
  hidden.wait();
  const flatshard::CommunicationWait overlapped = comm->waited();
  EXPECT_EQ(overlapped.waits, 1);
  EXPECT_LT(overlapped.ms, 0.1 * busy_ms);
  EXPECT_TRUE(at::equal(t.cpu(), at::full({1024}, 1.0f)));
  cudaEventDestroy(from);
  cudaEventDestroy(to);
}

TEST(CudaFullyShard, WorldOneOverNcclMatchesSingleProcess) {
  REQUIRE_GPU();
  flatshard::World world;
  struct Case {
    std::optional<at::ScalarType> param, reduce;
    double tolerance;
  };
  // fp32: rounding only; bf16 compute: bf16 rounding of weights and activations (the
  // reference trains in fp32), the masters stay fp32.
  for (const Case& c : {Case{std::nullopt, std::nullopt, 1e-5}, Case{at::kBFloat16, at::kFloat, 3e-2},
                        Case{at::kBFloat16, at::kBFloat16, 3e-2}}) {
    for (auto strategy : {flatshard::Strategy::FullShard, flatshard::Strategy::ShardGradOp}) {
      SCOPED_TRACE(::testing::Message()
                   << (c.param ? "bf16" : "fp32") << " " << flatshard::to_string(strategy));
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = OptKind::AdamW;
      spec.steps = 6;
      spec.global_batch = 8;
      spec.param_dtype = c.param;
      spec.reduce_dtype = c.reduce;
      spec.device = kGpu;
      spec.transport = flatshard::Transport::Nccl;
      const auto r = flatshard::testing::train_and_compare<flatshard::testing::GPT>(
          world, gpt_factory(), [](int step) { return gpt_batch(step, 8); }, token_loss, spec);
      EXPECT_LE(r.global_rel_weight_diff, c.tolerance) << "worst " << r.worst_param;
      EXPECT_LE(r.max_rel_loss_diff, c.tolerance);
      if (strategy == flatshard::Strategy::FullShard) EXPECT_LE(r.peak_gathered_units, 2);
    }
  }
}

// The model built on the host and sharded onto the GPU (options.device), with and
// without CPU offload: the same training as a model moved to the GPU first. Offloaded
// master shards are page-locked host memory.
TEST(CudaFullyShard, BuiltOnTheHostAndOffloadedMatchSingleProcess) {
  REQUIRE_GPU();
  flatshard::World world;
  for (auto param : {std::optional<at::ScalarType>{}, std::optional<at::ScalarType>{at::kBFloat16}}) {
    for (bool offload : {false, true}) {
      SCOPED_TRACE(::testing::Message() << (param ? "bf16" : "fp32") << (offload ? " offload" : ""));
      TrainSpec spec;
      spec.optimizer = OptKind::AdamW;
      spec.steps = 6;
      spec.global_batch = 8;
      spec.micro_batches = 2;
      spec.clip = 0.25;
      spec.param_dtype = param;
      spec.reduce_dtype = at::kFloat;
      spec.device = kGpu;
      spec.transport = flatshard::Transport::Nccl;
      spec.build_on_host = true;
      spec.cpu_offload = offload;
      const auto r = flatshard::testing::train_and_compare<flatshard::testing::GPT>(
          world, gpt_factory(), [](int step) { return gpt_batch(step, 8); }, token_loss, spec);
      const double tolerance = param ? 3e-2 : 1e-5;
      EXPECT_LE(r.global_rel_weight_diff, tolerance) << "worst " << r.worst_param;
      EXPECT_LE(r.max_rel_loss_diff, tolerance);
      EXPECT_EQ(r.shard_device, offload ? c10::Device(c10::kCPU) : kGpu);
      EXPECT_EQ(r.shards_pinned, offload);
    }
  }
}

// A model built on the host, sharded onto the GPU and offloaded: bf16 compute, fp32
// reduction and masters, NCCL.
flatshard::FullyShardOptions offloaded_bf16(flatshard::Strategy strategy) {
  flatshard::FullyShardOptions options;
  options.strategy = strategy;
  options.device = kGpu;
  options.cpu_offload = true;
  options.comm.transport = flatshard::Transport::Nccl;
  options.mixed_precision.param = at::kBFloat16;
  options.mixed_precision.reduce = at::kFloat;
  return options;
}

// Note [Page-locked at its size]: offloaded master shards and their gradients are blocks
// of exactly their bytes (rounded to a page), not PyTorch's power-of-two pinned blocks. A
// reduced shard lands straight in its group's gradient block, which the group keeps and
// hands out again each step: the page-locked bytes are twice the masters', from the first
// backward on, and do not grow.
TEST(CudaFullyShard, OffloadedGradientsLandInPageLockedBlocksOfTheirSize) {
  REQUIRE_GPU();
  flatshard::World world;
  auto& pinned = flatshard::memory::PinnedHost::instance();
  const auto before = static_cast<std::int64_t>(pinned.live_bytes());
  const auto page = [](std::int64_t bytes) {
    constexpr std::int64_t kPage = flatshard::memory::PinnedHost::kPageBytes;
    return std::max(kPage, (bytes + kPage - 1) / kPage * kPage);
  };
  torch::manual_seed(11);
  flatshard::testing::GPT model(flatshard::testing::gpt_config());  // on the host
  flatshard::FullyShard<flatshard::testing::GPT> fsdp(model, world,
                                                      offloaded_bf16(flatshard::Strategy::FullShard));
  flatshard::optim::AdamW opt(fsdp, flatshard::optim::AdamWOptions{1e-3});
  std::int64_t masters = 0, copies = 0, copy_bytes = 0;
  for (const auto& s : fsdp.shards()) {
    masters += page(s.numel() * 4);
    copies += page(s.numel() * 2);  // Note [The bf16 copy of an offloaded master]
    copy_bytes += s.numel() * 2;
  }
  EXPECT_EQ(static_cast<std::int64_t>(pinned.live_bytes()) - before, masters);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    const auto b = gpt_batch(step, 8);
    token_loss(fsdp.forward(b.input.to(kGpu)).to(at::kFloat), b.target.to(kGpu)).backward();
    for (const auto& s : fsdp.shards()) {
      ASSERT_TRUE(s.grad().defined());
      EXPECT_TRUE(s.grad().is_pinned());
      EXPECT_EQ(s.grad().device(), c10::Device(c10::kCPU));
    }
    const std::int64_t made = step > 0 ? copies : 0;  // the first step makes the bf16 copies
    EXPECT_EQ(static_cast<std::int64_t>(pinned.live_bytes()) - before, 2 * masters + made);
    opt.step();
    opt.zero_grad();
    EXPECT_EQ(static_cast<std::int64_t>(pinned.live_bytes()) - before, 2 * masters + copies);  // kept
    EXPECT_EQ(fsdp.memory().bf16_copy_bytes, copy_bytes);
  }
}

// Note [Copies beside compute]: with the compute stream held back (a spinning kernel before
// each forward and each backward), the host queues a whole step ahead of the GPU: gathered
// buffers are freed and allocated again, and reduced gradients released, while the copies
// to and from the host wait on their own streams for the compute they depend on. Training
// must be bit for bit what it is without the hold-ups, under full shard (a unit's gather
// and its gradient shard) and DDP (the buckets' averages). And bit for bit what it is
// when the fp32 masters cross instead of their bf16 copies (Note [The bf16 copy of an
// offloaded master]): the host rounds as the GPU does; and, lagging, when each unit steps
// in backward on the host as its gradient lands (full shard). An evaluation forward between
// backward and the step, its copies from the host held back behind the lag (a sharded
// strategy's gathers, a replicated one's refresh of its parameters), sees the weights
// before the step, and the step waits for those copies before it writes the masters they
// read (Note [Copies beside compute]).
TEST(CudaFullyShard, OffloadedCopiesWaitForALaggingComputeStream) {
  REQUIRE_GPU();
  flatshard::World world;
  constexpr std::int64_t kLagCycles = 100'000'000;  // tens of milliseconds
  const auto train = [&](flatshard::Strategy strategy, bool lag, bool bf16_copies = true,
                         bool in_backward = false, bool evaluate = false) {
    torch::manual_seed(11);
    flatshard::testing::GPT model(flatshard::testing::gpt_config());  // on the host
    auto options = offloaded_bf16(strategy);
    options.offload_bf16_copy = bf16_copies;
    flatshard::FullyShard<flatshard::testing::GPT> fsdp(model, world, options);
    flatshard::optim::AdamW opt(fsdp, flatshard::optim::AdamWOptions{1e-3});
    if (in_backward) fsdp.step_in_backward(&opt);
    std::vector<at::Tensor> out, evaluated;
    for (int step = 0; step < 3; ++step) {
      const auto b = gpt_batch(step, 8);
      const auto input = b.input.to(kGpu), target = b.target.to(kGpu);
      if (lag) at::cuda::sleep(kLagCycles);
      auto loss = token_loss(fsdp.forward(input).to(at::kFloat), target);
      if (lag) at::cuda::sleep(kLagCycles);
      loss.backward();
      if (evaluate) {  // not read until after the step: nothing here waits for its copies
        if (lag) at::cuda::sleep(kLagCycles);
        torch::NoGradGuard no_grad;
        evaluated.push_back(fsdp.forward(input));
      }
      opt.step();
      opt.zero_grad();
      out.push_back(loss.detach().cpu());
    }
    for (const auto& shard : fsdp.shards()) out.push_back(shard.detach().cpu().clone());
    for (const auto& e : evaluated) out.push_back(e.to(at::kFloat).cpu());
    return out;
  };
  for (auto strategy : {flatshard::Strategy::FullShard, flatshard::Strategy::NoShard,
                        flatshard::Strategy::ShardOptimizerState}) {
    SCOPED_TRACE(flatshard::to_string(strategy));
    const bool sharded = strategy == flatshard::Strategy::FullShard;
    const auto steady = train(strategy, false), lagging = train(strategy, true),
               fp32_sent = train(strategy, false, false);
    // Stepping in backward, each unit steps on the host once its gradient's copy is done
    // (Note [Offloaded steps beside backward]), which the lag holds back.
    const auto in_backward = sharded ? train(strategy, true, true, true) : steady;
    for (const auto* other : {&lagging, &fp32_sent, &in_backward}) {
      ASSERT_EQ(steady.size(), other->size());
      for (std::size_t i = 0; i < steady.size(); ++i) {
        EXPECT_TRUE(at::equal(steady[i], (*other)[i]))
            << (other == &lagging     ? "lagging: "
                : other == &fp32_sent ? "fp32 sent: "
                                      : "in backward: ")
            << (i < 3 ? "loss of step " : "shard ") << (i < 3 ? i : i - 3);
      }
    }
    const auto evaluating = train(strategy, false, true, false, true),
               evaluating_late = train(strategy, true, true, false, true);
    ASSERT_EQ(evaluating.size(), steady.size() + 3);
    ASSERT_EQ(evaluating_late.size(), evaluating.size());
    for (std::size_t i = 0; i < evaluating.size(); ++i) {
      if (i < steady.size())
        EXPECT_TRUE(at::equal(steady[i], evaluating[i])) << "evaluating changed entry " << i;
      EXPECT_TRUE(at::equal(evaluating[i], evaluating_late[i]))
          << (i < steady.size() ? "training entry " : "evaluation of step ")
          << (i < steady.size() ? i : i - steady.size()) << " differs behind the lag";
    }
  }
}

TEST(CudaFullyShard, WorldTwoOverTcpOnOneGpuMatchesSingleProcess) {
  REQUIRE_GPU();
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(240));
  auto world = flatshard::init();
  TrainSpec spec;
  spec.optimizer = OptKind::AdamW;
  spec.steps = 4;
  spec.global_batch = 8;
  spec.device = kGpu;
  spec.transport = flatshard::Transport::Tcp;
  for (bool bf16 : {false, true}) {
    for (auto strategy : {flatshard::Strategy::FullShard, flatshard::Strategy::ShardGradOp}) {
      SCOPED_TRACE(::testing::Message() << (bf16 ? "bf16 " : "fp32 ") << flatshard::to_string(strategy));
      spec.strategy = strategy;
      spec.param_dtype = bf16 ? std::optional<at::ScalarType>{at::kBFloat16} : std::nullopt;
      spec.reduce_dtype = bf16 ? std::optional<at::ScalarType>{at::kFloat} : std::nullopt;
      const auto r = flatshard::testing::train_and_compare<flatshard::testing::GPT>(
          world, gpt_factory(), [](int step) { return gpt_batch(step, 8); }, token_loss, spec);
      EXPECT_LE(r.global_rel_weight_diff, bf16 ? 3e-2 : 1e-5) << "worst " << r.worst_param;
      EXPECT_LE(r.max_rel_loss_diff, bf16 ? 3e-2 : 1e-5);
    }
  }
  spec.strategy = flatshard::Strategy::FullShard;
  spec.param_dtype = at::kBFloat16;
  spec.reduce_dtype = at::kFloat;
  spec.build_on_host = true;
  spec.cpu_offload = true;
  const auto off = flatshard::testing::train_and_compare<flatshard::testing::GPT>(
      world, gpt_factory(), [](int step) { return gpt_batch(step, 8); }, token_loss, spec);
  EXPECT_LE(off.global_rel_weight_diff, 3e-2) << "offload, worst " << off.worst_param;
  EXPECT_LE(off.max_rel_loss_diff, 3e-2) << "offload";
  EXPECT_TRUE(off.shards_pinned);
}

// NoShard (DDP) and ShardOptimizerState (ZeRO-1) on CUDA parameters, fp32 and bf16
// compute with fp32 masters, small buckets (several per model, laid out again after the
// first backward): world 1 over NCCL, world 2 over the TCP rings on one GPU.
TEST(CudaReplicated, EveryModeMatchesSingleProcess) {
  REQUIRE_GPU();
  FLATSHARD_RUN_RANKS(gpu_worlds({1, 2}), std::chrono::seconds(300));
  auto world = flatshard::init();
  for (auto strategy : {flatshard::Strategy::NoShard, flatshard::Strategy::ShardOptimizerState}) {
    for (int variant = 0; variant < 4; ++variant) {
      // fp32, bf16, and both with CPU offload (Note [Offloaded buckets]).
      const auto param = variant % 2 ? std::optional<at::ScalarType>{at::kBFloat16} : std::nullopt;
      const bool offload = variant >= 2;
      SCOPED_TRACE(::testing::Message() << flatshard::to_string(strategy) << (param ? " bf16" : " fp32")
                                        << (offload ? " offload" : "") << " world " << world.world_size());
      TrainSpec spec;
      spec.cpu_offload = offload;
      spec.build_on_host = offload;
      spec.strategy = strategy;
      spec.optimizer = OptKind::AdamW;
      spec.steps = 4;
      spec.global_batch = 12;  // splits over worlds 1-4
      spec.param_dtype = param;
      spec.reduce_dtype = param ? std::optional<at::ScalarType>{at::kFloat} : std::nullopt;
      spec.device = kGpu;
      spec.transport = gpu_transport(world);
      spec.first_bucket_bytes = 64 << 10;
      spec.bucket_bytes = 256 << 10;
      const auto r = flatshard::testing::train_and_compare<flatshard::testing::GPT>(
          world, gpt_factory(), [](int step) { return gpt_batch(step, 12); }, token_loss, spec);
      const double tolerance = param ? 3e-2 : 1e-5;
      EXPECT_LE(r.global_rel_weight_diff, tolerance) << "worst " << r.worst_param;
      EXPECT_LE(r.max_rel_loss_diff, tolerance);
      EXPECT_EQ(r.shard_device, offload ? c10::Device(c10::kCPU) : kGpu);
      EXPECT_EQ(r.shards_pinned, offload);
    }
  }
}

// Fine-tuning on the GPU: the embeddings and every block's norm and attention frozen (a
// partly frozen root and partly frozen blocks, whose backward ends in frozen products:
// Note [Partly frozen units]; the replicated strategies' frozen group: Note [Frozen
// parameters in the replicated strategies]), every strategy, fp32 and bf16, world 1 over
// NCCL and world 2 over TCP on one GPU, against single-process training. The sharded
// strategies also over a model built into shards and frozen afterwards, whose partly
// frozen units are laid out again on the GPU when adopted (Note [Built units frozen
// afterwards]).
TEST(CudaFullyShard, FineTuningMatchesSingleProcessInEveryMode) {
  REQUIRE_GPU();
  FLATSHARD_RUN_RANKS(gpu_worlds({1, 2}), std::chrono::seconds(300));
  auto world = flatshard::init();
  for (auto strategy : {flatshard::Strategy::FullShard, flatshard::Strategy::ShardGradOp,
                        flatshard::Strategy::NoShard, flatshard::Strategy::ShardOptimizerState}) {
    for (int mix = 0; mix < 4; ++mix) {
      const bool bf16 = mix % 2 == 1, built = mix >= 2;
      const bool replicated =
          strategy == flatshard::Strategy::NoShard || strategy == flatshard::Strategy::ShardOptimizerState;
      if (built && replicated) continue;  // they refuse a model built into shards
      SCOPED_TRACE(::testing::Message()
                   << flatshard::to_string(strategy) << (bf16 ? " bf16" : " fp32")
                   << (built ? ", built into shards" : "") << " world " << world.world_size());
      TrainSpec spec;
      spec.build_into_shards = built;
      spec.strategy = strategy;
      spec.optimizer = OptKind::AdamW;
      spec.steps = 4;
      spec.global_batch = 12;  // splits over worlds 1-4
      spec.param_dtype = bf16 ? std::optional<at::ScalarType>{at::kBFloat16} : std::nullopt;
      spec.reduce_dtype = bf16 ? std::optional<at::ScalarType>{at::kFloat} : std::nullopt;
      spec.device = kGpu;
      spec.transport = gpu_transport(world);
      spec.frozen = [](const std::string& n) {
        return n.rfind("wte", 0) == 0 || n.rfind("wpe", 0) == 0 || n.find(".attn.") != std::string::npos ||
               n.find(".ln1.") != std::string::npos;
      };
      const auto r = flatshard::testing::train_and_compare<flatshard::testing::GPT>(
          world, gpt_factory(), [](int step) { return gpt_batch(step, 12); }, token_loss, spec);
      const double tolerance = bf16 ? 3e-2 : 1e-5;
      EXPECT_LE(r.global_rel_weight_diff, tolerance) << "worst " << r.worst_param;
      EXPECT_LE(r.max_rel_loss_diff, tolerance);
    }
  }
}

// Staleness on the GPU (Note [Bounded staleness]): the copies, their reductions and the
// delayed averages on the device, against one process applying each gradient a step late.
TEST(CudaReplicated, StalenessMatchesSingleProcess) {
  REQUIRE_GPU();
  FLATSHARD_RUN_RANKS(gpu_worlds({1, 2}), std::chrono::seconds(300));
  auto world = flatshard::init();
  for (auto strategy : {flatshard::Strategy::NoShard, flatshard::Strategy::ShardOptimizerState}) {
    SCOPED_TRACE(::testing::Message() << flatshard::to_string(strategy) << " world " << world.world_size());
    TrainSpec spec;
    spec.strategy = strategy;
    spec.optimizer = OptKind::AdamW;
    spec.staleness = 1;
    spec.steps = 5;
    spec.global_batch = 12;  // splits over worlds 1-4
    spec.device = kGpu;
    spec.transport = gpu_transport(world);
    const auto r = flatshard::testing::train_and_compare<flatshard::testing::GPT>(
        world, gpt_factory(), [](int step) { return gpt_batch(step, 12); }, token_loss, spec);
    EXPECT_LE(r.global_rel_weight_diff, 1e-5) << "worst " << r.worst_param;
  }
}

// The planner's device figures against the caching allocator at world 1 over NCCL, every
// mode with and without CPU offload (bf16 compute, fp32 masters, AdamW, the model built on
// the host and placed by options.device: PlanOptions::build_on_host): what the wrapper
// places on the GPU within 10% of Plan::construction, the GPU's peak from before the
// wrapper to the end of the third step within 10% of plan::predict's (which leaves
// Plan::host off the GPU under offload), and offload lowers it.
TEST(CudaPlanner, PredictsTheDevicePeakWithAndWithoutOffload) {
  REQUIRE_GPU();
  FLATSHARD_RUN_RANKS({1}, std::chrono::seconds(300));
  auto world = flatshard::init();
  flatshard::testing::GPTConfig config;
  config.vocab = 8192;
  config.context = 64;
  config.dim = 512;
  config.heads = 8;
  config.layers = 4;
  constexpr int kRows = 8;
  const auto batch = [&](int step) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(700 + step);
    const auto tokens = at::randint(config.vocab, {kRows, config.context + 1}, g).to(kGpu);
    return std::make_pair(tokens.narrow(1, 0, config.context).contiguous(),
                          tokens.narrow(1, 1, config.context).contiguous());
  };
  const auto allocated = [] { return flatshard::memory::cuda_allocator_stats(0).current_bytes; };
  std::int64_t activations = 0;  // a bf16 model whose gradients exist: one forward and backward
  {
    torch::manual_seed(5);
    flatshard::testing::GPT model(config);
    model->to(kGpu, at::kBFloat16);
    for (auto& p : model->parameters()) p.mutable_grad() = at::zeros_like(p);
    const auto [x, y] = batch(0);
    token_loss(model->forward(x).to(at::kFloat), y).backward();
    cudaDeviceSynchronize();
    flatshard::memory::reset_cuda_allocator_peak(0);
    const auto before = allocated();
    auto loss = token_loss(model->forward(x).to(at::kFloat), y);
    cudaDeviceSynchronize();
    const auto forward_end = allocated() - before;
    loss.backward();
    loss = at::Tensor();
    cudaDeviceSynchronize();
    activations = flatshard::memory::cuda_allocator_stats(0).peak_bytes - before;
    std::printf(
        "the bf16 model alone: parameters and gradients %.2f MiB; activations %.2f MiB at the end of "
        "forward, peak %.2f MiB\n",
        before / 1048576.0, forward_end / 1048576.0, activations / 1048576.0);
  }
  torch::manual_seed(5);
  const auto shape = flatshard::plan::shape_of(*flatshard::testing::GPT(config));
  for (auto strategy : {flatshard::Strategy::FullShard, flatshard::Strategy::ShardGradOp,
                        flatshard::Strategy::NoShard, flatshard::Strategy::ShardOptimizerState}) {
    std::int64_t without = 0;
    for (bool offload : {false, true}) {
      SCOPED_TRACE(::testing::Message() << flatshard::to_string(strategy) << (offload ? " offload" : ""));
      flatshard::plan::PlanOptions o;
      o.strategy = strategy;
      o.param_bytes = 2;
      o.activation_bytes = activations;
      o.cpu_offload = offload;
      o.build_on_host = true;
      const auto predicted = flatshard::plan::predict(shape, o);
      const auto base = allocated();
      flatshard::memory::reset_cuda_allocator_peak(0);
      std::int64_t measured = 0;
      {
        torch::manual_seed(5);
        flatshard::testing::GPT model(config);  // on the host
        flatshard::FullyShardOptions options;
        options.strategy = strategy;
        options.device = kGpu;
        options.cpu_offload = offload;
        options.mixed_precision.param = at::kBFloat16;
        options.mixed_precision.reduce = at::kFloat;
        flatshard::FullyShard<flatshard::testing::GPT> fsdp(model, world, options);
        // Placed from the host, the device receives what it keeps (Plan::construction:
        // the shards, or the flat buffer and the masters; nothing of the sharded modes'
        // under offload), never the whole model. 1 MiB of slack for the model's buffers.
        cudaDeviceSynchronize();
        const auto placed = flatshard::memory::cuda_allocator_stats(0).peak_bytes - base;
        std::printf("%s%s placed on the GPU: measured %.2f MiB, predicted %.2f MiB\n",
                    flatshard::mode_name(strategy), offload ? " offloaded" : "", placed / 1048576.0,
                    predicted.construction / 1048576.0);
        EXPECT_LE(placed, static_cast<std::int64_t>(1.1 * predicted.construction) + (1 << 20));
        EXPECT_GE(placed, static_cast<std::int64_t>(0.9 * predicted.construction));
        flatshard::optim::AdamW opt(fsdp, flatshard::optim::AdamWOptions{1e-3});
        // Each phase's peak, and what is allocated at its end, above what the device held
        // before the model was placed: where the peak falls when a prediction misses.
        measured = std::max<std::int64_t>(measured, placed);
        const auto phase = [&](const char* what, int step, const auto& body) {
          flatshard::memory::reset_cuda_allocator_peak(0);
          body();
          cudaDeviceSynchronize();
          const auto peak = flatshard::memory::cuda_allocator_stats(0).peak_bytes - base;
          measured = std::max(measured, peak);
          std::printf("  step %d %-8s peak %7.2f MiB, then %7.2f MiB\n", step, what, peak / 1048576.0,
                      (allocated() - base) / 1048576.0);
        };
        for (int step = 0; step < 3; ++step) {
          const auto [x, y] = batch(step);
          at::Tensor loss;
          phase("forward", step, [&] { loss = token_loss(fsdp.forward(x).to(at::kFloat), y); });
          phase("backward", step, [&] {
            loss.backward();
            loss = at::Tensor();
          });
          phase("step", step, [&] {
            opt.step();
            opt.zero_grad();
          });
        }
      }
      const double error = static_cast<double>(predicted.peak - measured) / static_cast<double>(measured);
      std::printf("%s%s world 1 on the GPU: measured %.2f MiB, predicted %.2f MiB (%+.1f%%): %s\n",
                  flatshard::mode_name(strategy), offload ? " offloaded" : "", measured / 1048576.0,
                  predicted.peak / 1048576.0, 100 * error, predicted.describe().c_str());
      EXPECT_LE(std::abs(error), 0.10);
      if (offload) EXPECT_LT(measured, without);
      without = measured;
    }
  }
}

// Hybrid sharding on the GPU, groups of 1 (each rank holds the model; gradient shards
// all-reduced across the groups) and of 2: at world 2, and at 4 (two groups of 2, the
// shard group's reduce-scatter then the replica all-reduce, two communicators on one
// device: Note [One launch order per device]) where NCCL joins ranks on one GPU; with a
// bf16 hook wherever there are two groups or more.
TEST(CudaHybrid, MatchesSingleProcess) {
  REQUIRE_GPU();
  FLATSHARD_RUN_RANKS(flatshard::testing::nccl_host_per_rank() ? std::vector<int>{2, 4} : std::vector<int>{2},
                      std::chrono::seconds(300));
  auto world = flatshard::init();
  // Where there are replicas to average over, also with bf16 on the wire through a
  // communication hook: each unit's hook then runs beside the next unit's backward (Note
  // [Hooks across shard groups]), its flat gradient shard freed behind the hook's own ops.
  for (const auto& [group, hook] : std::vector<std::pair<int, std::shared_ptr<flatshard::CommHook>>>{
           {1, nullptr},
           {2, nullptr},
           {1, flatshard::hooks::low_precision()},
           {2, flatshard::hooks::low_precision()}}) {
    if (hook && world.world_size() / group < 2) continue;
    SCOPED_TRACE(::testing::Message()
                 << "groups of " << group << ", world " << world.world_size() << (hook ? ", bf16 hook" : ""));
    TrainSpec spec;
    spec.strategy = flatshard::Strategy::HybridShard;
    spec.shard_group_size = group;
    spec.hook = hook;
    spec.optimizer = OptKind::AdamW;
    spec.steps = 4;
    spec.global_batch = 8;
    spec.param_dtype = at::kBFloat16;
    spec.reduce_dtype = at::kFloat;
    spec.device = kGpu;
    spec.transport = gpu_transport(world);
    const auto r = flatshard::testing::train_and_compare<flatshard::testing::GPT>(
        world, gpt_factory(), [](int step) { return gpt_batch(step, 8); }, token_loss, spec);
    EXPECT_LE(r.global_rel_weight_diff, 3e-2) << "worst " << r.worst_param;
    EXPECT_LE(r.max_rel_loss_diff, 3e-2);
  }
}

// A hook that says it computes on host tensors is refused on a CUDA wrapper, naming it;
// every hook of flatshard::hooks is taken.
TEST(CudaHooks, HooksThatComputeOnTheHostAreRefused) {
  REQUIRE_GPU();
  flatshard::World world;
  flatshard::FullyShardOptions options;
  options.strategy = flatshard::Strategy::NoShard;
  options.device = kGpu;
  options.comm.transport = flatshard::Transport::Nccl;
  auto model = gpt_factory()();
  flatshard::FullyShard<flatshard::testing::GPT> fsdp(model, world, options);
  struct OnTheHost final : flatshard::CommHook {
    std::string describe() const override { return "on_the_host"; }
    flatshard::HookWork reduce(flatshard::Communicator&, const flatshard::GradBucket&) override { return {}; }
    bool runs_on_cuda() const override { return false; }
  };
  try {
    fsdp.register_comm_hook(std::make_shared<OnTheHost>());
    ADD_FAILURE() << "a host hook was taken on CUDA";
  } catch (const flatshard::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("on_the_host says it does not reduce CUDA gradients"),
              std::string::npos)
        << e.what();
  }
  for (const char* spec :
       {"all_reduce", "bf16", "fp16", "int8", "top_k:0.01", "random_k:0.01", "power_sgd:2"})
    EXPECT_NO_THROW(fsdp.register_comm_hook(flatshard::hooks::parse(spec))) << spec;
}

// Communicators named after `what` on the host (the TCP rings) and on the GPU (over
// `transport`): the same hook's run on each is compared.
std::pair<std::unique_ptr<flatshard::Communicator>, std::unique_ptr<flatshard::Communicator>>
host_and_gpu_comms(const flatshard::World& world, const std::string& what, flatshard::Transport transport) {
  flatshard::CommunicatorOptions o;
  o.timeout = std::chrono::seconds(60);
  o.name = what + "-host";
  auto host = flatshard::Communicator::create(world, o);
  o.name = what + "-gpu";
  o.device = kGpu;
  o.transport = transport;
  return {std::move(host), flatshard::Communicator::create(world, o)};
}

// A hook's state on the host and on the GPU: the same names, the GPU's on the GPU, the same
// values to `tolerance`. PowerSGD's Q columns may differ in sign (LAPACK's and cuSOLVER's QR
// choose their own), which P Q^T, and so every reduced bucket, does not see.
void expect_same_state(const std::map<std::string, at::Tensor>& host,
                       const std::map<std::string, at::Tensor>& gpu, double tolerance) {
  ASSERT_EQ(host.size(), gpu.size());
  for (const auto& [name, t] : host) {
    ASSERT_EQ(gpu.count(name), 1u) << name;
    EXPECT_TRUE(gpu.at(name).is_cuda()) << name;
    const bool q = name.rfind("q.", 0) == 0;
    const at::Tensor other = gpu.at(name).cpu();
    EXPECT_TRUE(at::allclose(q ? t.abs() : t, q ? other.abs() : other, tolerance, tolerance)) << name;
  }
}

// Bucket 0 of `grad` (its parameters laid out as `params` say) reduced by `hook` over `comm`,
// waited for and finished as the engine does; the result on the host, in fp32. With
// `finish_elsewhere` (a GPU bucket) the waits and the finish run with another stream current,
// behind a busy kernel on the first (Note [A hook's two halves on a device]).
at::Tensor reduce_bucket(flatshard::CommHook& hook, flatshard::Communicator& comm, const at::Tensor& grad,
                         int step, const std::vector<flatshard::GradBucket::Param>& params = {},
                         bool finish_elsewhere = false) {
  flatshard::GradBucket bucket;
  bucket.index = 0;
  bucket.step = step;
  bucket.buffer = grad.clone();
  bucket.params = params;
  auto work = hook.reduce(comm, bucket);
  std::optional<c10::cuda::CUDAStreamGuard> elsewhere;
  if (finish_elsewhere) {
    at::cuda::sleep(20 * 1000 * 1000);  // the first stream still busy when the other goes on
    elsewhere.emplace(c10::cuda::getStreamFromPool());
  }
  for (auto& w : work.works) w.wait();
  if (work.finish) work.finish();
  return bucket.buffer.cpu().to(at::kFloat);
}

// Note [A hook's two halves on a device]: the 8-bit, top-k and random-k hooks on the GPU
// give what they give on the host, bucket for bucket (fp32 and bf16 buckets, error feedback
// carried over three steps, a bucket whose length no chunk divides, the last step finished
// with another stream current), at worlds 1 and up; their residuals stay on the GPU. Bit
// for bit is not asked: random-k's all-reduce sums in NCCL's order over NCCL. top-k runs on
// fp32 buckets only: bf16's values tie at the k-th magnitude, where the host's select and
// the device's at::topk choose their own.
TEST(CudaHooks, CompressingHooksOnTheGpuMatchTheHost) {
  REQUIRE_GPU();
  FLATSHARD_RUN_RANKS(gpu_worlds({1, 2}), std::chrono::seconds(240));
  auto world = flatshard::init();
  auto [host, gpu] = host_and_gpu_comms(world, "compressing", gpu_transport(world));
  const std::int64_t numel = 10007;
  for (const char* spec : {"int8:64", "top_k:0.05", "random_k:0.05"}) {
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      if (dtype == at::kBFloat16 && std::string(spec).rfind("top_k", 0) == 0) continue;
      SCOPED_TRACE(::testing::Message()
                   << spec << " " << c10::toString(dtype) << ", world " << world.world_size());
      auto on_host = flatshard::hooks::parse(spec);
      auto on_gpu = flatshard::hooks::parse(spec);
      for (int step = 0; step < 3; ++step) {
        auto g = at::make_generator<at::CPUGeneratorImpl>(700 + 10 * step + world.rank());
        const auto grad = at::randn({numel}, g).to(dtype);
        const auto a = reduce_bucket(*on_host, *host, grad, step);
        const auto b = reduce_bucket(*on_gpu, *gpu, grad.to(kGpu), step, {}, /*finish_elsewhere=*/step == 2);
        EXPECT_TRUE(at::allclose(a, b, 1e-5, 1e-5))
            << "step " << step << ": max diff " << (a - b).abs().max().item<double>();
        EXPECT_GT(a.count_nonzero().item<std::int64_t>(), 0);
      }
      expect_same_state(on_host->state(), on_gpu->state(), 1e-5);
    }
  }
}

// Note [PowerSGD on the device]: the same buckets reduced by PowerSGD on the GPU and on the
// host (warm start and error feedback, a 1-D parameter and padding averaged whole, plain
// averages before start_step) give the same values, step after step, and the same
// residuals; a hook restored on the GPU from the host's state goes on as the host's does.
TEST(CudaHooks, PowerSgdOnTheGpuMatchesTheHost) {
  REQUIRE_GPU();
  flatshard::World world;
  auto [host, gpu] = host_and_gpu_comms(world, "power-sgd", flatshard::Transport::Nccl);
  const flatshard::hooks::PowerSGDOptions settings{3, /*start_step=*/1, true, true, 9};
  auto on_host = flatshard::hooks::power_sgd(settings);
  auto on_gpu = flatshard::hooks::power_sgd(settings);
  const std::int64_t numel = 50 * 40 + 40 + 30 * 100 + 8;
  const std::vector<flatshard::GradBucket::Param> params = {
      {"p", {50, 40}, 0}, {"p", {40}, 2000}, {"p", {30, 100}, 2040}};
  const auto reduce = [&](flatshard::CommHook& hook, flatshard::Communicator& comm, const at::Tensor& grad,
                          int step) { return reduce_bucket(hook, comm, grad, step, params); };
  for (int step = 0; step < 4; ++step) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(500 + step);
    const auto grad = at::randn({numel}, g);
    const auto a = reduce(*on_host, *host, grad, step);
    const auto b = reduce(*on_gpu, *gpu, grad.to(kGpu), step);
    EXPECT_TRUE(at::allclose(a, b, 1e-4, 1e-4))
        << "step " << step << ": max diff " << (a - b).abs().max().item<double>();
  }
  const auto host_state = on_host->state();
  expect_same_state(host_state, on_gpu->state(), 1e-4);
  auto restored = flatshard::hooks::power_sgd(settings);
  restored->load_state(host_state);  // host tensors, as a checkpoint loads them
  auto g = at::make_generator<at::CPUGeneratorImpl>(600);
  const auto grad = at::randn({numel}, g);
  const auto a = reduce(*on_host, *host, grad, 4);
  const auto b = reduce(*restored, *gpu, grad.to(kGpu), 4);
  EXPECT_TRUE(at::allclose(a, b, 1e-4, 1e-4)) << "max diff " << (a - b).abs().max().item<double>();
}

// Built into shards (build.h) with the shards on the GPU (and, offloaded, in pinned host
// memory): world 1 over NCCL, world 2 over the TCP rings on one GPU.
TEST(CudaBuildIntoShards, ShardsOnTheGpuMatchSingleProcess) {
  REQUIRE_GPU();
  FLATSHARD_RUN_RANKS(gpu_worlds({1, 2}), std::chrono::seconds(240));
  auto world = flatshard::init();
  for (bool offload : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "world " << world.world_size() << (offload ? " offload" : ""));
    TrainSpec spec;
    spec.optimizer = OptKind::AdamW;
    spec.steps = 4;
    spec.global_batch = 12;  // splits over worlds 1-4
    spec.device = kGpu;
    spec.transport = gpu_transport(world);
    spec.build_into_shards = true;
    spec.cpu_offload = offload;
    const auto r = flatshard::testing::train_and_compare<flatshard::testing::GPT>(
        world, gpt_factory(), [](int step) { return gpt_batch(step, 12); }, token_loss, spec);
    EXPECT_LE(r.global_rel_weight_diff, 1e-5) << "worst " << r.worst_param;
    EXPECT_LE(r.max_rel_loss_diff, 1e-5);
    EXPECT_EQ(r.shard_device, offload ? c10::Device(c10::kCPU) : kGpu);
    EXPECT_EQ(r.shards_pinned, offload);
  }
}

// Activation recomputation on the GPU, residual dropout on: the CUDA generator is
// restored for the second run, so training matches training without recomputation (to
// the GPU's own run-to-run rounding: embedding backward adds with atomics); a wrong mask
// would move the weights by far more.
TEST(CudaRecompute, MatchesTrainingWithoutIt) {
  REQUIRE_GPU();
  flatshard::World world;
  const auto make = [] {
    torch::manual_seed(11);
    auto c = flatshard::testing::gpt_config();
    c.dropout = 0.2;
    return flatshard::testing::GPT(c);
  };
  TrainSpec spec;
  spec.optimizer = OptKind::AdamW;
  spec.steps = 4;
  spec.global_batch = 8;
  spec.device = kGpu;
  spec.transport = flatshard::Transport::Nccl;
  const auto plain = flatshard::testing::train_and_compare<flatshard::testing::GPT>(
      world, make, [](int step) { return gpt_batch(step, 8); }, token_loss, spec);
  spec.recompute = true;
  const auto recomputed = flatshard::testing::train_and_compare<flatshard::testing::GPT>(
      world, make, [](int step) { return gpt_batch(step, 8); }, token_loss, spec);
  ASSERT_EQ(plain.weights.size(), recomputed.weights.size());
  double diff_sq = 0, norm_sq = 0;
  for (const auto& [name, w] : plain.weights) {
    diff_sq += (w - recomputed.weights.at(name)).square().sum().item<double>();
    norm_sq += w.square().sum().item<double>();
  }
  // Model-wide, as Note [Comparing weights] in test_fully_shard.cpp explains for AdamW.
  EXPECT_LE(std::sqrt(diff_sq / norm_sq), 1e-4);
}

std::vector<at::Tensor> on_host(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().cpu());
  return out;
}

void expect_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << what << " shard " << i;
}

// Sharded checkpoints of CUDA shards: saved from the GPU (staged through page-locked
// host memory), loaded bit for bit into a model sharded on the CPU and into one on the
// GPU with CPU offload, with the optimizer's state; training then goes on alike.
TEST(CudaCheckpoint, DeviceShardsSaveAndLoadOnTheCpuAndTheGpu) {
  REQUIRE_GPU();
  flatshard::World world;
  char dir_template[] = "/tmp/flatshard-cuda-ckpt-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const auto make = [&](std::optional<c10::Device> device, bool offload) {
    flatshard::FullyShardOptions options;
    options.device = device;
    options.cpu_offload = offload;
    options.mixed_precision.param = at::kBFloat16;
    options.mixed_precision.reduce = at::kFloat;
    options.comm.timeout = std::chrono::seconds(60);
    return std::make_unique<flatshard::FullyShard<flatshard::testing::GPT>>(gpt_factory()(), world, options);
  };
  const flatshard::optim::AdamWOptions adamw{1e-3, 0.9, 0.95, 1e-8, 0.1};
  const auto train = [&](flatshard::FullyShard<flatshard::testing::GPT>& fsdp, flatshard::optim::Adam& opt,
                         int step) {
    const auto b = gpt_batch(step, 4);
    const auto device = fsdp.comm().device();
    token_loss(fsdp.forward(b.input.to(device)).to(at::kFloat), b.target.to(device)).backward();
    opt.step();
    opt.zero_grad();
  };
  const auto state = [](flatshard::optim::Adam& opt, std::size_t n) {
    std::vector<at::Tensor> out;
    for (std::size_t i = 0; i < n; ++i) {
      for (const auto& [name, t] : opt.named_state(i)) out.push_back(t.detach().cpu());
    }
    return out;
  };

  auto gpu = make(kGpu, false);
  flatshard::optim::AdamW gpu_opt(*gpu, adamw);
  for (int s = 0; s < 3; ++s) train(*gpu, gpu_opt, s);
  const auto info = flatshard::checkpoint::save_sharded(dir, *gpu, &gpu_opt, {.step = 3});
  EXPECT_EQ(info.step, 3);
  const auto masters = on_host(gpu->shards());
  const auto moments = state(gpu_opt, masters.size());
  ASSERT_FALSE(moments.empty());

  auto cpu = make(std::nullopt, false);  // built on the host, sharded there
  flatshard::optim::AdamW cpu_opt(*cpu, adamw);
  flatshard::checkpoint::load_sharded(dir, *cpu, &cpu_opt);
  expect_equal(on_host(cpu->shards()), masters, "CPU masters");
  expect_equal(state(cpu_opt, masters.size()), moments, "CPU optimizer state");

  auto offloaded = make(kGpu, true);
  flatshard::optim::AdamW off_opt(*offloaded, adamw);
  flatshard::checkpoint::load_sharded(dir, *offloaded, &off_opt);
  expect_equal(on_host(offloaded->shards()), masters, "offloaded masters");
  expect_equal(state(off_opt, masters.size()), moments, "offloaded optimizer state");

  // One more step on the original and on the offloaded copy: the same update.
  train(*gpu, gpu_opt, 3);
  train(*offloaded, off_opt, 3);
  const auto a = on_host(gpu->shards()), b = on_host(offloaded->shards());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE((a[i] - b[i]).norm().item<double>(), 1e-5 * a[i].norm().item<double>() + 1e-12)
        << "shard " << i;
  }
  std::system(("rm -rf " + dir).c_str());
}

// NoShard (DDP) and ShardOptimizerState (ZeRO-1) on the GPU, bf16 compute with fp32
// masters, save sharded checkpoints that load into the same strategies on the CPU: the
// same masters and optimizer state, bit for bit.
TEST(CudaCheckpoint, ReplicatedModesSaveOnTheGpuAndLoadOnTheCpu) {
  REQUIRE_GPU();
  flatshard::World world;
  char dir_template[] = "/tmp/flatshard-cuda-ddp-ckpt-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  using Wrapped = flatshard::FullyShard<flatshard::testing::GPT>;
  const auto make = [&](c10::Device device, flatshard::Strategy strategy) {
    auto model = gpt_factory()();
    model->to(device);
    flatshard::FullyShardOptions options;
    options.strategy = strategy;
    options.mixed_precision.param = at::kBFloat16;
    options.mixed_precision.reduce = at::kFloat;
    options.first_bucket_bytes = 64 << 10;
    options.bucket_bytes = 256 << 10;
    options.comm.timeout = std::chrono::seconds(60);
    return std::make_unique<Wrapped>(model, world, options);
  };
  const flatshard::optim::AdamWOptions adamw{1e-3, 0.9, 0.999, 1e-8, 0.1};
  flatshard::checkpoint::SaveOptions at_step;
  at_step.step = 3;
  for (auto strategy : {flatshard::Strategy::NoShard, flatshard::Strategy::ShardOptimizerState}) {
    SCOPED_TRACE(flatshard::to_string(strategy));
    const std::string path = dir + "/" + flatshard::to_string(strategy);
    auto gpu = make(kGpu, strategy);
    flatshard::optim::AdamW opt(*gpu, adamw);
    for (int s = 0; s < 3; ++s) {
      const auto b = gpt_batch(s, 4);
      token_loss(gpu->forward(b.input.to(kGpu)).to(at::kFloat), b.target.to(kGpu)).backward();
      opt.step();
      opt.zero_grad();
    }
    flatshard::checkpoint::save_sharded(path, *gpu, &opt, at_step);
    const auto state = flatshard::checkpoint::full_optimizer_state_dict(*gpu, opt);
    auto cpu = make(c10::Device(c10::kCPU), strategy);
    flatshard::optim::AdamW cpu_opt(*cpu, adamw);
    flatshard::checkpoint::load_sharded(path, *cpu, &cpu_opt);
    expect_equal({cpu->shards().front().cpu()}, {gpu->shards().front().cpu()}, "masters on the CPU");
    const auto loaded = flatshard::checkpoint::full_optimizer_state_dict(*cpu, cpu_opt);
    ASSERT_EQ(loaded.size(), state.size());
    for (const auto& [name, t] : state) {
      ASSERT_TRUE(loaded.count(name)) << name;
      EXPECT_TRUE(at::equal(loaded.at(name).cpu(), t.cpu())) << "state " << name;
    }
  }
  std::system(("rm -rf " + dir).c_str());
}

// A collective that never completes: rank 1 sleeps past the deadline before it issues
// its all-reduce. Rank 0's watchdog aborts NCCL at its deadline, and rank 0 gets a
// CommError naming the op, its number and the rank within the deadline (plus the poll),
// never a hang. Rank 1's late all-reduce then either fails within its own deadline or,
// where rank 0's aborted kernel was still there to meet it (seen on an H200 with NCCL
// 2.28 over its socket transport: NCCL reported no error on either rank), completes with
// the right sum: never a hang and never a wrong result taken for a right one (Note [An op
// complete on the device is not yet a success]).
TEST(CudaFailures, AStuckRankIsAbortedByTheWatchdogOnEveryRank) {
  REQUIRE_GPU();
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  flatshard::CommunicatorOptions options;
  options.timeout = std::chrono::seconds(4);
  options.name = "stuck";
  options.device = kGpu;
  options.transport = gpu_transport(world);
  auto comm = flatshard::Communicator::create(world, options);
  auto t = at::ones({1 << 16}, at::TensorOptions().device(kGpu));
  comm->all_reduce(t, flatshard::ReduceOp::Sum).synchronize();  // both ranks are up
  if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(6));
  const auto start = std::chrono::steady_clock::now();
  bool completed = false;
  try {
    comm->all_reduce(t, flatshard::ReduceOp::Sum).synchronize();
    completed = true;
  } catch (const flatshard::CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("all_reduce #2"), std::string::npos) << what;
    EXPECT_NE(what.find("rank " + std::to_string(world.rank()) + "/2"), std::string::npos) << what;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(s, 4.0 + 3.0) << "rank " << world.rank() << " waited past the deadline";
  if (world.rank() == 0) {
    EXPECT_FALSE(completed) << "rank 0: the all-reduce completed although its peer slept past the deadline";
  } else if (completed) {
    EXPECT_TRUE(at::equal(t.cpu(), at::full({1 << 16}, 4.0f)))
        << "rank 1: a completed all-reduce gave a wrong sum";
  }
  const auto teardown = std::chrono::steady_clock::now();
  comm.reset();
  std::fprintf(stderr, "rank %d: the all-reduce %s after %.2f s; the communicator went in %.2f s\n",
               world.rank(), completed ? "completed" : "failed", s,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - teardown).count());
}

// Note [Aborting the communicators together]: a failure of one NCCL communicator aborts
// every FlatShard NCCL communicator of the device in one group call (hybrid sharding's
// shard and replica groups are two). Here communicator "held" times out (its all-reduce
// waits behind a 6 s kernel on the compute stream; its deadline is 2 s) and its watchdog
// aborts it; communicator "beside", idle, fails with it: its next op is refused at once
// with an error naming the first failure, not at its own deadline.
TEST(CudaFailures, AFailedCommunicatorAbortsTheDevicesOthersWithIt) {
  REQUIRE_GPU();
  flatshard::World world;
  flatshard::CommunicatorOptions options;
  options.device = kGpu;
  options.transport = flatshard::Transport::Nccl;
  options.timeout = std::chrono::seconds(2);
  options.name = "held";
  auto held = flatshard::Communicator::create(world, options);
  options.timeout = std::chrono::seconds(60);
  options.name = "beside";
  auto beside = flatshard::Communicator::create(world, options);
  auto t = at::ones({1024}, at::TensorOptions().device(kGpu));
  beside->all_reduce(t, flatshard::ReduceOp::Sum).synchronize();  // both work
  int rate_khz = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&rate_khz, cudaDevAttrClockRate, 0), cudaSuccess);
  at::cuda::sleep(static_cast<std::int64_t>(rate_khz) * 1000 * 6);  // about 6 s on the compute stream
  EXPECT_THROW(held->all_reduce(t, flatshard::ReduceOp::Sum).synchronize(), flatshard::CommError);
  const auto start = std::chrono::steady_clock::now();
  try {
    beside->all_reduce(t, flatshard::ReduceOp::Sum).synchronize();
    ADD_FAILURE() << "an op of the device's other communicator ran after NCCL was aborted";
  } catch (const flatshard::CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'held' failed"), std::string::npos) << what;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1.0)
      << "the other communicator's op waited instead of failing with the first";
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the sleeping kernel
}

// Sharded checkpoints of GPU shards saved at world 2 load at other world sizes (1, and
// 3 and 4 where NCCL joins ranks on one GPU): the same full weights and optimizer state,
// bit for bit, and training goes on.
TEST(CudaCheckpoint, SavedOnTheGpuLoadsAtAnotherWorldSize) {
  REQUIRE_GPU();
  if (!flatshard::testing::in_rank_mode()) {
    char dir_template[] = "/tmp/flatshard-cuda-reshard-XXXXXX";
    ASSERT_NE(::mkdtemp(dir_template), nullptr);
    const std::string dir = dir_template;
    auto launch = [&](int ranks, const char* phase) {
      flatshard::testing::LaunchSpec spec;
      spec.ranks = ranks;
      spec.deadline = std::chrono::seconds(180);
      spec.env = {{"FLATSHARD_CKPT_DIR", dir}, {"FLATSHARD_CKPT_PHASE", phase}};
      const auto r = flatshard::testing::launch_current_test(spec);
      EXPECT_EQ(r.exit_code, 0) << phase << " at world " << ranks << "\n" << r.output;
    };
    launch(2, "save");
    for (int n : flatshard::testing::nccl_host_per_rank() ? std::vector<int>{1, 3, 4} : std::vector<int>{1})
      launch(n, "load");
    std::system(("rm -rf " + dir).c_str());
    return;
  }
  auto world = flatshard::init();
  const std::string dir = std::getenv("FLATSHARD_CKPT_DIR");
  const bool save = std::string(std::getenv("FLATSHARD_CKPT_PHASE")) == "save";
  flatshard::FullyShardOptions options;
  options.device = kGpu;
  options.mixed_precision.param = at::kBFloat16;
  options.mixed_precision.reduce = at::kFloat;
  options.comm.transport = gpu_transport(world);
  options.comm.timeout = std::chrono::seconds(60);
  auto model = gpt_factory()();
  flatshard::FullyShard<flatshard::testing::GPT> fsdp(model, world, options);
  flatshard::optim::AdamW opt(fsdp, {1e-3, 0.9, 0.95, 1e-8, 0.1});
  const auto step = [&](int s) {
    const auto b = gpt_batch(s, 4);
    auto loss = token_loss(fsdp.forward(b.input.to(kGpu)).to(at::kFloat), b.target.to(kGpu));
    loss.backward();
    opt.step();
    opt.zero_grad();
    return loss.item<double>();
  };
  if (save) {
    for (int s = 0; s < 3; ++s) step(s);
    flatshard::checkpoint::save_sharded(dir + "/ckpt", fsdp, &opt, {.step = 3});
  } else {
    flatshard::checkpoint::load_sharded(dir + "/ckpt", fsdp, &opt);
  }
  auto weights = flatshard::checkpoint::full_state_dict(fsdp, *model);
  const auto state = flatshard::checkpoint::full_optimizer_state_dict(fsdp, opt);
  if (world.rank() == 0) {
    for (const auto& [name, t] : state) weights["optimizer." + name] = t;
    if (save) {
      flatshard::checkpoint::save_tensors(weights, dir + "/expected.pt");
    } else {
      const auto expected = flatshard::checkpoint::load_tensors(dir + "/expected.pt");
      ASSERT_EQ(weights.size(), expected.size());
      for (const auto& [name, t] : expected) {
        ASSERT_TRUE(weights.count(name)) << name;
        EXPECT_TRUE(at::equal(weights.at(name).cpu(), t.cpu())) << name << " at world " << world.world_size();
      }
    }
  }
  EXPECT_TRUE(std::isfinite(step(3))) << "training goes on at world " << world.world_size();
}

// Random mixes of every strategy's options (tests/support/mixes.h: precision, offload,
// recomputation, building into shards or on the host, stepping in backward, staleness,
// frozen parameters, hooks, a checkpoint halfway loaded with other options) on CUDA
// tensors: world 1 over NCCL, world 2 over the TCP transport on one GPU, each against
// single-process training on the GPU. FLATSHARD_COMBINATIONS / FLATSHARD_COMBINATION_SEED
// as on the CPU.
TEST(CudaCombinations, RandomOptionMixesMatchSingleProcess) {
  REQUIRE_GPU();
  FLATSHARD_RUN_RANKS(gpu_worlds({1, 2}), std::chrono::seconds(600));
  auto world = flatshard::init();
  namespace mixes = flatshard::testing::mixes;
  mixes::train_mixes(world, mixes::env_or("FLATSHARD_COMBINATION_SEED", 20261125),
                     mixes::env_or("FLATSHARD_COMBINATIONS", 4), kGpu, gpu_transport(world), 3e-2);
}

}  // namespace
