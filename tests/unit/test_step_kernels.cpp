// The CPU step kernels' builds (portable, and AVX2 and AVX-512 on x86-64): each this CPU
// runs must compute the same bits as the portable one, and the widest is the one used.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flatshard/errors.h"
#include "optim/step_kernels_cpu.h"

namespace flatshard::optim::kernels::cpu {
namespace {

// A length that is no multiple of any vector width, so that every build runs its tail.
constexpr std::int64_t kNumel = 4099;

std::vector<float> values(std::uint32_t seed, float scale, bool positive = false) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(kNumel);
  for (auto& x : v) x = positive ? std::fabs(normal(gen)) : normal(gen);
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct AdamState {
  std::vector<float> param = values(1, 1.0f), m = values(2, 0.1f), v = values(3, 0.01f, true);
};

// Three steps of each decay mode, on gradients that change every step.
AdamState adam_steps(const ChunkKernels& k, float weight_decay, bool decoupled) {
  AdamState s;
  for (std::int64_t step = 1; step <= 3; ++step) {
    const auto grad = values(10 + static_cast<std::uint32_t>(step), 0.5f);
    AdamHyper h;
    h.lr = 1e-2f;
    h.weight_decay = weight_decay;
    h.decoupled_weight_decay = decoupled;
    h.step = step;
    k.adam_step(s.param.data(), grad.data(), s.m.data(), s.v.data(), kNumel, h);
  }
  return s;
}

std::vector<float> sgd_steps(const ChunkKernels& k, const SgdHyper& base) {
  auto param = values(4, 1.0f), buf = values(5, 0.1f);
  SgdHyper h = base;
  for (int step = 0; step < 3; ++step) {
    const auto grad = values(20 + static_cast<std::uint32_t>(step), 0.5f);
    h.first_step = step == 0;
    k.sgd_step(param.data(), grad.data(), h.momentum == 0.0f ? nullptr : buf.data(), kNumel, h);
  }
  param.insert(param.end(), buf.begin(), buf.end());
  return param;
}

TEST(CpuStepKernels, EveryBuildThisCpuRunsComputesThePortableBits) {
  const ChunkKernels& reference = portable();
  const auto builds = runnable();
  ASSERT_EQ(builds.front(), &reference);
  for (const ChunkKernels* k : builds) {
    SCOPED_TRACE(k->isa);
    for (const auto& [decay, decoupled] : {std::pair{0.0f, false}, {0.1f, false}, {0.1f, true}}) {
      const AdamState got = adam_steps(*k, decay, decoupled), want = adam_steps(reference, decay, decoupled);
      EXPECT_TRUE(same_bits(got.param, want.param))
          << "adam params, weight decay " << decay << ", decoupled " << decoupled;
      EXPECT_TRUE(same_bits(got.m, want.m));
      EXPECT_TRUE(same_bits(got.v, want.v));
    }
    for (float momentum : {0.0f, 0.9f}) {
      for (bool nesterov : {false, true}) {
        if (nesterov && momentum == 0.0f) continue;
        for (float decay : {0.0f, 0.01f}) {
          SgdHyper h;
          h.lr = 0.05f;
          h.momentum = momentum;
          h.dampening = nesterov ? 0.0f : 0.1f;
          h.weight_decay = decay;
          h.nesterov = nesterov;
          EXPECT_TRUE(same_bits(sgd_steps(*k, h), sgd_steps(reference, h)))
              << "sgd momentum " << momentum << " nesterov " << nesterov << " decay " << decay;
        }
      }
    }
    const auto x = values(30, 3.0f);
    const double got = k->sum_of_squares(x.data(), kNumel), want = reference.sum_of_squares(x.data(), kNumel);
    EXPECT_EQ(std::memcmp(&got, &want, sizeof got), 0) << got << " against " << want;
  }
}

TEST(CpuStepKernels, TheWidestRunnableBuildIsPickedUnlessOneIsNamed) {
  const auto builds = runnable();
  EXPECT_EQ(&pick(nullptr), builds.back());
  EXPECT_EQ(&pick(""), builds.back());
  for (const ChunkKernels* k : builds) EXPECT_EQ(&pick(k->isa), k);
#if defined(__x86_64__)
  EXPECT_GE(builds.size(), 2u) << "an x86-64 CPU without AVX2";  // every x86-64 server since 2013
#endif
  try {
    pick("sse9");
    FAIL() << "an unknown build was picked";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("FLATSHARD_CPU_KERNELS=sse9"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("portable"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flatshard::optim::kernels::cpu
