// Asynchronous sharded checkpoints (checkpoint::AsyncSaver): the state at the call is what
// is saved, whatever training does while the files are written; the previous checkpoint
// stays the latest until the new one is complete; a failure in the background surfaces on
// every rank at the next call.
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tests/support/cases.h"
#include "tests/support/multirank.h"
#include "tests/support/wrapped.h"

namespace {

using namespace flatshard::testing;
namespace ckpt = flatshard::checkpoint;
namespace fs = std::filesystem;
using flatshard::Strategy;

struct Trainer : Wrapped<GPT> {
  Trainer(const flatshard::World& w, Strategy s, int seed)
      : Wrapped(
            [seed] {
              torch::manual_seed(seed);
              GPTConfig c = gpt_config();
              c.position_scale_buffer = true;
              return GPT(c);
            }(),
            w, s,
            [&] {
              WrappedOptions o;
              o.fully_shard = options_for(s, w.world_size());
              return o;
            }()),
        world(w) {}
  void train(int first, int steps) {
    const int rows = 12 / world.world_size();
    for (int s = first; s < first + steps; ++s) {
      const auto b = gpt_batch(s, 12);
      token_loss(forward(b.input.narrow(0, world.rank() * rows, rows)),
                 b.target.narrow(0, world.rank() * rows, rows))
          .backward();
      step();
    }
  }
  std::map<std::string, at::Tensor> state() {
    auto out = ckpt::full_master_state_dict(fully_shard(), -1);
    for (auto& [k, v] : ckpt::full_optimizer_state_dict(fully_shard(), *shard_optimizer(), -1))
      out["opt." + k] = v;
    return out;
  }
  flatshard::World world;
};

std::string root_for(const flatshard::World& world, const std::string& what) {
  return (fs::temp_directory_path() / fmt::format("flatshard_async_{}_{}", what, world.world_size()))
      .string();
}

// The writing thread waits at SaveStage::Copied until released: the test decides what
// training does before a single byte is written.
struct Gate {
  std::mutex m;
  std::condition_variable cv;
  bool open = false, reached = false;
  void hold() {
    std::unique_lock<std::mutex> lock(m);
    reached = true;
    cv.notify_all();
    cv.wait(lock, [&] { return open; });
  }
  void wait_reached() {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return reached; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(m);
    open = true;
    cv.notify_all();
  }
};

}  // namespace

// What is saved is the state at the call: training runs three more steps (every weight and
// every optimizer state moves) before the writing thread writes anything, and the loaded
// checkpoint equals the state at the call bit for bit, in every strategy.
TEST(AsyncCheckpoint, SavesTheStateAtTheCallWhateverTrainingDoesNext) {
  FLATSHARD_RUN_RANKS({2, 3}, std::chrono::seconds(180));
  auto world = flatshard::init();
  const std::string root = root_for(world, "state");
  for (Strategy strategy : every_strategy(world.world_size())) {
    const std::string what = flatshard::to_string(strategy);
    if (world.rank() == 0) fs::remove_all(root);
    Trainer t(world, strategy, 11);
    ckpt::AsyncSaver saver(t.fully_shard());
    t.train(0, 2);
    const auto at_call = t.state();
    Gate gate;
    ckpt::SaveOptions o;
    o.step = 2;
    o.on_stage = [&](ckpt::SaveStage s) {
      if (s == ckpt::SaveStage::Copied) gate.hold();
    };
    saver.save(root, t.shard_optimizer(), o);
    EXPECT_TRUE(saver.in_flight());
    EXPECT_GT(saver.last_copy_bytes(), 0);
    gate.wait_reached();
    t.train(2, 3);
    const auto later = t.state();
    gate.release();
    const auto info = saver.wait();
    EXPECT_EQ(info.step, 2);
    EXPECT_FALSE(saver.in_flight());

    Trainer loaded(world, strategy, 4242);
    ckpt::load_sharded(root, loaded.fully_shard(), loaded.shard_optimizer());
    const auto got = loaded.state();
    int moved = 0;
    for (const auto& [name, v] : at_call) {
      ASSERT_TRUE(got.count(name)) << what << ": " << name;
      EXPECT_TRUE(at::equal(got.at(name), v)) << what << ": " << name << " is not the state at the call";
      if (!at::equal(later.at(name), v)) ++moved;
    }
    EXPECT_GT(moved, static_cast<int>(at_call.size()) / 2)
        << what << ": training moved the state after the call";
  }
  if (world.rank() == 0) fs::remove_all(root);
}

