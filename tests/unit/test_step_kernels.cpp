// The CPU step kernels' builds (portable, and AVX2 and AVX-512 on x86-64): each this CPU
// runs must compute the same bits as the portable one, and the widest is the one used.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <c10/util/BFloat16.h>
#include <torch/torch.h>

#include <limits>

#include "flatshard/errors.h"
#include "flatshard/optim.h"
#include "optim/clip.h"
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

// Twenty steps against torch::optim::AdamW on one tensor: the moments agree to float
// rounding, not by a bias of 1.3e-5 that rounding beta2 before 1 - beta2 would give
// (Note [Adam's factors]); the parameters agree to within a few roundings of each step.
TEST(CpuStepKernels, AdamMatchesTorchToRounding) {
  auto param = values(1, 1.0f);
  std::vector<float> m(kNumel, 0.0f), v(kNumel, 0.0f);
  auto reference = torch::from_blob(param.data(), {kNumel}).clone().requires_grad_(true);
  torch::optim::AdamW torch_adam({reference}, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  for (std::int64_t step = 1; step <= 20; ++step) {
    auto grad = values(40 + static_cast<std::uint32_t>(step), 0.5f);
    reference.mutable_grad() = torch::from_blob(grad.data(), {kNumel}).clone();
    torch_adam.step();
    AdamHyper h;
    h.lr = 1e-3;
    h.weight_decay = 0.1;
    h.decoupled_weight_decay = true;
    h.step = step;
    portable().adam_step(param.data(), grad.data(), m.data(), v.data(), kNumel, h);
  }
  const auto& state = static_cast<const torch::optim::AdamWParamState&>(
      *torch_adam.state().at(reference.unsafeGetTensorImpl()));
  const auto relative = [](const std::vector<float>& ours, const at::Tensor& theirs) {
    const auto t = torch::from_blob(const_cast<float*>(ours.data()), {kNumel});
    return ((t - theirs).abs() / theirs.abs().clamp_min(1e-30)).max().item<double>();
  };
  EXPECT_LT(relative(v, state.exp_avg_sq()), 1e-6);
  const auto m_ours = torch::from_blob(m.data(), {kNumel});  // m crosses zero: against its largest
  EXPECT_LT(
      (m_ours - state.exp_avg()).abs().max().item<double>() / state.exp_avg().abs().max().item<double>(),
      1e-6);
  EXPECT_LT((torch::from_blob(param.data(), {kNumel}) - reference.detach()).abs().max().item<double>(), 1e-5);
}

// Clipping by a norm that is NaN makes every gradient NaN, as torch's clip_grad_norm_
// (min(coef, 1) of NaN) does; an Inf norm zeroes them; a small one leaves them.
TEST(CpuStepKernels, ClippingFollowsTorchOnNonFiniteNorms) {
  auto finite = torch::full({3}, 2.0f), poisoned = torch::tensor({1.0f, std::nanf(""), 1.0f});
  EXPECT_TRUE(std::isnan(flatshard::optim::clip_by_global_norm({finite, poisoned}, 1.0, nullptr)));
  EXPECT_TRUE(torch::isnan(finite).all().item<bool>()) << finite;
  auto big = torch::tensor({std::numeric_limits<float>::infinity(), 1.0f});
  EXPECT_TRUE(std::isinf(flatshard::optim::clip_by_global_norm({big}, 1.0, nullptr)));
  EXPECT_EQ(big[1].item<float>(), 0.0f);
  auto small = torch::tensor({0.3f, 0.4f});
  EXPECT_NEAR(flatshard::optim::clip_by_global_norm({small}, 1.0, nullptr), 0.5, 1e-7);
  EXPECT_EQ(small[0].item<float>(), 0.3f);
}

// The bf16 copies that CPU offload sends to the GPU instead of the fp32 masters must be
// the bits the GPU would make of those masters: c10::BFloat16's rounding, in every build,
// on ties, subnormals, infinities, overflow to infinity and NaN too.
TEST(CpuStepKernels, Bf16CopiesRoundAsLibTorchDoes) {
  std::vector<float> x = values(40, 1.0f);
  const auto big = values(41, 1e30f), tiny = values(42, 1e-39f);
  x.insert(x.end(), big.begin(), big.end());
  x.insert(x.end(), tiny.begin(), tiny.end());
  const auto first_special = static_cast<std::ptrdiff_t>(x.size());
  for (std::uint32_t low : {0x8000u, 0x7FFFu, 0x8001u}) {  // ties, and either side of them
    for (std::uint32_t high : {0x3F80u, 0x3F81u, 0xBF81u, 0x0001u, 0x7F7Fu}) {
      const std::uint32_t u = high << 16 | low;
      float f;
      std::memcpy(&f, &u, sizeof f);
      x.push_back(f);
    }
  }
  for (float f :
       {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
        std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(),
        std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN()}) {
    x.push_back(f);
  }
  // The special values again at every position of a 16-wide vector, and any bit pattern
  // at all (NaNs with payloads and either sign among them).
  const std::vector<float> special(x.begin() + first_special, x.end());
  for (int lane = 0; lane < 17; ++lane) {
    x.insert(x.end(), special.begin(), special.end());
    x.push_back(1.0f);
  }
  std::mt19937 bits(7);
  for (int i = 0; i < 4096; ++i) {
    const std::uint32_t u = bits();
    float f;
    std::memcpy(&f, &u, sizeof f);
    x.push_back(f);
  }
  const auto n = static_cast<std::int64_t>(x.size());
  std::vector<std::uint16_t> want(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) want[i] = c10::BFloat16(x[i]).x;
  for (const ChunkKernels* k : runnable()) {
    SCOPED_TRACE(k->isa);
    // Written at every alignment of the destination, and in lengths that end mid-vector.
    for (std::int64_t offset = 0; offset < 17; ++offset) {
      std::vector<std::uint16_t> got(x.size() + offset + 1, 0xABCD);
      const std::int64_t count = n - offset;
      k->to_bf16(x.data(), got.data() + offset, count);
      for (std::int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(got[offset + i], want[i]) << "element " << i << " = " << x[i] << ", offset " << offset;
      }
      ASSERT_EQ(got[offset + count], 0xABCD) << "written past the end, offset " << offset;
      if (offset > 0) ASSERT_EQ(got[offset - 1], 0xABCD) << "written before the start, offset " << offset;
    }
  }
  // The steps write each stepped element's copy, across chunks and threads.
  constexpr std::int64_t kMany = 3 * (std::int64_t{1} << 14) + 5;
  std::vector<float> param(kMany, 0.5f), grad(kMany), m(kMany, 0.0f), v(kMany, 0.0f);
  for (std::int64_t i = 0; i < kMany; ++i) grad[i] = std::sin(static_cast<float>(i));
  std::vector<std::uint16_t> copy(kMany, 0), rounded(kMany);
  AdamHyper h;
  h.lr = 1e-3f;
  kernels::adam_step(param.data(), grad.data(), m.data(), v.data(), kMany, h, copy.data());
  kernels::to_bf16(param.data(), rounded.data(), kMany);
  EXPECT_EQ(copy, rounded);
  EXPECT_EQ(rounded[kMany - 1], c10::BFloat16(param[kMany - 1]).x);
  SgdHyper s;
  s.lr = 0.1f;
  kernels::sgd_step(param.data(), grad.data(), nullptr, kMany, s, copy.data());
  kernels::to_bf16(param.data(), rounded.data(), kMany);
  EXPECT_EQ(copy, rounded);
}

// The rings' sums (src/tcp/ring.cpp): every build gives the bits the scalar arithmetic of
// c10's types gives, fp32 and bf16, summed and averaged, in place too, at every length.
TEST(CpuStepKernels, RingSumsAreTheBitsOfTheTypesOwnArithmetic) {
  std::mt19937 bits(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> a, b;
  for (int i = 0; i < 4099; ++i) {
    a.push_back(normal(bits));
    b.push_back(i % 7 == 0 ? -a.back() : normal(bits));  // exact zeros among the sums
  }
  a.insert(a.end(),
           {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), 1e38f, 0.0f});
  b.insert(b.end(), {-std::numeric_limits<float>::infinity(), 1.0f, 1e38f, -0.0f});
  std::vector<std::uint16_t> ha, hb;
  for (std::size_t i = 0; i < a.size(); ++i) {
    ha.push_back(c10::BFloat16(a[i]).x);
    hb.push_back(c10::BFloat16(b[i]).x);
  }
  const auto n = static_cast<std::int64_t>(a.size());
  auto same_float = [](float x, float y) { return std::memcmp(&x, &y, sizeof x) == 0 || (x != x && y != y); };
  for (int divisor : {1, 3, 257}) {
    std::vector<float> want(a.size());
    std::vector<std::uint16_t> want_h(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      want[i] = divisor == 1 ? a[i] + b[i] : static_cast<float>(a[i] + b[i]) / static_cast<float>(divisor);
      const c10::BFloat16 x = c10::BFloat16(ha[i], c10::BFloat16::from_bits()),
                          y = c10::BFloat16(hb[i], c10::BFloat16::from_bits());
      want_h[i] =
          (divisor == 1 ? c10::BFloat16(x + y) : c10::BFloat16(c10::BFloat16(x + y) / c10::BFloat16(divisor)))
              .x;
    }
    for (const ChunkKernels* k : runnable()) {
      SCOPED_TRACE(std::string(k->isa) + ", divisor " + std::to_string(divisor));
      for (std::int64_t count : {n, n - 1, std::int64_t{15}}) {
        std::vector<float> got(a.size() + 1, 7.0f);
        k->add_f32(got.data(), a.data(), b.data(), count, divisor);
        for (std::int64_t i = 0; i < count; ++i) ASSERT_TRUE(same_float(got[i], want[i])) << "element " << i;
        ASSERT_EQ(got[count], 7.0f) << "written past the end";
        std::vector<std::uint16_t> got_h(hb.begin(), hb.end());  // in place: out is b
        k->add_bf16(got_h.data(), ha.data(), got_h.data(), count, divisor);
        for (std::int64_t i = 0; i < count; ++i) ASSERT_EQ(got_h[i], want_h[i]) << "element " << i;
        for (std::int64_t i = count; i < n; ++i) ASSERT_EQ(got_h[i], hb[i]) << "written past the end";
      }
    }
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

// What torch.optim refuses with ValueError is refused when the optimizer is made: a
// negative rate, momentum, weight decay or eps, betas outside [0, 1), nesterov without
// momentum or with dampening.
TEST(OptimizerOptions, RefuseWhatTorchOptimRefuses) {
  namespace optim = flatshard::optim;
  const auto shards = [] { return std::vector<at::Tensor>{at::zeros({4})}; };
  const auto refused = [](const std::function<void()>& make, const std::string& words) {
    try {
      make();
      ADD_FAILURE() << "accepted; expected: " << words;
    } catch (const flatshard::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  refused([&] { optim::SGD(shards(), optim::SGDOptions{-0.1}); }, "lr must be >= 0");
  refused([&] { optim::SGD(shards(), optim::SGDOptions{0.1, -0.9}); }, "momentum must be >= 0");
  refused([&] { optim::SGD(shards(), optim::SGDOptions{0.1, 0.9, 0, -1e-4}); }, "weight_decay must be >= 0");
  refused([&] { optim::SGD(shards(), optim::SGDOptions{0.1, 0.9, 0.1, 0, true}); }, "nesterov needs");
  refused([&] { optim::Adam(shards(), optim::AdamOptions{1e-3, 0.9, 0.999, -1e-8}); }, "eps must be >= 0");
  refused([&] { optim::Adam(shards(), optim::AdamOptions{1e-3, 0.9, 1.0}); }, "betas must be in [0, 1)");
  refused(
      [&] {
        optim::AdamW(shards(), optim::AdamWOptions{1e-3, 0.9, 0.999, 1e-8, -0.1});
      },
      "weight_decay must be >= 0");
  EXPECT_NO_THROW(optim::AdamW(shards(), optim::AdamWOptions{}));
  EXPECT_NO_THROW(optim::SGD(shards(), optim::SGDOptions{0.1, 0.9, 0.5}));
}
