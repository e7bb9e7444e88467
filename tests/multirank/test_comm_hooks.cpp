// Communication hooks (include/flatshard/comm_hooks.h): each against a single-process
// computation of the same algorithm over every rank's data; error feedback's accounting;
// the plain hook bit for bit the same as none; training with each under NoShard and
// ShardOptimizerState; and the settings they refuse.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <map>

#include <fmt/format.h>

#include "flatshard/sequential_units.h"
#include "src/comm/hook_kernels.h"
#include "tests/support/cases.h"
#include "tests/support/multirank.h"

namespace {

using namespace flatshard::testing;
using flatshard::CommHook;
using flatshard::GradBucket;
using flatshard::Strategy;
namespace hooks = flatshard::hooks;

constexpr std::int64_t kNumel = 10007;  // not divisible by the world size or a chunk

// Rank r's gradient of bucket `index` at `step`: what every rank can compute for any rank.
at::Tensor gradient(int rank, int step, int index) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(100000 + 1000 * step + 10 * index + rank);
  return at::randn({kNumel}, g);
}

// Runs `hook` on this rank's bucket and returns the result.
at::Tensor run_hook(CommHook& hook, flatshard::Communicator& comm, int step, int index) {
  GradBucket bucket;
  bucket.index = index;
  bucket.step = step;
  bucket.buffer = gradient(comm.rank(), step, index);
  auto work = hook.reduce(comm, bucket);
  for (auto& w : work.works) w.wait();
  if (work.finish) work.finish();
  return bucket.buffer;
}

std::unique_ptr<flatshard::Communicator> make_comm(const flatshard::World& world) {
  flatshard::CommunicatorOptions o;
  o.timeout = std::chrono::seconds(60);
  o.name = "hooks";
  return flatshard::Communicator::create(world, o);
}

at::Tensor mean_gradient(int world, int step, int index) {
  auto sum = at::zeros({kNumel});
  for (int r = 0; r < world; ++r) sum += gradient(r, step, index);
  return sum / world;
}

TEST(CommHooks, PlainLowPrecisionAndQuantizedMatchTheirDefinitions) {
  FLATSHARD_RUN_RANKS({2, 3});
  auto world = flatshard::init();
  auto comm = make_comm(world);
  const int n = world.world_size();
  for (int step = 0; step < 2; ++step) {
    const at::Tensor mean = mean_gradient(n, step, 0);
    // The plain hook is the communicator's own average, bit for bit.
    auto plain = run_hook(*hooks::all_reduce(), *comm, step, 0);
    auto direct = gradient(world.rank(), step, 0);
    comm->all_reduce(direct, flatshard::ReduceOp::Avg).wait();
    EXPECT_TRUE(at::equal(plain, direct));
    // bf16 and fp16 on the wire: within their rounding of each rank's share and of the sums.
    for (auto dtype : {at::kBFloat16, at::kHalf}) {
      auto low = run_hook(*hooks::low_precision({dtype}), *comm, step, 0);
      const double eps = dtype == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
      const double err = (low - mean).abs().max().item<double>();
      EXPECT_LE(err, eps * n * mean.abs().max().item<double>()) << c10::toString(dtype);
      EXPECT_GT(err, 0.0) << "nothing was rounded: the hook did not use " << c10::toString(dtype);
    }
    // 8-bit: exactly the average of every rank's dequantized chunks.
    const std::int64_t chunk = 64;
    auto quantized = run_hook(*hooks::quantize_8bit({chunk}), *comm, step, 0);
    const std::int64_t chunks = (kNumel + chunk - 1) / chunk;
    auto expected = at::zeros({chunks * chunk});
    for (int r = 0; r < n; ++r) {
      auto x = at::zeros({chunks * chunk});
      x.narrow(0, 0, kNumel).copy_(gradient(r, step, 0));
      auto rows = x.view({chunks, chunk});
      auto scale = rows.abs().amax(1) / 127;
      auto codes = (rows / scale.unsqueeze(1)).round().clamp(-127, 127);
      expected += (codes * scale.unsqueeze(1)).view({-1});
    }
    expected = expected.narrow(0, 0, kNumel) / n;
    EXPECT_TRUE(at::allclose(quantized, expected, 1e-6, 1e-6));
    // and within half a quantization step (of the largest chunk scale) of the true average
    double largest = 0;
    for (int r = 0; r < n; ++r) largest = std::max(largest, gradient(r, step, 0).abs().max().item<double>());
    EXPECT_LE((quantized - mean).abs().max().item<double>(), 0.5 * largest / 127 + 1e-6);
  }
  // A NaN in rank 0's chunk 0 and an infinity in the last rank's chunk 4 make those chunks'
  // averages NaN on every rank (rounded into codes, a NaN would pass as a finite value);
  // the other chunks stay finite.
  flatshard::GradBucket bucket;
  bucket.buffer = gradient(world.rank(), 0, 0);
  if (world.rank() == 0) bucket.buffer[5] = std::nan("");
  if (world.rank() == n - 1) bucket.buffer[300] = -INFINITY;
  auto hook = hooks::quantize_8bit({64});
  auto work = hook->reduce(*comm, bucket);
  for (auto& w : work.works) w.wait();
  work.finish();
  const auto chunks = bucket.buffer.narrow(0, 0, 64 * 156).view({156, 64});
  for (std::int64_t c = 0; c < 156; ++c) {
    if (c == 0 || c == 4) {
      EXPECT_TRUE(chunks[c].isnan().all().item<bool>()) << "chunk " << c;
    } else {
      EXPECT_TRUE(chunks[c].isfinite().all().item<bool>()) << "chunk " << c;
    }
  }
}

