// Faults during training: non-finite gradients on one rank, a rank killed at each phase
// of a step (and during a checkpoint save).
#include <csignal>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <thread>

#include "tests/support/cases.h"
#include "tests/support/multirank.h"
#include "tests/support/wrapped.h"

namespace {

using namespace flatshard::testing;
namespace fs = std::filesystem;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

using flatshard::Strategy;

GPT seeded_gpt() {
  torch::manual_seed(11);
  return GPT(gpt_config());
}

// The GPT-style test model under one mode with a non-finite-gradient policy.
struct Trainer : flatshard::testing::Wrapped<GPT> {
  Trainer(const flatshard::World& w, Strategy mode, flatshard::NonFiniteGrads policy)
      : Wrapped(seeded_gpt(), w, mode, options(policy)), world(w) {}

  static flatshard::testing::WrappedOptions options(flatshard::NonFiniteGrads policy) {
    flatshard::testing::WrappedOptions o;
    o.fully_shard.nonfinite_grads = policy;
    o.fully_shard.comm.timeout = std::chrono::seconds(20);
    o.fully_shard.first_bucket_bytes = 2 << 10;
    o.fully_shard.bucket_bytes = 16 << 10;
    return o;
  }

  void backward(int step) {
    const int local = 12 / world.world_size();
    const auto b = gpt_batch(step, 12);
    token_loss(forward(b.input.narrow(0, world.rank() * local, local)),
               b.target.narrow(0, world.rank() * local, local))
        .backward();
  }

  flatshard::World world;
};

// A NaN in one element of one parameter's gradient on the last rank only, in step 1.
// Under FullyShard it reaches only the rank whose shard holds that element; the check is
// collective, so every rank skips the step (or throws).
TEST(NonFinite, OneRanksNanIsSeenByEveryRank) {
  FLATSHARD_RUN_RANKS({2, 3}, std::chrono::seconds(180));
  auto world = flatshard::init();
  for (Strategy mode : {Strategy::FullShard, Strategy::NoShard, Strategy::ShardOptimizerState}) {
    for (auto policy : {flatshard::NonFiniteGrads::Skip, flatshard::NonFiniteGrads::Raise}) {
      SCOPED_TRACE(fmt::format("mode {} policy {}", static_cast<int>(mode), static_cast<int>(policy)));
      Trainer run(world, mode, policy);
      int current = 0;
      if (world.rank() == world.world_size() - 1) {
        // The output layer's weight: in the root unit under FullyShard, element 5 lies in rank 0's shard.
        run.model()->head->weight.register_hook([&current](at::Tensor g) {
          if (current != 1) return g;
          g = g.clone();
          g.view({-1})[5] = std::numeric_limits<float>::quiet_NaN();
          return g;
        });
      }
      run.backward(0);
      run.step();
      const auto before = run.params();
      current = 1;
      if (policy == flatshard::NonFiniteGrads::Raise) {
        try {
          run.backward(1);
          ADD_FAILURE() << "backward did not throw";
        } catch (const flatshard::NonFiniteGradError& e) {
          EXPECT_FALSE(e.ranks().empty());
          EXPECT_EQ(e.backward(), 2);
          EXPECT_NE(std::string(e.what()).find("NaN or Inf"), std::string::npos) << e.what();
        }
        continue;  // a raised step leaves the wrapper mid-step: this run ends here
      }
      run.backward(1);
      run.step();
      EXPECT_EQ(run.skipped_steps(), 1);
      for (const auto& [name, value] : run.params()) {
        EXPECT_TRUE(at::equal(value, before.at(name))) << name << " changed in a skipped step";
      }
      current = 2;
      run.backward(2);
      run.step();
      EXPECT_EQ(run.skipped_steps(), 1);
      for (const auto& [name, value] : run.params()) {
        EXPECT_TRUE(at::isfinite(value).all().template item<bool>()) << name;
        EXPECT_FALSE(at::equal(value, before.at(name))) << name << " did not train after the skipped step";
      }
    }
  }
}

// One phase of KilledRankAtEachPhase: the last rank SIGKILLs itself at FLATSHARD_KILL_AT;
// every other rank must fail with a CommError naming it, well within the deadline.
void killed_rank_phase() {
  auto world = flatshard::init();
  const std::string at = env("FLATSHARD_KILL_AT");
  const std::string root = env("FLATSHARD_CKPT_DIR");
  const bool victim = world.rank() == world.world_size() - 1;
  Trainer run(world, at == "optimizer_step" ? Strategy::ShardOptimizerState : Strategy::FullShard,
              flatshard::NonFiniteGrads::Ignore);
  if (at == "load") {
    EXPECT_EQ(run.load(root).step, 1);
    return;
  }
  run.backward(0);
  run.step();
  run.save(root, 1);
  const auto start = std::chrono::steady_clock::now();
  try {
    if (at == "forward_gather" && victim) std::raise(SIGKILL);
    if (at == "backward_reduce_scatter" && victim) {
      run.model()->blocks[0]->fc->weight.register_hook([](at::Tensor g) {
        std::raise(SIGKILL);
        return g;
      });
    }
    run.backward(1);
    if (at == "optimizer_step" && victim) std::raise(SIGKILL);
    run.step();
    if (at == "checkpoint_save" && victim) std::raise(SIGKILL);
    run.save(root, 2);
    ADD_FAILURE() << "rank " << world.rank() << " finished the step";
  } catch (const flatshard::CommError& e) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("CAUGHT rank %d: %s in %s #%llu, peer %d, after %.1f s: %s\n", world.rank(),
                flatshard::to_string(e.kind()), e.op().c_str(), static_cast<unsigned long long>(e.seq()),
                e.peer(), seconds, e.what());
    std::fflush(stdout);
    EXPECT_NE(e.kind(), flatshard::CommError::Kind::Timeout) << e.what();
    EXPECT_LT(seconds, 15.0);
    EXPECT_EQ(e.peer(), world.world_size() - 1) << e.what();
    EXPECT_NE(std::string(e.what()).find(fmt::format("rank {}", world.world_size() - 1)), std::string::npos)
        << e.what();
    // Rank 0 hosts the store in which survivors look up the first lost rank: it stays
    // until every survivor has caught its error, or a survivor slower to notice would
    // find rank 0 gone instead (seen under AddressSanitizer).
    if (world.store) {
      world.store->add("killed_rank_caught", 1);
      if (world.rank() == 0) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (world.store->add("killed_rank_caught", 0) < world.world_size() - 1 &&
               std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }
    }
  }
}

