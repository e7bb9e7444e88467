// Decentralized and asynchronous data parallelism (FullyShardOptions::decentralized_every
// and ::staleness): the neighbour exchange they need, each rank's weights against the
// ring-averaging formula computed for every rank in one process, delayed updates against
// a single process that applies each step's gradients late, and the settings refused.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "tests/support/cases.h"
#include "tests/support/multirank.h"

namespace {

using namespace flatshard::testing;
using flatshard::Strategy;
namespace hooks = flatshard::hooks;

// This rank's fp32 masters by name: a NoShard replica's shard is its whole flat buffer.
std::map<std::string, at::Tensor> own_masters(flatshard::FullyShardBase& f) {
  std::map<std::string, at::Tensor> out;
  const auto shards = f.shards();
  const auto layout = f.layout();
  for (std::size_t i = 0; i < shards.size(); ++i) {
    for (const auto& seg : layout[i].segments) {
      EXPECT_EQ(seg.slice, seg.padded_numel) << "not a whole replica";
      EXPECT_EQ(seg.shard_offset, seg.offset) << "not a whole replica";
    }
    for (const auto& p : layout[i].params)
      out[p.name] = shards[i].detach().narrow(0, p.offset, p.numel).view(p.shape).clone();
  }
  return out;
}

// Every rank sends a tensor only it could have made and gets both neighbours', through
// direct copies, through sockets (the step against the ring always uses them), and
// mixed; bytes_sent counts one send per neighbour.
TEST(Decentralized, NeighborExchangeDeliversBothNeighbours) {
  FLATSHARD_RUN_RANKS({2, 3, 4});
  const flatshard::World world = flatshard::init();
  const int rank = world.rank(), size = world.world_size();
  auto values = [](int r, std::int64_t numel) { return at::arange(numel, at::kFloat) + 1000.0 * (r + 1); };
  for (int mix = 0; mix < 3; ++mix) {
    SCOPED_TRACE(::testing::Message() << "mix " << mix);
    flatshard::CommunicatorOptions options;
    options.timeout = std::chrono::seconds(60);
    options.name = "neighbors" + std::to_string(mix);
    options.direct_copy = mix == 0 || (mix == 2 && rank != 1);
    auto comm = flatshard::Communicator::create(world, options);
    for (std::int64_t numel : {std::int64_t{1}, std::int64_t{1001}, std::int64_t{3} << 18}) {
      const auto input = values(rank, numel);
      auto output = at::full({2 * numel}, -1.0f);
      const auto before = comm->bytes_sent();
      comm->neighbor_exchange(output, input).wait();
      EXPECT_TRUE(at::equal(output.narrow(0, 0, numel), values((rank + size - 1) % size, numel)));
      EXPECT_TRUE(at::equal(output.narrow(0, numel, numel), values((rank + 1) % size, numel)));
      EXPECT_TRUE(at::equal(input, values(rank, numel))) << "the input must not change";
      EXPECT_EQ(comm->bytes_sent() - before,
                static_cast<std::uint64_t>(input.nbytes()) * (size == 2 ? 1 : 2));
    }
  }
  flatshard::CommunicatorOptions options;
  options.timeout = std::chrono::seconds(60);
  options.name = "neighbors-bad";
  auto comm = flatshard::Communicator::create(world, options);
  EXPECT_THROW(comm->neighbor_exchange(at::zeros({5}), at::zeros({3})), flatshard::InvalidArgument);
}

// Note [Decentralized training] in sharding/averaging.cpp. Every rank trains on its own
// rows with SGD; this process computes every rank's weights by the formula
// w_{t+1,i} = (w_{t,i-1} + w_{t,i} + w_{t,i+1}) / 3 - lr g_{t,i} (averaging only every
// `every`-th step), with g_{t,i} rank i's gradient at its own weights, and compares its
// own rank's with the engine's after each step.
TEST(Decentralized, EachRanksWeightsFollowTheNeighbourAveragingFormula) {
  FLATSHARD_RUN_RANKS({2, 3, 4}, std::chrono::seconds(240));
  auto world = flatshard::init();
  const int n = world.world_size(), rank = world.rank();
  constexpr double lr = 0.05;
  constexpr int kRows = 2;
  auto rows_of = [&](int r, int step) {
    const auto b = gpt_batch(step, kRows * n);
    return Batch{b.input.narrow(0, kRows * r, kRows), b.target.narrow(0, kRows * r, kRows)};
  };
  for (int every : {1, 2}) {
    for (bool bf16 : {false, true}) {
      if (bf16 && every == 2) continue;
      SCOPED_TRACE(::testing::Message() << "every " << every << (bf16 ? " bf16 parameters" : ""));
      // The simulation: one model whose weights are swapped for each rank's in turn.
      GPT sim = gpt_factory()();
      auto names = sim->named_parameters();
      std::vector<std::vector<at::Tensor>> weights(n);
      for (int r = 0; r < n; ++r) {
        for (const auto& p : names) weights[r].push_back(p.value().detach().clone());
      }
      GPT model = gpt_factory()();
      flatshard::FullyShardOptions options;
      options.strategy = Strategy::NoShard;
      options.decentralized_every = every;
      options.comm.timeout = std::chrono::seconds(60);
      if (bf16) options.mixed_precision.param = at::kBFloat16;
      flatshard::FullyShard<GPT> ddp(model, world, options);
      flatshard::optim::SGD opt(ddp, flatshard::optim::SGDOptions{lr});
      for (int step = 0; step < 4; ++step) {
        // Every rank's gradient at its own weights (in bf16 under mixed precision, as the
        // engine computes it).
        std::vector<std::vector<at::Tensor>> grads(n);
        for (int r = 0; r < n; ++r) {
          {
            at::NoGradGuard no_grad;
            for (std::size_t k = 0; k < names.size(); ++k) names[k].value().copy_(weights[r][k]);
          }
          sim->zero_grad();
          const auto b = rows_of(r, step);
          if (bf16) {
            GPT low = gpt_factory()();
            {
              at::NoGradGuard no_grad;
              auto low_params = low->parameters();
              for (std::size_t k = 0; k < names.size(); ++k) low_params[k].copy_(weights[r][k]);
            }
            low->to(at::kBFloat16);
            token_loss(low->forward(b.input).to(at::kFloat), b.target).backward();
            for (auto& p : low->parameters()) grads[r].push_back(p.grad().to(at::kFloat));
          } else {
            token_loss(sim->forward(b.input), b.target).backward();
            for (const auto& p : names) grads[r].push_back(p.value().grad().clone());
          }
        }
        const bool averages = (step + 1) % every == 0;
        std::vector<std::vector<at::Tensor>> next(n);
        for (int r = 0; r < n; ++r) {
          for (std::size_t k = 0; k < names.size(); ++k) {
            at::Tensor w = weights[r][k];
            if (averages) w = (w + weights[(r + n - 1) % n][k] + weights[(r + 1) % n][k]) / 3;
            next[r].push_back(w - lr * grads[r][k]);
          }
        }
        weights = std::move(next);
        // The engine: this rank's rows only.
        const auto b = rows_of(rank, step);
        token_loss(ddp.forward(b.input).to(at::kFloat), b.target).backward();
        opt.step();
        opt.zero_grad();
        // The fp32 masters (under bf16 parameters, what the averaging and the step write;
        // the parameters are their rounding).
        const auto masters = own_masters(ddp);
        for (std::size_t k = 0; k < names.size(); ++k) {
          const auto& expected = weights[rank][k];
          ASSERT_TRUE(masters.count(names[k].key())) << names[k].key();
          const auto& got = masters.at(names[k].key());
          const double scale = std::max(1.0, expected.abs().max().item<double>());
          // bf16 compute: the gradients differ by bf16 rounding in the order of operations
          // (about 2.5e-5 after four steps), far below the replicas' spread (about 1e-2).
          const double tolerance = bf16 ? 1e-4 : kFp32Tolerance;
          EXPECT_LE((got - expected).abs().max().item<double>(), tolerance * scale)
              << "step " << step << " " << names[k].key();
        }
      }
      // The replicas differ (no gradient was averaged), by exactly what the formula says.
      if (rank == 0) {
        double spread = 0;
        for (std::size_t k = 0; k < names.size(); ++k)
          spread = std::max(spread, (weights[0][k] - weights[1][k]).abs().max().item<double>());
        EXPECT_GT(spread, 1e-3) << "the ranks' weights should differ after decentralized steps";
      }
    }
  }
}

// Note [Bounded staleness] in sharding/averaging.cpp: against a single process that
// applies each step's gradients (of the whole global batch) `staleness` steps late.
TEST(Async, DelayedUpdatesMatchASingleProcessApplyingThemLate) {
  FLATSHARD_RUN_RANKS({1, 2, 3}, std::chrono::seconds(300));
  auto world = flatshard::init();
  for (Strategy strategy : {Strategy::NoShard, Strategy::ShardOptimizerState}) {
    for (int staleness : {1, 2}) {
      for (OptKind opt : {OptKind::SGD, OptKind::AdamW}) {
        TrainSpec spec;
        spec.strategy = strategy;
        spec.optimizer = opt;
        spec.staleness = staleness;
        spec.steps = 6;
        const auto r = train_and_compare<GPT>(
            world, gpt_factory(), [&](int s) { return gpt_batch(s, spec.global_batch); }, token_loss, spec);
        SCOPED_TRACE(::testing::Message()
                     << to_string(strategy) << " staleness " << staleness << " " << to_string(opt));
        EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << r.worst_param;
        EXPECT_LE(r.max_rel_loss_diff, kFp32Tolerance);
      }
    }
    {  // with a hook (the plain average), gradient accumulation and clipping
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = OptKind::SGD;
      spec.staleness = 1;
      spec.steps = 5;
      spec.hook = hooks::all_reduce();
      spec.global_batch = 24;
      spec.micro_batches = 2;
      spec.clip = 0.25;
      const auto r = train_and_compare<GPT>(
          world, gpt_factory(), [&](int s) { return gpt_batch(s, spec.global_batch); }, token_loss, spec);
      SCOPED_TRACE(::testing::Message() << to_string(strategy) << " staleness 1 with a hook");
      EXPECT_GT(r.max_grad_norm, spec.clip) << "the test must actually clip";
      EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << r.worst_param;
    }
  }
}

// A delayed update is not the same as an immediate one: the same run without staleness
// ends elsewhere (so the comparison above could not pass by ignoring the option).
TEST(Async, StalenessChangesTheTrajectory) {
  FLATSHARD_RUN_RANKS({2});
  auto world = flatshard::init();
  auto run = [&](int staleness) {
    GPT model = gpt_factory()();
    flatshard::FullyShardOptions options;
    options.strategy = Strategy::NoShard;
    options.staleness = staleness;
    options.comm.timeout = std::chrono::seconds(60);
    flatshard::FullyShard<GPT> ddp(model, world, options);
    flatshard::optim::SGD opt(ddp, flatshard::optim::SGDOptions{0.1});
    for (int step = 0; step < 4; ++step) {
      const auto b = gpt_batch(step, 2 * world.world_size());
      token_loss(ddp.forward(b.input.narrow(0, 2 * world.rank(), 2)), b.target.narrow(0, 2 * world.rank(), 2))
          .backward();
      const bool has_grad = ddp.shards().front().grad().defined();
      EXPECT_EQ(has_grad, step >= staleness) << "step " << step << ": the first steps apply nothing";
      opt.step();
      opt.zero_grad();
    }
    auto full = ddp.summon_full_params();
    return model->parameters().front().detach().clone();
  };
  EXPECT_GT((run(0) - run(1)).abs().max().item<double>(), 1e-5);
}

TEST(Decentralized, BadSettingsAreRefusedNamingTheRankAndSetting) {
  FLATSHARD_RUN_RANKS({2});
  auto world = flatshard::init();
  auto refused = [&](flatshard::FullyShardOptions options, const std::string& expected) {
    options.comm.timeout = std::chrono::seconds(30);
    GPT model = gpt_factory()();
    try {
      flatshard::FullyShard<GPT> fsdp(model, world, options);
      ADD_FAILURE() << "not refused: " << expected;
    } catch (const flatshard::InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(fmt::format("rank {}/2", world.rank())), std::string::npos) << what;
      EXPECT_NE(what.find(expected), std::string::npos) << what;
    }
  };
  struct Case {
    Strategy strategy;
    int staleness, every;
    const char* expected;
  };
  for (const Case& c :
       {Case{Strategy::FullShard, 1, 0, "staleness 1 needs a replicated strategy"},
        Case{Strategy::NoShard, 9, 0, "staleness must be in [0, 8]"},
        Case{Strategy::ShardOptimizerState, 0, 1, "decentralized_every 1 needs Strategy::NoShard"},
        Case{Strategy::NoShard, 1, 1, "do not combine"},
        Case{Strategy::NoShard, 0, -1, "decentralized_every must be >= 0"}}) {
    flatshard::FullyShardOptions o;
    o.strategy = c.strategy;
    o.staleness = c.staleness;
    o.decentralized_every = c.every;
    refused(o, c.expected);
  }
  {  // Note [Offloaded buckets]: the neighbours' averaging runs on the compute device
    flatshard::FullyShardOptions o;
    o.strategy = Strategy::NoShard;
    o.decentralized_every = 1;
    o.cpu_offload = true;
    refused(o, "decentralized_every 1 and cpu_offload do not combine");
  }
  {  // each step's record of the parameters that got a gradient is not the delayed gradient's
    flatshard::FullyShardOptions o;
    o.strategy = Strategy::NoShard;
    o.staleness = 1;
    o.find_unused_parameters = true;
    refused(o, "staleness 1 and find_unused_parameters do not combine");
  }
  flatshard::FullyShardOptions o;
  o.strategy = Strategy::NoShard;
  // A hook has nothing to reduce under decentralized training.
  o.decentralized_every = 1;
  o.comm.timeout = std::chrono::seconds(30);
  GPT model = gpt_factory()();
  flatshard::FullyShard<GPT> ddp(model, world, o);
  try {
    ddp.register_comm_hook(hooks::low_precision());
    ADD_FAILURE() << "a hook under decentralized training was accepted";
  } catch (const flatshard::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("nothing for a hook to reduce"), std::string::npos) << e.what();
  }
}

}  // namespace