// src/comm/hook_kernels.h: the host's loops and the tensor operations a device runs compute
// the same bits, here both on the host: the 8-bit codes and scales (chunks holding a NaN or
// an infinity among them), their average over three ranks, the k largest magnitudes, and
// the average of values scattered at positions that overlap across ranks.
TEST(CommHooks, HostLoopsAndDeviceOperationsComputeTheSameBits) {
  namespace k = flatshard::hooks::kernels;
  using k::Form;
  const int world = 3;
  const std::int64_t chunk = 64, chunks = (kNumel + chunk - 1) / chunk;
  const auto same = [](const at::Tensor& a, const at::Tensor& b) {
    return a.sizes() == b.sizes() && at::allclose(a, b, 0, 0, /*equal_nan=*/true);
  };
  at::Tensor codes[2], scales[2];
  for (Form form : {Form::Loops, Form::TensorOps}) {
    const int f = form == Form::Loops ? 0 : 1;
    codes[f] = at::empty({world * chunks * chunk}, at::kChar);
    scales[f] = at::empty({world * chunks});
    for (int r = 0; r < world; ++r) {
      at::Tensor x = gradient(r, 0, 0);
      x.narrow(0, 128, 64).zero_();  // a chunk of zeros: scale 0
      if (r == 1) x[7] = std::nan("");
      if (r == 2) x[200] = INFINITY;
      k::quantize(x, chunk, codes[f].narrow(0, r * chunks * chunk, chunks * chunk),
                  scales[f].narrow(0, r * chunks, chunks), form);
    }
  }
  EXPECT_TRUE(at::equal(codes[0], codes[1]));
  EXPECT_TRUE(same(scales[0], scales[1]));
  EXPECT_TRUE(std::isnan(scales[0][chunks].item<float>()));
  EXPECT_EQ(scales[0][2 * chunks + 3].item<float>(), INFINITY);
  EXPECT_EQ(scales[0][2].item<float>(), 0.0f);
  at::Tensor averaged[2];
  for (Form form : {Form::Loops, Form::TensorOps}) {
    const int f = form == Form::Loops ? 0 : 1;
    averaged[f] = at::empty({kNumel});
    k::average_dequantized(codes[0], scales[0], world, chunk, averaged[f], form);
  }
  EXPECT_TRUE(same(averaged[0], averaged[1]));
  EXPECT_TRUE(averaged[0].narrow(0, 0, 64).isnan().all().item<bool>());
  EXPECT_TRUE(averaged[0].narrow(0, 256, 64).isfinite().all().item<bool>());

  const std::int64_t top = 101;
  const at::Tensor x = gradient(0, 1, 0);
  auto sorted = [](const at::Tensor& t) { return std::get<0>(t.sort()); };
  const at::Tensor by_loops = k::largest_magnitudes(x, top, Form::Loops);
  EXPECT_TRUE(at::equal(sorted(by_loops), sorted(k::largest_magnitudes(x, top, Form::TensorOps))));
  EXPECT_TRUE(at::equal(sorted(by_loops), sorted(std::get<1>(x.abs().topk(top)))));

  at::Tensor values = at::empty({world * top}), index = at::empty({world * top}, at::kInt);
  for (int r = 0; r < world; ++r) {
    const at::Tensor g = gradient(r, 2, 0);
    const at::Tensor chosen = k::largest_magnitudes(g.narrow(0, 0, 500).contiguous(), top, Form::Loops);
    values.narrow(0, r * top, top).copy_(g.index_select(0, chosen));
    index.narrow(0, r * top, top).copy_(chosen);
  }
  at::Tensor scattered[2];
  for (Form form : {Form::Loops, Form::TensorOps}) {
    const int f = form == Form::Loops ? 0 : 1;
    scattered[f] = at::full({kNumel}, 3.0f);  // written over
    k::average_scattered(values, index, world, scattered[f], form);
  }
  EXPECT_TRUE(at::equal(scattered[0], scattered[1]));
  auto expected = at::zeros({kNumel});
  for (int r = 0; r < world; ++r)
    expected.index_add_(0, index.narrow(0, r * top, top).to(at::kLong), values.narrow(0, r * top, top));
  EXPECT_TRUE(at::allclose(scattered[0], expected / world, 1e-6, 1e-7));
  EXPECT_GT(at::count_nonzero(scattered[0]).item<std::int64_t>(), top)
      << "the ranks' positions overlap only in part";
}