// While a save is written, the previous checkpoint is the latest; it becomes the new one
// only once every rank's files are complete.
TEST(AsyncCheckpoint, ThePreviousStaysLatestUntilTheNewIsComplete) {
  FLATSHARD_RUN_RANKS({2});
  auto world = flatshard::init();
  const std::string root = root_for(world, "latest");
  if (world.rank() == 0) fs::remove_all(root);
  Trainer t(world, Strategy::FullShard, 11);
  ckpt::AsyncSaver saver(t.fully_shard());
  ckpt::SaveOptions first;
  first.step = 1;
  saver.save(root, t.shard_optimizer(), first);
  saver.wait();
  auto latest = [&] {
    std::ifstream in(root + "/latest");
    std::string name;
    in >> name;
    return name;
  };
  Gate gate;
  ckpt::SaveOptions second;
  second.step = 2;
  second.on_stage = [&](ckpt::SaveStage s) {
    if (s == ckpt::SaveStage::Copied) gate.hold();
  };
  t.train(0, 1);
  saver.save(root, t.shard_optimizer(), second);
  gate.wait_reached();
  EXPECT_EQ(latest(), "step-000000001");
  // Note [One save at a time under a root]: a save or a load under the root while this one
  // is in flight fails on every rank (a save would prune the other's files; a load could
  // read another step on some ranks), and leaves it to finish.
  ckpt::SaveOptions third;
  third.step = 3;
  try {
    ckpt::save_sharded(root, t.fully_shard(), t.shard_optimizer(), third);
    ADD_FAILURE() << "a second save ran beside the first";
  } catch (const ckpt::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("still in flight"), std::string::npos) << e.what();
  }
  try {
    ckpt::load_sharded(root, t.fully_shard(), t.shard_optimizer());
    ADD_FAILURE() << "a load ran beside a save";
  } catch (const ckpt::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("still in flight"), std::string::npos) << e.what();
  }
  gate.release();
  EXPECT_EQ(saver.wait().step, 2);
  EXPECT_EQ(latest(), "step-000000002");
  t.fully_shard().comm().barrier().wait();
  if (world.rank() == 0) fs::remove_all(root);
}

// A save that fails in the background (its root cannot be made: a file stands there) throws
// at the next call, on every rank, naming the path; the saver goes on working, also after
// a rank's host copy or writer thread failed.
TEST(AsyncCheckpoint, AFailureSurfacesOnEveryRankAtTheNextCall) {
  FLATSHARD_RUN_RANKS({2});
  auto world = flatshard::init();
  const std::string blocker = root_for(world, "blocker");
  if (world.rank() == 0) {
    fs::remove_all(blocker);
    std::ofstream(blocker) << "a file, not a directory";
  }
  Trainer t(world, Strategy::FullShard, 11);
  t.fully_shard().comm().barrier().wait();
  ckpt::AsyncSaver saver(t.fully_shard());
  ckpt::SaveOptions o;
  o.step = 1;
  saver.save(blocker + "/ckpt", t.shard_optimizer(), o);
  t.train(0, 1);  // training goes on meanwhile
  try {
    saver.wait();
    ADD_FAILURE() << "the failed save was not reported";
  } catch (const ckpt::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(blocker), std::string::npos) << e.what();
  }
  // A save() that meets the failure of the one before it says that its own did not start.
  saver.save(blocker + "/ckpt", t.shard_optimizer(), o);
  ckpt::SaveOptions next = o;
  next.step = 2;
  try {
    saver.save(blocker + "/next", t.shard_optimizer(), next);
    ADD_FAILURE() << "the failed save was not reported";
  } catch (const ckpt::CheckpointError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(blocker + "/ckpt"), std::string::npos) << what;
    EXPECT_NE(what.find("the save of step 2 under '" + blocker + "/next' was not started"), std::string::npos)
        << what;
  }
  EXPECT_FALSE(saver.in_flight());
  const std::string root = root_for(world, "after");
  if (world.rank() == 0) fs::remove_all(root);
  // Rank 1's host copy fails (Note [Injected checkpoint faults]): every rank hears it at
  // the next call, naming rank 1, and nothing is left under the root. Then its writer
  // thread cannot start: rank 1 throws at the call, the others at their next.
  for (const auto& [fault, said] : {std::pair{"hold", "copying this rank's shard to the host"},
                                    std::pair{"thread", "starting the writer thread"}}) {
    SCOPED_TRACE(fault);
    if (world.rank() == 1) ::setenv("FLATSHARD_CHECKPOINT_FAULT", fault, 1);
    const auto start = std::chrono::steady_clock::now();
    try {
      saver.save(root, t.shard_optimizer(), o);
      saver.wait();
      ADD_FAILURE() << "the failed save was not reported";
    } catch (const ckpt::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("starting the save failed on rank 1 of 2"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(said), std::string::npos) << e.what();
    }
    ::unsetenv("FLATSHARD_CHECKPOINT_FAULT");
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20))
        << "a rank waited out a deadline";
    t.fully_shard().comm().barrier().wait();
    EXPECT_FALSE(fs::exists(root + "/.step-000000001.tmp")) << "the failed save left its directory";
    EXPECT_FALSE(fs::exists(root + "/latest"));
  }
  saver.save(root, t.shard_optimizer(), o);
  EXPECT_EQ(saver.wait().step, 1);
  t.fully_shard().comm().barrier().wait();
  if (world.rank() == 0) {
    fs::remove_all(root);
    fs::remove_all(blocker);
  }
}
