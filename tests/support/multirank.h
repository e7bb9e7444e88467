// Multi-rank tests: a test body runs twice. In the test process (the parent) it
// starts N real ranks of this same binary through flatshard-run, each running only
// this test; in each rank (FLATSHARD_TEST_RANK_MODE=1) it runs the real checks.
//
//   TEST(Collectives, AllReduce) {
//     FLATSHARD_RUN_RANKS({1, 2, 3, 4});   // parent: launch, check, return
//     ... rank code with gtest assertions ...
//   }
//
// A rank's failed assertion makes it exit non-zero, which fails the parent's test
// and shows that rank's output. Every launch has a deadline.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/support/subprocess.h"

namespace flatshard::testing {

bool in_rank_mode();

struct LaunchSpec {
  int ranks = 2;
  std::chrono::milliseconds deadline{std::chrono::seconds(60)};
  std::vector<std::string> launcher_args;  // e.g. {"--grace-s", "10"}
  std::map<std::string, std::string> env;
  // > 0: SIGKILL the launcher and every rank after this long (a crash), instead of the
  // launcher's own deadline.
  std::chrono::milliseconds kill_after{0};
};

// Starts spec.ranks ranks running the current test; returns the launcher's result.
RunResult launch_current_test(const LaunchSpec& spec);

// Launches for each world size and expects every rank to pass.
void run_ranks_and_expect_success(const std::vector<int>& world_sizes,
                                  std::chrono::milliseconds deadline = std::chrono::seconds(60));

std::string launcher_path();

// Ranks are launched with --nccl-host-per-rank (Note [NCCL between ranks on one GPU]):
// FLATSHARD_TEST_NCCL_HOST_PER_RANK=1 in the test process (scripts/gpu.sh sets it), or
// FLATSHARD_NCCL_HOST_PER_RANK=1 in a rank the launcher started so.
bool nccl_host_per_rank();

}  // namespace flatshard::testing

#define FLATSHARD_RUN_RANKS(...)                                       \
  do {                                                                 \
    if (!::flatshard::testing::in_rank_mode()) {                       \
      ::flatshard::testing::run_ranks_and_expect_success(__VA_ARGS__); \
      return;                                                          \
    }                                                                  \
  } while (0)