// Note [Error feedback] in src/comm/hooks.cpp: each rank sends k values of (gradient +
// residual) and keeps the rest as its residual. Checked step by step against the same
// algorithm run over every rank's data in this process, and by conservation: what the
// hook delivered over the steps plus the ranks' mean residual is the sum of the mean
// gradients.
TEST(CommHooks, SparsifiersWithErrorFeedbackMatchASingleProcessSimulation) {
  FLATSHARD_RUN_RANKS({2, 3});
  auto world = flatshard::init();
  auto comm = make_comm(world);
  const int n = world.world_size();
  const double ratio = 0.05;
  const std::int64_t k = static_cast<std::int64_t>(std::ceil(ratio * kNumel));
  for (bool top : {true, false}) {
    SCOPED_TRACE(top ? "top_k" : "random_k");
    auto hook = top ? hooks::top_k({ratio, true}) : hooks::random_k({ratio, true, 5});
    std::vector<std::vector<at::Tensor>> residuals(2, std::vector<at::Tensor>(n, at::zeros({kNumel})));
    auto delivered = at::zeros({kNumel}), applied = at::zeros({kNumel});
    at::Tensor previous_positions;
    for (int step = 0; step < 4; ++step) {
      for (int index = 0; index < 2; ++index) {
        auto out = run_hook(*hook, *comm, step, index);
        auto& residual = residuals[index];
        const auto positions = out.nonzero().view({-1});
        // random_k: the k positions every rank drew; top_k: each rank's own k, overlapping or not.
        if (top) {
          ASSERT_GE(positions.numel(), k);
          ASSERT_LE(positions.numel(), n * k);
        } else {
          ASSERT_EQ(positions.numel(), k);
        }
        auto expected = at::zeros({kNumel});
        for (int r = 0; r < n; ++r) {
          auto x = gradient(r, step, index) + residual[r];
          // top_k: each rank's own k largest; random_k: the positions every rank drew.
          auto chosen = top ? std::get<1>(x.abs().topk(k)) : positions;
          expected.index_add_(0, chosen, x.index_select(0, chosen));
          residual[r] = x.index_fill(0, chosen, 0);
        }
        expected /= n;
        if (top) {
          EXPECT_TRUE(at::allclose(out, expected, 1e-6, 1e-6));
        } else {
          EXPECT_TRUE(
              at::allclose(out.index_select(0, positions), expected.index_select(0, positions), 1e-6, 1e-6));
          if (index == 0 && previous_positions.defined())
            EXPECT_FALSE(at::equal(positions, previous_positions))
                << "random_k drew the same positions twice";
          if (index == 0) previous_positions = positions;
        }
        if (index == 0) {
          delivered += out;
          applied += mean_gradient(n, step, index);
        }
      }
    }
    const auto state = hook->state();
    ASSERT_EQ(state.count("residual.0"), 1u);
    ASSERT_EQ(state.count("residual.1"), 1u);
    for (int index = 0; index < 2; ++index) {
      EXPECT_TRUE(at::allclose(state.at(fmt::format("residual.{}", index)), residuals[index][world.rank()],
                               1e-5, 1e-5))
          << "this rank's residual of bucket " << index << " is the simulation's";
    }
    auto mean_residual = at::zeros({kNumel});
    for (int r = 0; r < n; ++r) mean_residual += residuals[0][r] / n;
    // Nothing lost: (delivered + mean residual) is every mean gradient so far.
    EXPECT_TRUE(at::allclose(delivered + mean_residual, applied, 1e-4, 1e-4));
    // A hook restored from the state continues as the original would.
    auto restored = top ? hooks::top_k({ratio, true}) : hooks::random_k({ratio, true, 5});
    restored->load_state(hook->state());
    auto a = run_hook(*hook, *comm, 4, 0);
    auto b = run_hook(*restored, *comm, 4, 0);
    EXPECT_TRUE(at::equal(a, b));
  }
}

