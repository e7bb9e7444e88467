// GPU tests (run by scripts/gpu.sh on a GPU machine; compiled everywhere a CUDA toolkit
// is): the CUDA step kernels against the CPU ones, NCCL collectives at world 1, the
// CUDA memory figures.
#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include "flatshard/cuda/nccl.h"
#include "flatshard/flatshard.h"
#include "optim/step_kernels.h"

namespace {

namespace kernels = flatshard::optim::kernels;

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define REQUIRE_GPU()                                             \
  do {                                                            \
    if (!have_gpu()) GTEST_FAIL() << "no CUDA device is visible"; \
  } while (0)

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

TEST(Nccl, WorldOneCollectivesAndMemoryFigures) {
  REQUIRE_GPU();
  flatshard::World world;  // one rank, no store
  auto nccl = flatshard::cuda::NcclCommunicator::create(world, {std::chrono::seconds(60), "test"}, 0);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  flatshard::cuda::reset_cuda_peak(0);
  auto t = at::arange(1000, at::kFloat).cuda();
  nccl->all_reduce(t, flatshard::ReduceOp::Sum, s);
  auto full = at::empty({1000}, t.options());
  nccl->all_gather(full, t, s);
  auto out = at::empty({1000}, t.options());
  nccl->reduce_scatter(out, full, flatshard::ReduceOp::Avg, s);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_TRUE(at::equal(out.cpu(), at::arange(1000, at::kFloat)));
  nccl->check();
  const auto stats = flatshard::cuda::cuda_memory_stats(0);
  EXPECT_GE(stats.peak_allocated_bytes, 3 * 1000 * 4);
  EXPECT_GE(stats.reserved_bytes, stats.allocated_bytes);
  EXPECT_THROW(nccl->all_reduce(at::zeros({4}), flatshard::ReduceOp::Sum, s), flatshard::InvalidArgument);
  cudaStreamDestroy(s);
}

}  // namespace
