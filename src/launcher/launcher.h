// flatshard-run: starts the local ranks of a job with the torchrun-style environment.
#pragma once

#include <string>
#include <vector>

namespace flatshard::launcher {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;    // 0: pick a free port (one node only)
  double grace_s = 5.0;   // after a rank fails: how long the others get to exit by themselves
  double deadline_s = 0;  // > 0: stop every rank after this long and fail
  // Note [NCCL between ranks on one GPU]: each rank gets its own NCCL_HOSTID.
  bool nccl_host_per_rank = false;
  // Note [Restarting a failed job]: after a failure, start every rank again, up to this
  // many times.
  int max_restarts = 0;
  // Note [Rounds of an elastic job]: --nnodes MIN:MAX. The nodes meet before every start,
  // and a start goes on with the nodes present (at least min_nodes).
  bool elastic = false;
  int min_nodes = 1, max_nodes = 1;
  double rdzv_wait_s = 10;      // how long a round waits for nodes beyond MIN
  double rdzv_timeout_s = 600;  // how long a round waits for MIN nodes
  // The ranks' MASTER_PORT in every start of a job with rounds (0: one node 0 picks per
  // start): a fixed job with --max-restarts keeps --master-port (Note [Restarting a job of
  // several nodes]).
  int ranks_port = 0;
  std::vector<std::string> command;  // PROGRAM ARGS...
};

// Parses argv; throws std::invalid_argument with a usage message.
LaunchOptions parse_args(int argc, char** argv);
std::string usage();

// Runs the ranks (again after a failure, up to max_restarts times) and returns the exit
// code of the job: 0 if every rank of the last start succeeded, otherwise that start's
// first failing rank's code (128 + signal for a signal; 124 past the deadline).
int run(const LaunchOptions& options);

}  // namespace flatshard::launcher