// PowerSGD against the same algorithm over every rank's data in this process: P = M Q
// averaged and orthonormalized, Q = M^T P averaged, P Q^T applied, M - P Q^T kept; Q warm
// from the step before, or (without warm start) drawn anew every step from the seed and the
// step; the 1-D parameter and the padding averaged whole; and plain averages before
// start_step.
TEST(CommHooks, PowerSgdMatchesASingleProcessSimulation) {
  FLATSHARD_RUN_RANKS({2, 3});
  auto world = flatshard::init();
  auto comm = make_comm(world);
  const int n = world.world_size();
  const std::int64_t numel = 50 * 40 + 40 + 30 * 100 + 8;
  auto grad = [&](int rank, int step) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(500 + 10 * step + rank);
    return at::randn({numel}, g);
  };
  const int rank_r = 3;
  for (bool warm : {true, false}) {
    SCOPED_TRACE(warm ? "warm start" : "a new Q every step");
    auto hook = hooks::power_sgd({rank_r, /*start_step=*/1, warm, true, 9});
    const std::vector<std::pair<std::int64_t, std::vector<std::int64_t>>> params = {
        {0, {50, 40}}, {2000, {40}}, {2040, {30, 100}}};
    std::vector<at::Tensor> residual(n, at::zeros({numel}));
    std::vector<at::Tensor> q(2);
    for (int step = 0; step < 4; ++step) {
      GradBucket bucket;
      bucket.index = 0;
      bucket.step = step;
      bucket.buffer = grad(world.rank(), step);
      for (const auto& [offset, shape] : params) bucket.params.push_back({"p", shape, offset});
      const std::uint64_t sent_before = comm->bytes_sent();
      auto work = hook->reduce(*comm, bucket);
      for (auto& w : work.works) w.wait();
      if (work.finish) work.finish();
      const std::uint64_t sent = comm->bytes_sent() - sent_before;
      auto mean = at::zeros({numel});
      for (int r = 0; r < n; ++r) mean += grad(r, step) / n;
      if (step == 0) {  // before start_step: the plain average
        EXPECT_TRUE(at::allclose(bucket.buffer, mean, 1e-6, 1e-6));
        continue;
      }
      std::vector<at::Tensor> m(n);
      for (int r = 0; r < n; ++r) m[r] = grad(r, step) + residual[r];
      auto expected = at::zeros({numel});
      int k = 0;
      for (const auto& [offset, shape] : params) {
        const std::int64_t size = shape.size() == 2 ? shape[0] * shape[1] : shape[0];
        if (shape.size() == 1) {  // averaged whole
          for (int r = 0; r < n; ++r) expected.narrow(0, offset, size) += m[r].narrow(0, offset, size) / n;
          continue;
        }
        if (!q[k].defined() || !warm) {
          const std::uint64_t fresh = warm ? 0 : static_cast<std::uint64_t>(step) * 104729;
          auto g = at::make_generator<at::CPUGeneratorImpl>(9 * 1000003 + 0 * 7919 + offset + fresh);
          q[k] = at::randn({shape[1], rank_r}, g);
        }
        auto p = at::zeros({shape[0], rank_r});
        for (int r = 0; r < n; ++r) p += m[r].narrow(0, offset, size).view({shape[0], shape[1]}).mm(q[k]) / n;
        p = std::get<0>(at::linalg_qr(p, "reduced"));
        auto new_q = at::zeros({shape[1], rank_r});
        for (int r = 0; r < n; ++r)
          new_q += m[r].narrow(0, offset, size).view({shape[0], shape[1]}).t().mm(p) / n;
        q[k] = new_q;
        expected.narrow(0, offset, size).copy_(p.mm(new_q.t()).view({-1}));
        ++k;
      }
      for (int r = 0; r < n; ++r)
        expected.narrow(0, numel - 8, 8) += m[r].narrow(0, numel - 8, 8) / n;  // padding
      EXPECT_TRUE(at::allclose(bucket.buffer, expected, 1e-4, 1e-4))
          << "step " << step << ": max diff " << (bucket.buffer - expected).abs().max().item<double>();
      for (int r = 0; r < n; ++r) {
        residual[r] = m[r] - expected;
        residual[r].narrow(0, 2000, 40).zero_();
        residual[r].narrow(0, numel - 8, 8).zero_();
      }
      // It compresses: a rank sends P (50x3, 30x3) and Q (40x3, 100x3) and the 48 elements
      // averaged whole, in fp32, each all-reduce under twice its bytes; the whole bucket's
      // all-reduce would send 2 (n-1)/n of its 20 kB.
      const std::uint64_t most = 2 * 4 * ((50 + 30) * rank_r + (40 + 100) * rank_r + 48);
      EXPECT_GT(sent, 0u);
      EXPECT_LE(sent, most) << "step " << step << ": the whole bucket would be "
                            << 2 * 4 * numel * (n - 1) / n;
    }
    EXPECT_TRUE(at::allclose(hook->state().at("residual.0"), residual[world.rank()], 1e-4, 1e-4));
    EXPECT_EQ(hook->state().count("q.0.0"), warm ? 1u : 0u) << "only a warm start keeps Q";
  }
}