TEST(KilledRank, AtEachPhaseTheOthersFailFastNamingIt) {
  if (in_rank_mode()) {
    killed_rank_phase();
    return;
  }
  for (const std::string phase :
       {"forward_gather", "backward_reduce_scatter", "optimizer_step", "checkpoint_save"}) {
    const std::string root =
        (fs::temp_directory_path() / fmt::format("flatshard-killed-{}-{}", phase, ::getpid())).string();
    fs::remove_all(root);
    LaunchSpec spec;
    spec.ranks = 3;
    spec.deadline = std::chrono::seconds(60);
    spec.env = {{"FLATSHARD_KILL_AT", phase}, {"FLATSHARD_CKPT_DIR", root}};
    const auto r = launch_current_test(spec);
    EXPECT_FALSE(r.timed_out) << phase << "\n" << r.output;
    EXPECT_NE(r.exit_code, 0) << phase;
    EXPECT_NE(r.output.find("rank 2 was killed by signal 9"), std::string::npos) << phase << "\n" << r.output;
    // The survivors' own checks (the error names rank 2, came fast, was no timeout).
    EXPECT_EQ(r.output.find("Failure"), std::string::npos) << phase << "\n" << r.output;
    for (int survivor : {0, 1}) {
      EXPECT_NE(r.output.find(fmt::format("CAUGHT rank {}:", survivor)), std::string::npos)
          << phase << ": rank " << survivor << " did not report the lost rank\n"
          << r.output;
    }
    // The checkpoint saved before the kill loads (at another world size).
    LaunchSpec load = spec;
    load.ranks = 2;
    load.env["FLATSHARD_KILL_AT"] = "load";
    const auto l = launch_current_test(load);
    EXPECT_EQ(l.exit_code, 0) << phase << ": the previous checkpoint did not load\n" << l.output;
    fs::remove_all(root);
  }
}

}  // namespace

namespace {

// A model whose parameter lives on a device the CPU engines do not drive ("meta": every
// build has it).
struct MetaNetImpl : torch::nn::Module {
  MetaNetImpl() {
    register_parameter("w", at::empty({4}, at::device(at::kMeta)));
    register_parameter("b", at::zeros({4}));
  }
  at::Tensor forward(const at::Tensor& x) { return x; }
};
TORCH_MODULE(MetaNet);

// Tensors on a device the CPU engines do not drive are refused with InvalidArgument
// naming the parameter and the device.
TEST(WrongDevice, WrappersAndCollectivesRefuseIt) {
  FLATSHARD_RUN_RANKS({1, 2});
  auto world = flatshard::init();
  auto expect_refused = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "accepted a meta tensor";
    } catch (const flatshard::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_refused([&] { flatshard::FullyShard<MetaNet> fsdp(MetaNet(), world); }, "parameter 'w' is on meta");
  flatshard::FullyShardOptions no_shard;
  no_shard.strategy = flatshard::Strategy::NoShard;
  expect_refused([&] { flatshard::FullyShard<MetaNet> ddp(MetaNet(), world, no_shard); },
                 "parameter 'w' is on meta");
  auto comm = flatshard::Communicator::create(world);
  expect_refused([&] { comm->all_reduce(at::empty({4}, at::device(at::kMeta)), flatshard::ReduceOp::Sum); },
                 "meta");
}

}  // namespace
