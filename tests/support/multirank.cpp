#include "tests/support/multirank.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include <fmt/format.h>

namespace flatshard::testing {

bool in_rank_mode() {
  const char* v = std::getenv("FLATSHARD_TEST_RANK_MODE");
  return v != nullptr && std::string(v) == "1";
}

std::string launcher_path() { return FLATSHARD_RUN_PATH; }

static std::string self_path() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
}

bool nccl_host_per_rank() {
  for (const char* name : {"FLATSHARD_TEST_NCCL_HOST_PER_RANK", "FLATSHARD_NCCL_HOST_PER_RANK"}) {
    const char* v = std::getenv(name);
    if (v && std::string(v) == "1") return true;
  }
  return false;
}

RunResult launch_current_test(const LaunchSpec& spec) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::vector<std::string> argv{launcher_path(), "-n", std::to_string(spec.ranks), "--deadline-s",
                                fmt::format("{:.1f}", spec.deadline.count() / 1000.0)};
  argv.insert(argv.end(), spec.launcher_args.begin(), spec.launcher_args.end());
  if (nccl_host_per_rank()) argv.push_back("--nccl-host-per-rank");
  argv.push_back(self_path());
  argv.push_back(fmt::format("--gtest_filter={}.{}", info->test_suite_name(), info->name()));
  argv.push_back("--gtest_brief=1");
  RunOptions options;
  options.deadline = spec.deadline + std::chrono::seconds(15);  // the launcher's own, plus its grace
  if (spec.kill_after.count() > 0) options.deadline = spec.kill_after;
  options.env = spec.env;
  options.env["FLATSHARD_TEST_RANK_MODE"] = "1";
  return run_command(argv, options);
}

void run_ranks_and_expect_success(const std::vector<int>& world_sizes, std::chrono::milliseconds deadline) {
  for (int n : world_sizes) {
    LaunchSpec spec;
    spec.ranks = n;
    spec.deadline = deadline;
    const RunResult r = launch_current_test(spec);
    EXPECT_FALSE(r.timed_out) << "world size " << n << " hung past its deadline\n" << r.output;
    EXPECT_EQ(r.exit_code, 0) << "world size " << n << " failed\n" << r.output;
    // The ranks' output is shown on failure, and always with FLATSHARD_TEST_OUTPUT=1
    // (the figures a test prints, e.g. the planner's measured and predicted peaks).
    const char* show = std::getenv("FLATSHARD_TEST_OUTPUT");
    if (r.exit_code == 0 && !r.timed_out && show && std::string(show) == "1")
      std::printf("world size %d:\n%s", n, r.output.c_str());
  }
}

}  // namespace flatshard::testing