// Trains `steps` steps of GPT under `strategy` with `hook` (or none) and returns this
// rank's master shards.
std::vector<at::Tensor> train(const flatshard::World& world, Strategy strategy,
                              std::shared_ptr<CommHook> hook, int steps,
                              std::vector<double>* losses = nullptr) {
  GPT model = gpt_factory()();
  flatshard::FullyShardOptions options;
  options.strategy = strategy;
  options.comm.timeout = std::chrono::seconds(60);
  options.bucket_bytes = 64 << 10;  // several buckets
  options.first_bucket_bytes = 16 << 10;
  flatshard::FullyShard<GPT> ddp(model, world, options);
  if (hook) ddp.register_comm_hook(hook);
  flatshard::optim::AdamW opt(ddp, flatshard::optim::AdamWOptions{3e-3});
  const int rows = 2;
  for (int s = 0; s < steps; ++s) {
    const auto b = gpt_batch(s % 2, rows * world.world_size());
    auto loss = token_loss(ddp.forward(b.input.narrow(0, rows * world.rank(), rows)),
                           b.target.narrow(0, rows * world.rank(), rows));
    loss.backward();
    opt.step();
    opt.zero_grad();
    if (losses) losses->push_back(loss.item<double>());
  }
  std::vector<at::Tensor> out;
  for (const auto& s : ddp.shards()) out.push_back(s.detach().clone());
  return out;
}

// Counts the buckets a hook is handed: a wrapper that ignored register_comm_hook would train
// as if it had none, which a hook that averages plainly cannot show.
class CountingHook final : public CommHook {
 public:
  explicit CountingHook(std::shared_ptr<CommHook> inner) : inner(std::move(inner)) {}
  std::string describe() const override { return "counting " + inner->describe(); }
  flatshard::HookWork reduce(flatshard::Communicator& comm, const GradBucket& bucket) override {
    ++calls;
    return inner->reduce(comm, bucket);
  }
  std::map<std::string, at::Tensor> state() const override { return inner->state(); }
  void load_state(const std::map<std::string, at::Tensor>& state) override { inner->load_state(state); }
  bool runs_on_cuda() const override { return inner->runs_on_cuda(); }
  std::shared_ptr<CommHook> inner;
  int calls = 0;
};

TEST(CommHooks, PlainHookTrainsBitForBitAsNoHook) {
  FLATSHARD_RUN_RANKS({2, 3}, std::chrono::seconds(120));
  auto world = flatshard::init();
  for (Strategy strategy : {Strategy::NoShard, Strategy::ShardOptimizerState}) {
    SCOPED_TRACE(to_string(strategy));
    const auto none = train(world, strategy, nullptr, 3);
    auto counting = std::make_shared<CountingHook>(hooks::all_reduce());
    const auto plain = train(world, strategy, counting, 3);
    EXPECT_GE(counting->calls, 3 * 2) << "every step hands the hook several buckets";
    ASSERT_EQ(none.size(), plain.size());
    for (std::size_t i = 0; i < none.size(); ++i) EXPECT_TRUE(at::equal(none[i], plain[i]));
  }
}

