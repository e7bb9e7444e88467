// Runs a command with a deadline and captures its output (stdout and stderr merged).
// Used by the multi-rank tests to start ranks through flatshard-run: a hang is a
// failure, never a stuck test.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace flatshard::testing {

struct RunResult {
  int exit_code = -1;      // 128 + signal when killed by a signal
  bool timed_out = false;  // the deadline passed and the process group was killed
  double seconds = 0;
  std::string output;
};

struct RunOptions {
  std::chrono::milliseconds deadline{std::chrono::seconds(120)};
  std::map<std::string, std::string> env;  // set in the child on top of ours
  std::vector<std::string> unset_env;      // removed in the child
  // > 0: send this signal to the child after `signal_after`.
  int signal = 0;
  std::chrono::milliseconds signal_after{0};
};

RunResult run_command(const std::vector<std::string>& argv, const RunOptions& options = {});

}  // namespace flatshard::testing