// Every hook trains: the replicas stay identical on every rank (each rank ends with the
// same bits), and the loss on the two alternating batches falls.
TEST(CommHooks, EveryHookTrainsAndKeepsTheReplicasIdentical) {
  FLATSHARD_RUN_RANKS({2, 3}, std::chrono::seconds(300));
  auto world = flatshard::init();
  auto comm = make_comm(world);
  const std::vector<std::pair<std::string, std::shared_ptr<CommHook>>> all = {
      {"bf16", hooks::low_precision({at::kBFloat16})},
      {"fp16", hooks::low_precision({at::kHalf})},
      {"8-bit", hooks::quantize_8bit()},
      {"top 10%", hooks::top_k({0.1, true})},
      {"random 10%", hooks::random_k({0.1, true, 1})},
      {"PowerSGD rank 2", hooks::power_sgd({2, 2})}};
  for (Strategy strategy : {Strategy::NoShard, Strategy::ShardOptimizerState}) {
    const auto none = train(world, strategy, nullptr, 8);
    for (const auto& [name, hook] : all) {
      SCOPED_TRACE(::testing::Message() << to_string(strategy) << " " << name);
      std::vector<double> losses;
      auto counting = std::make_shared<CountingHook>(hook);
      const auto shards = train(world, strategy, counting, 8, &losses);
      EXPECT_GE(counting->calls, 8 * 2) << "every step hands the hook several buckets";
      EXPECT_LT(losses[6] + losses[7], losses[0] + losses[1]) << "the loss did not fall";
      // Every one of these loses something on the wire: what it trains is not the plain average's.
      ASSERT_EQ(shards.size(), none.size());
      bool differs = false;
      for (std::size_t i = 0; i < shards.size(); ++i) differs = differs || !at::equal(shards[i], none[i]);
      EXPECT_TRUE(differs) << "the hook changed nothing: it did not reduce";
      if (strategy == Strategy::NoShard) {
        for (const auto& s : shards) {
          auto mine = s.clone(), other = s.clone();
          comm->broadcast(other, 0).wait();
          EXPECT_TRUE(at::equal(mine, other))
              << "rank " << world.rank() << "'s replica differs from rank 0's";
        }
      }
    }
  }
}

// A run saved and resumed with its hook's state (residuals, PowerSGD's Q) continues bit
// for bit as the run that was not interrupted; resumed with a fresh hook, it does not.
TEST(CommHooks, HookStateIsSavedAndResumedBitForBit) {
  FLATSHARD_RUN_RANKS({2}, std::chrono::seconds(120));
  auto world = flatshard::init();
  const std::string dir = ::testing::TempDir() + "/hook_state_" + std::to_string(::getppid());
  for (auto make :
       std::vector<std::function<std::shared_ptr<CommHook>()>>{[] {
                                                                 return hooks::top_k({0.05, true});
                                                               },
                                                               [] {
                                                                 return hooks::power_sgd({2, 1});
                                                               }}) {
    SCOPED_TRACE(make()->describe());
    flatshard::FullyShardOptions options;
    options.strategy = Strategy::NoShard;
    options.comm.timeout = std::chrono::seconds(60);
    options.bucket_bytes = 64 << 10;
    auto run = [&](flatshard::FullyShard<GPT>& ddp, flatshard::optim::AdamW& opt, int from, int to) {
      for (int s = from; s < to; ++s) {
        const auto b = gpt_batch(s, 2 * world.world_size());
        auto loss = token_loss(ddp.forward(b.input.narrow(0, 2 * world.rank(), 2)),
                               b.target.narrow(0, 2 * world.rank(), 2));
        loss.backward();
        opt.step();
        opt.zero_grad();
      }
    };
    auto shards_of = [](flatshard::FullyShard<GPT>& ddp) {
      std::vector<at::Tensor> out;
      for (const auto& s : ddp.shards()) out.push_back(s.detach().clone());
      return out;
    };
    GPT a_model = gpt_factory()();
    flatshard::FullyShard<GPT> a(a_model, world, options);
    a.register_comm_hook(make());
    flatshard::optim::AdamW a_opt(a, flatshard::optim::AdamWOptions{3e-3});
    run(a, a_opt, 0, 3);
    flatshard::checkpoint::SaveOptions save;
    save.step = 3;
    flatshard::checkpoint::save_sharded(dir, a, &a_opt, save);
    run(a, a_opt, 3, 5);
    const auto uninterrupted = shards_of(a);
    for (bool restore_hook : {true, false}) {
      GPT b_model = gpt_factory()();
      flatshard::FullyShard<GPT> b(b_model, world, options);
      b.register_comm_hook(make());
      flatshard::optim::AdamW b_opt(b, flatshard::optim::AdamWOptions{3e-3});
      flatshard::checkpoint::load_sharded(dir, b, &b_opt);
      if (!restore_hook) b.register_comm_hook(make());  // a fresh hook: no residuals, no Q
      run(b, b_opt, 3, 5);
      const auto resumed = shards_of(b);
      bool same = true;
      for (std::size_t i = 0; i < resumed.size(); ++i) same = same && at::equal(resumed[i], uninterrupted[i]);
      EXPECT_EQ(same, restore_hook) << (restore_hook ? "the resumed run differs"
                                                     : "the hook's state made no difference");
    }
  }
}

// Note [Hooks across shard groups] in sharding/averaging.cpp: under HybridShard the hook
// averages each unit's shard over the groups. The plain average through a hook that
// checks what it is given trains as one process does; bf16 on the wire lands within its
// rounding of it.
class CheckingHook final : public CommHook {
 public:
  std::string describe() const override { return "checking"; }
  flatshard::HookWork reduce(flatshard::Communicator& comm, const GradBucket& bucket) override {
    ++calls;
    EXPECT_EQ(comm.world_size(), 2) << "the hook averages over the 2 groups, not the world";
    for (const auto& p : bucket.params) {
      std::int64_t numel = 1;
      for (auto d : p.shape) numel *= d;
      EXPECT_GE(p.offset, 0) << p.name;
      EXPECT_LE(p.offset + numel, bucket.buffer.numel()) << p.name << " is not wholly in the shard";
    }
    return inner->reduce(comm, bucket);
  }
  std::shared_ptr<CommHook> inner = hooks::all_reduce();
  int calls = 0;
};

TEST(CommHooks, HybridShardAveragesAcrossGroupsThroughTheHook) {
  FLATSHARD_RUN_RANKS({4}, std::chrono::seconds(240));
  auto world = flatshard::init();
  auto checking = std::make_shared<CheckingHook>();
  TrainSpec spec;
  spec.strategy = Strategy::HybridShard;
  spec.shard_group_size = 2;
  spec.optimizer = OptKind::PlainSGD;  // moves by the gradient: a wrong divisor across groups shows
  spec.steps = 4;
  spec.hook = checking;
  auto r = train_and_compare<GPT>(
      world, gpt_factory(), [&](int s) { return gpt_batch(s, spec.global_batch); }, token_loss, spec);
  EXPECT_LE(r.max_rel_weight_diff, 1e-5) << r.worst_param;
  EXPECT_GT(checking->calls, 0);
  // How far plain training moves the weights (over all of them, as global_rel_weight_diff
  // measures): what a hook that dropped the gradients would be off by.
  const auto moved_from_start = [](const std::map<std::string, at::Tensor>& weights) {
    double moved_sq = 0, start_sq = 0;
    const GPT start = gpt_factory()();
    for (const auto& item : start->named_parameters()) {
      moved_sq += (weights.at(item.key()).to(at::kFloat) - item.value()).pow(2).sum().item<double>();
      start_sq += item.value().pow(2).sum().item<double>();
    }
    return std::sqrt(moved_sq / start_sq);
  };
  const double moved = moved_from_start(r.weights);
  ASSERT_GT(moved, 1e-3) << "the weights hardly moved";
  spec.optimizer = OptKind::SGD;
  spec.hook = hooks::low_precision();
  r = train_and_compare<GPT>(
      world, gpt_factory(), [&](int s) { return gpt_batch(s, spec.global_batch); }, token_loss, spec);
  // bf16 rounding of the averaged gradients moves the model by about 1e-5 of its norm; a
  // wrong divisor across the groups would move it by about what training moves it (2e-3).
  EXPECT_LE(r.global_rel_weight_diff, 1e-4);
  EXPECT_LE(r.max_rel_weight_diff, 1e-2) << r.worst_param;
  EXPECT_GT(r.max_rel_weight_diff, 0.0) << "nothing was rounded: the bf16 hook did not run";
  spec.hook = hooks::power_sgd({2, 0});
  r = train_and_compare<GPT>(
      world, gpt_factory(), [&](int s) { return gpt_batch(s, spec.global_batch); }, token_loss, spec);
  EXPECT_TRUE(std::isfinite(r.max_rel_weight_diff));
  // Compressed to rank 2 the updates differ from the exact ones, but they are applied: a hook
  // that delivered zeros (or nothing) would leave the weights where they started.
  EXPECT_GT(moved_from_start(r.weights), 0.3 * moved);
  // Compressed or not, every rank ends with the same model: the groups' replicas agree.
  auto comm = make_comm(world);
  for (const auto& [name, w] : r.weights) {
    auto mean = w.to(at::kFloat).clone();
    comm->all_reduce(mean, flatshard::ReduceOp::Avg).wait();
    EXPECT_TRUE(at::allclose(mean, w.to(at::kFloat), 1e-6, 1e-6)) << name << " differs between ranks";
  }
}

// Note [Hooks across shard groups]: a unit's hook runs beside the next unit's backward. A
// tap after each unit's layer counts the units whose backward has begun (their output's
// gradient computed); the hook notes the count when each unit's shard is handed to it and
// again when the engine finishes it. Run at once (waited for where it is handed over), no
// unit's backward could begin between the two; beside backward, every unit but the last
// two of a backward (their hooks finished at its end) sees the next one's begin.
struct TapImpl : torch::nn::Module {
  explicit TapImpl(std::atomic<int>* begun) : begun(begun) {}
  at::Tensor forward(at::Tensor x) {
    if (x.requires_grad()) x.register_hook([b = begun](const at::Tensor&) { ++*b; });
    return x;
  }
  std::atomic<int>* begun;
};
TORCH_MODULE(Tap);

class OverlapHook final : public CommHook {
 public:
  explicit OverlapHook(std::atomic<int>* begun) : begun_(begun) {}
  std::string describe() const override { return "overlap"; }
  flatshard::HookWork reduce(flatshard::Communicator& comm, const GradBucket& bucket) override {
    const int at_start = begun_->load();
    flatshard::HookWork work = inner_->reduce(comm, bucket);
    auto finish = std::move(work.finish);
    work.finish = [this, finish, at_start] {
      if (finish) finish();
      ++finished;
      if (begun_->load() > at_start) ++overlapped;
    };
    return work;
  }
  int finished = 0, overlapped = 0;

 private:
  std::atomic<int>* begun_;
  std::shared_ptr<CommHook> inner_ = flatshard::hooks::all_reduce();
};

TEST(CommHooks, HybridShardRunsEachUnitsHookBesideTheNextUnitsBackward) {
  FLATSHARD_RUN_RANKS({4}, std::chrono::seconds(120));
  auto world = flatshard::init();
  std::atomic<int> begun{0};
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  constexpr int kUnits = 6;
  for (int i = 0; i < kUnits; ++i) {
    seq->push_back(torch::nn::Linear(16, 16));
    seq->push_back(Tap(&begun));
  }
  flatshard::SequentialUnits model(seq);
  flatshard::FullyShardOptions options;
  options.strategy = Strategy::HybridShard;
  options.shard_group_size = 2;
  flatshard::FullyShard<flatshard::SequentialUnits> fsdp(model, world, options);
  auto hook = std::make_shared<OverlapHook>(&begun);
  fsdp.register_comm_hook(hook);
  constexpr int kSteps = 3;
  for (int step = 0; step < kSteps; ++step) {
    fsdp.forward(at::randn({4, 16})).square().sum().backward();
    fsdp.zero_grad();
  }
  EXPECT_EQ(hook->finished, kSteps * kUnits) << "every unit's shard, every step (the root holds none)";
  EXPECT_EQ(hook->overlapped, kSteps * (kUnits - 2))
      << "each unit's hook but the last two ran beside a backward";
}

TEST(CommHooks, BadSettingsAreRefusedNamingTheRankAndSetting) {
  FLATSHARD_RUN_RANKS({2});
  auto world = flatshard::init();
  EXPECT_THROW(hooks::top_k({0.0}), flatshard::InvalidArgument);
  EXPECT_THROW(hooks::random_k({1.5}), flatshard::InvalidArgument);
  EXPECT_THROW(hooks::quantize_8bit({0}), flatshard::InvalidArgument);
  EXPECT_THROW(hooks::low_precision({at::kFloat}), flatshard::InvalidArgument);
  EXPECT_THROW(hooks::power_sgd({0}), flatshard::InvalidArgument);
  {
    GPT model = gpt_factory()();
    flatshard::FullyShardOptions options;
    options.strategy = Strategy::FullShard;
    flatshard::FullyShard<GPT> fsdp(model, world, options);
    try {
      fsdp.register_comm_hook(hooks::low_precision());
      ADD_FAILURE() << "FullShard accepted a communication hook";
    } catch (const flatshard::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("NoShard"), std::string::npos) << e.what();
    }
  }
  {  // HybridShard over one group: there are no replicas to average over
    GPT model = gpt_factory()();
    flatshard::FullyShardOptions options;
    options.strategy = Strategy::HybridShard;
    options.shard_group_size = 2;
    flatshard::FullyShard<GPT> fsdp(model, world, options);
    try {
      fsdp.register_comm_hook(hooks::low_precision());
      ADD_FAILURE() << "HybridShard with one group accepted a communication hook";
    } catch (const flatshard::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("its only shard group"), std::string::npos) << e.what();
    }
  }
  GPT model = gpt_factory()();
  flatshard::FullyShardOptions options;
  options.strategy = Strategy::NoShard;
  options.comm.timeout = std::chrono::seconds(30);
  flatshard::FullyShard<GPT> ddp(model, world, options);
  try {
    ddp.register_comm_hook(hooks::top_k({world.rank() == 0 ? 0.01 : 0.02}));
    ADD_FAILURE() << "ranks registered different hook settings and nothing said so";
  } catch (const flatshard::InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(world.rank() == 0 ? "rank 1" : "rank 0"), std::string::npos) << what;
    EXPECT_NE(what.find("ratio=0.0"), std::string::npos) << what;
  }
}

}  // namespace
