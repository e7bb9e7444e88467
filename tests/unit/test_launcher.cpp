// flatshard-run on plain shell programs: environment, output prefixes, exit codes,
// stopping the others when one rank fails, and signal forwarding.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "tests/support/multirank.h"
#include "tests/support/subprocess.h"

namespace {

using flatshard::testing::launcher_path;
using flatshard::testing::run_command;
using flatshard::testing::RunOptions;

std::vector<std::string> launch(std::vector<std::string> launcher_args, const std::string& script) {
  std::vector<std::string> argv{launcher_path()};
  argv.insert(argv.end(), launcher_args.begin(), launcher_args.end());
  argv.insert(argv.end(), {"sh", "-c", script});
  return argv;
}

TEST(Launcher, SetsTheTorchrunEnvironmentAndPrefixesOutput) {
  const auto r = run_command(launch({"-n", "3", "--master-port", "23456"},
                                    "echo \"env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR "
                                    "$MASTER_PORT $OMP_NUM_THREADS\"; echo err-$RANK >&2"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int i = 0; i < 3; ++i) {
    EXPECT_NE(r.output.find("[rank " + std::to_string(i) + "] env " + std::to_string(i) + " 3 " +
                            std::to_string(i) + " 3 127.0.0.1 23456 1"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("[rank " + std::to_string(i) + "] err-" + std::to_string(i)), std::string::npos)
        << r.output;
  }
}

TEST(Launcher, MultiNodeRanksAndAFreePortWhenNoneIsGiven) {
  auto r = run_command(launch(
      {"-n", "2", "--nnodes", "3", "--node-rank", "2", "--master-port", "999", "--master-addr", "head"},
      "echo \"env $RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR\""));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 4] env 4 6 0 head"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 5] env 5 6 1 head"), std::string::npos) << r.output;
  r = run_command(launch({"-n", "1"}, "test \"$MASTER_PORT\" -gt 0"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// Note [NCCL between ranks on one GPU]: every rank gets a host id of its own, and says
// so; without the option NCCL's host id is left alone.
TEST(Launcher, NcclHostPerRankGivesEachRankItsOwnHostId) {
  unsetenv("NCCL_HOSTID");  // whatever this process was started with
  unsetenv("NCCL_SOCKET_IFNAME");
  unsetenv("NCCL_NET");
  auto r = run_command(
      launch({"-n", "3", "--nccl-host-per-rank"},
             "echo \"host $NCCL_HOSTID $FLATSHARD_NCCL_HOST_PER_RANK $NCCL_SOCKET_IFNAME $NCCL_NET\""));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::set<std::string> ids;
  for (int i = 0; i < 3; ++i) {
    const std::string prefix = "[rank " + std::to_string(i) + "] host ";
    const auto at = r.output.find(prefix);
    ASSERT_NE(at, std::string::npos) << r.output;
    const auto end = r.output.find('\n', at);
    const std::string line = r.output.substr(at + prefix.size(), end - at - prefix.size());
    EXPECT_NE(line.find("rank" + std::to_string(i) + " 1 lo Socket"), std::string::npos) << line;
    ids.insert(line.substr(0, line.find(' ')));
  }
  EXPECT_EQ(ids.size(), 3u) << r.output;
  r = run_command(launch({"-n", "2"}, "echo \"host [${NCCL_HOSTID:-unset}]\""));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 1] host [unset]"), std::string::npos) << r.output;
}

// Note [Proving the job's secret]: a job on one machine gets a fresh secret, the same on
// every rank (64 hex digits, another for the next job); one the user gave is kept; the
// nodes of a job across machines get none from their launchers (each would make its own).
TEST(Launcher, AJobOnOneMachineGetsASecretOfItsOwn) {
  unsetenv("FLATSHARD_JOB_SECRET");
  const auto secrets = [](const flatshard::testing::RunResult& r, int ranks) {
    std::set<std::string> seen;
    for (int i = 0; i < ranks; ++i) {
      const std::string prefix = "[rank " + std::to_string(i) + "] secret ";
      const auto at = r.output.find(prefix);
      if (at == std::string::npos) return std::set<std::string>{"missing"};
      const auto end = r.output.find('\n', at);
      seen.insert(r.output.substr(at + prefix.size(), end - at - prefix.size()));
    }
    return seen;
  };
  const std::string echo = "echo \"secret ${FLATSHARD_JOB_SECRET:-none}\"";
  auto first = run_command(launch({"-n", "3"}, echo));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto one = secrets(first, 3);
  ASSERT_EQ(one.size(), 1u) << first.output;
  EXPECT_EQ(one.begin()->size(), 64u) << first.output;
  EXPECT_EQ(one.begin()->find_first_not_of("0123456789abcdef"), std::string::npos) << first.output;
  auto second = run_command(launch({"-n", "1"}, echo));
  EXPECT_NE(secrets(second, 1), one) << "two jobs got the same secret";
  RunOptions given;
  given.env["FLATSHARD_JOB_SECRET"] = "users-own";
  auto kept = run_command(launch({"-n", "2"}, echo), given);
  EXPECT_EQ(secrets(kept, 2), std::set<std::string>{"users-own"}) << kept.output;
  auto nodes =
      run_command(launch({"-n", "1", "--nnodes", "2", "--node-rank", "1", "--master-port", "999"}, echo));
  ASSERT_EQ(nodes.exit_code, 0) << nodes.output;
  EXPECT_NE(nodes.output.find("[rank 1] secret none"), std::string::npos) << nodes.output;
}

// A restarted job's ranks are told what failed and when (FLATSHARD_FAILURE_CAUSE,
// FLATSHARD_FAILED_AT_UNIX_MS), so that a program can say what the failure cost; the
// first start is told nothing.
TEST(Launcher, ARestartedJobIsToldWhatFailedAndWhen) {
  unsetenv("FLATSHARD_FAILED_AT_UNIX_MS");
  unsetenv("FLATSHARD_FAILURE_CAUSE");
  const auto now_ms = [] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  const long long before = now_ms();
  const auto r = run_command(
      launch({"-n", "2", "--grace-s", "0.5", "--max-restarts", "1"},
             "echo \"told ${FLATSHARD_FAILED_AT_UNIX_MS:-none} [${FLATSHARD_FAILURE_CAUSE:-none}]\"; "
             "if [ \"$RANK\" = 1 ] && [ \"$FLATSHARD_RESTART_COUNT\" = 0 ]; then sleep 0.3; exit 4; fi; "
             "if [ \"$FLATSHARD_RESTART_COUNT\" = 0 ]; then sleep 60; fi"));
  const long long after = now_ms();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0] told none [none]"), std::string::npos) << r.output;
  const std::string prefix = "[rank 1] told ";
  const auto first = r.output.find(prefix);
  ASSERT_NE(first, std::string::npos) << r.output;
  const auto second = r.output.find(prefix, first + 1);
  ASSERT_NE(second, std::string::npos) << "no second start: " << r.output;
  const std::string line =
      r.output.substr(second + prefix.size(), r.output.find('\n', second) - second - prefix.size());
  const long long at = std::atoll(line.c_str());
  EXPECT_GE(at, before + 250) << line;  // rank 1 failed 0.3 s after its start
  EXPECT_LE(at, after) << line;
  EXPECT_NE(line.find("[rank 1 exited with code 4]"), std::string::npos) << line;
}

// Whether nobody listens on loopback `port` now.
bool port_free(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return free;
}

// A port nobody listens on now, below the kernel's range of ephemeral ports (32768 and up
// by default), so that no process binding port 0 (another test's ranks, its launcher's
// picks) takes it between this call and the test's bind.
int free_port() {
  static std::mt19937 pick(
      static_cast<unsigned>(::getpid()) * 7919u +
      static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count()));
  for (;;) {
    const int port = 20000 + static_cast<int>(pick() % 12000);
    if (port_free(port)) return port;
  }
}

// A free port whose next is free too (a fixed job with restarts meets one port above
// --master-port: Note [Restarting a job of several nodes]).
int free_port_pair() {
  for (;;) {
    const int port = free_port();
    if (port_free(port + 1)) return port;
  }
}

// Runs one flatshard-run per node of an elastic job on this machine, side by side:
// node_args[k] are node k's options before the program.
std::vector<flatshard::testing::RunResult> run_nodes(const std::vector<std::vector<std::string>>& node_args,
                                                     const std::vector<RunOptions>& options,
                                                     const std::string& script) {
  std::vector<flatshard::testing::RunResult> results(node_args.size());
  std::vector<std::thread> nodes;
  for (std::size_t k = 0; k < node_args.size(); ++k) {
    nodes.emplace_back([&, k] { results[k] = run_command(launch(node_args[k], script), options[k]); });
  }
  for (auto& t : nodes) t.join();
  return results;
}

// Note [Rounds of an elastic job]: three nodes (ids 0, 1, 2) start at world 3; node 1 is
// lost for good (its launcher killed, and with it its rank); the others' ranks fail as on a
// lost peer, their launchers meet again, wait --rdzv-wait-s for node 1, and start at world 2,
// node 2 now node rank 1.
TEST(Launcher, AnElasticJobGoesOnAtTheWorldThatRemains) {
  const std::string port = std::to_string(free_port());
  const std::string script =
      "echo \"env $RANK $WORLD_SIZE $GROUP_RANK $TORCHELASTIC_RESTART_COUNT\"; "
      "if [ \"$WORLD_SIZE\" = 3 ]; then "
      "  if [ \"$GROUP_RANK\" = 1 ]; then exec sleep 60; fi; sleep 3; exit 4; "
      "fi; echo done-$WORLD_SIZE";
  std::vector<std::vector<std::string>> args;
  for (int id = 0; id < 3; ++id) {
    args.push_back({"-n", "1", "--nnodes", "2:3", "--node-rank", std::to_string(id), "--master-port", port,
                    "--rdzv-wait-s", "1", "--max-restarts", "1", "--grace-s", "0.5", "--deadline-s", "60"});
  }
  std::vector<RunOptions> options(3);
  for (auto& o : options) o.env["FLATSHARD_JOB_SECRET"] = "elastic-test";
  options[1].signal = SIGKILL;  // node 1 is lost once its rank runs
  options[1].signal_after = std::chrono::milliseconds(1500);
  const auto r = run_nodes(args, options, script);
  EXPECT_NE(r[1].output.find("[rank 1] env 1 3 1 0"), std::string::npos) << r[1].output;
  EXPECT_EQ(r[1].exit_code, 128 + SIGKILL) << r[1].output;
  for (int id : {0, 2}) {
    const int first_rank = id, second_rank = id / 2;
    EXPECT_EQ(r[id].exit_code, 0) << r[id].output;
    EXPECT_NE(r[id].output.find(fmt::format("[rank {0}] env {0} 3 {0} 0", first_rank)), std::string::npos)
        << r[id].output;
    EXPECT_NE(r[id].output.find(fmt::format("[rank {0}] env {0} 2 {0} 1", second_rank)), std::string::npos)
        << r[id].output;
    EXPECT_NE(r[id].output.find(fmt::format("[rank {}] done-2", second_rank)), std::string::npos)
        << r[id].output;
    EXPECT_NE(r[id].output.find("round 2: nodes 0,2 (of 2..3); this is node " + std::to_string(second_rank) +
                                " of world 2; the job goes on at world 2 (was 3): node 1 did not return"),
              std::string::npos)
        << r[id].output;
  }
}

// Note [Growing an elastic job]: nodes 0, 1 and 2 start at world 3 of --nnodes 3:4; node 3
// arrives while their ranks run. The host takes it in and tells nodes 1 and 2 to regroup.
// The ranks of nodes 0 and 2 fail as on a lost peer as soon as node 1's rank is gone, so
// node 0's fail before its own stop and node 2's may fail before the word reaches it:
// neither is a failure. All four meet in round 2 at world 4, with no --max-restarts to spend.
TEST(Launcher, AnElasticJobGrowsWhenANodeArrives) {
  const std::string port = std::to_string(free_port());
  char dir_template[] = "/tmp/flatshard-grow-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string pid_file = std::string(dir_template) + "/rank1";
  const std::string script =
      "echo \"env $RANK $WORLD_SIZE $TORCHELASTIC_RESTART_COUNT\"; "
      "if [ \"$WORLD_SIZE\" = 3 ]; then "
      "  if [ \"$RANK\" = 1 ]; then echo $$ > " +
      pid_file +
      "; exec sleep 60; fi; "
      "  while [ ! -s " +
      pid_file +
      " ]; do sleep 0.05; done; "
      "  while kill -0 $(cat " +
      pid_file +
      ") 2>/dev/null; do sleep 0.02; done; exit 5; "
      "fi; echo done-$WORLD_SIZE";
  std::vector<flatshard::testing::RunResult> r(4);
  std::vector<std::thread> nodes;
  for (int id = 0; id < 4; ++id) {
    nodes.emplace_back([&, id] {
      if (id == 3) std::this_thread::sleep_for(std::chrono::seconds(3));  // while the world-3 start runs
      RunOptions options;
      options.env["FLATSHARD_JOB_SECRET"] = "elastic-test";
      options.deadline = std::chrono::seconds(60);
      r[id] = run_command(
          launch({"-n", "1", "--nnodes", "3:4", "--node-rank", std::to_string(id), "--master-port", port,
                  "--rdzv-wait-s", "1", "--grace-s", "0.5", "--deadline-s", "50"},
                 script),
          options);
    });
  }
  for (auto& t : nodes) t.join();
  std::system(("rm -rf " + std::string(dir_template)).c_str());
  for (int id = 0; id < 4; ++id) {
    EXPECT_EQ(r[id].exit_code, 0) << r[id].output;
    EXPECT_LT(r[id].seconds, 30.0) << "a rank of the world-3 start was not stopped: " << r[id].output;
    // A regroup is no restart: the count stays 0, as torchrun's.
    EXPECT_NE(r[id].output.find(fmt::format("[rank {0}] env {0} 4 0", id)), std::string::npos)
        << r[id].output;
    EXPECT_NE(r[id].output.find(fmt::format("[rank {}] done-4", id)), std::string::npos) << r[id].output;
    EXPECT_NE(r[id].output.find("round 2: nodes 0,1,2,3 (of 3..4); this is node " + std::to_string(id) +
                                " of world 4\n"),
              std::string::npos)
        << r[id].output;
    EXPECT_EQ(r[id].output.find("no restart left"), std::string::npos) << r[id].output;
  }
  for (int id = 0; id < 3; ++id)
    EXPECT_NE(r[id].output.find(fmt::format("[rank {0}] env {0} 3 0", id)), std::string::npos)
        << r[id].output;
  EXPECT_NE(r[0].output.find("node 0: a node joins the job"), std::string::npos) << r[0].output;
  EXPECT_NE(r[1].output.find("node 1: a node joins the job"), std::string::npos) << r[1].output;
  EXPECT_EQ(r[3].output.find("env 3 3"), std::string::npos)
      << "node 3 ran in the world-3 start: " << r[3].output;
}

// Both nodes' ranks fail (as on a lost peer) and both launchers come back: the next start
// has the same nodes and world, without waiting for --rdzv-wait-s (every node is in).
TEST(Launcher, AnElasticJobsNodesMeetAgainAfterAFailure) {
  const std::string port = std::to_string(free_port());
  std::vector<std::vector<std::string>> args;
  for (int id = 0; id < 2; ++id) {
    args.push_back({"-n", "2", "--nnodes", "1:2", "--node-rank", std::to_string(id), "--master-port", port,
                    "--rdzv-wait-s", "30", "--max-restarts", "2", "--grace-s", "0.5", "--deadline-s", "60"});
  }
  std::vector<RunOptions> options(2);
  for (auto& o : options) o.env["FLATSHARD_JOB_SECRET"] = "elastic-test";
  const auto r = run_nodes(args, options,
                           "echo \"env $RANK $WORLD_SIZE $TORCHELASTIC_RESTART_COUNT\"; "
                           "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 0.$RANK; exit 3; fi");
  for (int id = 0; id < 2; ++id) {
    EXPECT_EQ(r[id].exit_code, 0) << r[id].output;
    EXPECT_LT(r[id].seconds, 20.0) << "a round waited for --rdzv-wait-s with every node in: " << r[id].output;
    for (int local = 0; local < 2; ++local) {
      const int rank = 2 * id + local;
      EXPECT_NE(r[id].output.find(fmt::format("[rank {0}] env {0} 4 1", rank)), std::string::npos)
          << r[id].output;
    }
    EXPECT_NE(r[id].output.find("round 2: nodes 0,1 (of 1..2); this is node " + std::to_string(id) +
                                " of world 4\n"),
              std::string::npos)
        << r[id].output;
  }
}

// A second node with a taken id is refused by name; a round that never reaches MIN nodes
// fails once --rdzv-timeout-s passes, on the host and on the node waiting in it.
TEST(Launcher, AnElasticRoundRefusesATakenIdAndEndsWithoutMinNodes) {
  const std::string port = std::to_string(free_port());
  std::vector<std::vector<std::string>> args;
  for (int id : {0, 1, 1}) {
    args.push_back({"-n", "1", "--nnodes", "3:3", "--node-rank", std::to_string(id), "--master-port", port,
                    "--rdzv-timeout-s", "3", "--deadline-s", "60"});
  }
  std::vector<RunOptions> options(3);
  for (auto& o : options) o.env["FLATSHARD_JOB_SECRET"] = "elastic-test";
  const auto r = run_nodes(args, options, "echo started");
  EXPECT_EQ(r[0].exit_code, 1) << r[0].output;
  EXPECT_NE(r[0].output.find("round 1 of the launchers' rendezvous: 2 of at least 3 nodes arrived"),
            std::string::npos)
      << r[0].output;
  int refused = 0, told = 0;
  for (int k : {1, 2}) {
    EXPECT_EQ(r[k].exit_code, 1) << r[k].output;
    EXPECT_LT(r[k].seconds, 10.0) << "a node waited past the host's end: " << r[k].output;
    if (r[k].output.find("the job ended (code 1) while this node waited") != std::string::npos) ++told;
    EXPECT_EQ(r[k].output.find("started"), std::string::npos) << r[k].output;
    if (r[k].output.find("refused node 1: another node with this --node-rank is in the round") !=
        std::string::npos)
      ++refused;
  }
  EXPECT_EQ(refused, 1) << r[1].output << r[2].output;
  EXPECT_EQ(told, 1) << "the node in the round is told the round failed: " << r[1].output << r[2].output;
}

// Node 0's rank fails at once, twice, and its job ends (code 7) while node 1's rank is
// still running (10 s): node 1 was left out of round 2, yet when its rank fails and it
// looks for another round it is told the job ended, at once, instead of retrying for
// --rdzv-timeout-s (60).
TEST(Launcher, AnElasticNodeIsToldTheJobEndedAfterItsRanksFail) {
  const std::string port = std::to_string(free_port());
  std::vector<std::vector<std::string>> args;
  for (int id = 0; id < 2; ++id) {
    args.push_back({"-n", "1", "--nnodes", "1:2", "--node-rank", std::to_string(id), "--master-port", port,
                    "--rdzv-wait-s", "3", "--rdzv-timeout-s", "60", "--max-restarts", "1", "--grace-s", "0.5",
                    "--deadline-s", "60"});
  }
  std::vector<RunOptions> options(2);
  for (auto& o : options) o.env["FLATSHARD_JOB_SECRET"] = "elastic-test";
  const auto r = run_nodes(args, options, "if [ \"$GROUP_RANK\" = 0 ]; then exit 7; fi; sleep 4; exit 5");
  EXPECT_EQ(r[0].exit_code, 7) << r[0].output;
  EXPECT_NE(r[0].output.find("round 2: nodes 0 (of 1..2)"), std::string::npos) << r[0].output;
  EXPECT_EQ(r[1].exit_code, 7) << r[1].output;
  EXPECT_NE(r[1].output.find("the job ended (code 7) while this node waited to rejoin it"), std::string::npos)
      << r[1].output;
  EXPECT_LT(r[1].seconds, 25.0) << r[1].output;
}

// A node whose job secret differs is refused at once, by name, not after its timeout.
TEST(Launcher, AnElasticNodeWithAnotherSecretIsRefusedAtOnce) {
  const std::string port = std::to_string(free_port());
  std::vector<std::vector<std::string>> args;
  for (int id = 0; id < 2; ++id) {
    args.push_back({"-n", "1", "--nnodes", "2:2", "--node-rank", std::to_string(id), "--master-port", port,
                    "--rdzv-timeout-s", std::to_string(id == 0 ? 5 : 60), "--deadline-s", "60"});
  }
  std::vector<RunOptions> options(2);
  options[0].env["FLATSHARD_JOB_SECRET"] = "elastic-test";
  options[1].env["FLATSHARD_JOB_SECRET"] = "another-job";
  const auto r = run_nodes(args, options, "echo started");
  EXPECT_EQ(r[1].exit_code, 1) << r[1].output;
  EXPECT_LT(r[1].seconds, 4.0) << r[1].output;
  EXPECT_NE(r[1].output.find("give every node the same FLATSHARD_JOB_SECRET"), std::string::npos)
      << r[1].output;
  EXPECT_NE(r[0].output.find("refused a connection to the launchers' rendezvous"), std::string::npos)
      << r[0].output;
  EXPECT_EQ(r[0].exit_code, 1) << r[0].output;
  EXPECT_EQ(r[0].output.find("started"), std::string::npos) << r[0].output;
}

// A signal to a launcher waiting in a round (the host for its nodes, a node for its host)
// ends it at once, with 128 + the signal, not at --rdzv-timeout-s.
TEST(Launcher, ASignalEndsAnElasticRoundAtOnce) {
  const std::string port = std::to_string(free_port());
  RunOptions options;
  options.env["FLATSHARD_JOB_SECRET"] = "elastic-test";
  options.signal = SIGTERM;
  options.signal_after = std::chrono::milliseconds(1000);
  for (const char* id : {"0", "1"}) {  // alone: node 0 waits for node 1, node 1 for a host that is not there
    const auto r = run_command(launch({"-n", "1", "--nnodes", "2:2", "--node-rank", id, "--master-port", port,
                                       "--rdzv-timeout-s", "60"},
                                      "echo started"),
                               options);
    EXPECT_EQ(r.exit_code, 128 + SIGTERM) << "node " << id << ": " << r.output;
    EXPECT_LT(r.seconds, 10.0) << "node " << id << ": " << r.output;
    EXPECT_NE(r.output.find("got signal 15 while the nodes met"), std::string::npos) << r.output;
  }
}

// Note [Restarting a job of several nodes]: node 1's rank fails at once; node 0's fails
// two seconds later (as on a lost peer, after a collective's wait), its marker file
// present meanwhile. Both nodes start again together, after node 0's start has ended (no
// rank of the second start sees the marker), told the same count, and the job succeeds
// with one restart. Each launcher restarting on its own would start node 1's ranks beside
// node 0's first start, which spends node 1's restart on the marker.
TEST(Launcher, AFixedJobOfSeveralNodesRestartsTogether) {
  const std::string port = std::to_string(free_port_pair());
  const std::string marker = fmt::format("/tmp/flatshard-fixed-restart-{}", ::getpid());
  std::remove(marker.c_str());
  const std::string script =
      "echo \"env $RANK $WORLD_SIZE $TORCHELASTIC_RESTART_COUNT $MASTER_PORT\"; "
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then "
      "  if [ \"$RANK\" = 1 ]; then exit 3; fi; "
      "  touch " +
      marker + "; sleep 2; rm -f " + marker +
      "; exit 1; "
      "fi; "
      "if [ -e " +
      marker + " ]; then echo overlap; exit 9; fi; echo done-$RANK";
  std::vector<std::vector<std::string>> args;
  for (int id = 0; id < 2; ++id) {
    args.push_back({"-n", "1", "--nnodes", "2", "--node-rank", std::to_string(id), "--master-port", port,
                    "--max-restarts", "1", "--grace-s", "0.5", "--deadline-s", "60"});
  }
  std::vector<RunOptions> options(2);
  for (auto& o : options) o.env["FLATSHARD_JOB_SECRET"] = "fixed-test";
  const auto r = run_nodes(args, options, script);
  std::remove(marker.c_str());
  for (int id = 0; id < 2; ++id) {
    EXPECT_EQ(r[id].exit_code, 0) << "node " << id << ": " << r[id].output;
    EXPECT_EQ(r[id].output.find("overlap"), std::string::npos) << r[id].output;
    // Every start's ranks at --master-port, as without restarts.
    EXPECT_NE(r[id].output.find(fmt::format("[rank {0}] env {0} 2 1 {1}\n", id, port)), std::string::npos)
        << r[id].output;
    EXPECT_NE(r[id].output.find(fmt::format("[rank {0}] done-{0}", id)), std::string::npos) << r[id].output;
    EXPECT_NE(r[id].output.find("restart 1 of 1"), std::string::npos) << r[id].output;
    EXPECT_LT(r[id].seconds, 30.0) << r[id].output;
  }
}

// The job's deadline holds while the nodes meet: a node alone (the host waiting for the
// other, the other for a host that is not there; a fixed job with restarts meets too) ends
// with the deadline's code within seconds, not after --rdzv-timeout-s.
TEST(Launcher, TheDeadlineHoldsWhileTheNodesMeet) {
  const std::string port = std::to_string(free_port_pair());
  RunOptions options;
  options.env["FLATSHARD_JOB_SECRET"] = "deadline-test";
  for (const auto& nodes :
       {std::vector<std::string>{"--nnodes", "2:2", "--node-rank", "0"},
        std::vector<std::string>{"--nnodes", "2:2", "--node-rank", "1"},
        std::vector<std::string>{"--nnodes", "2", "--node-rank", "0", "--max-restarts", "2"}}) {
    std::vector<std::string> args{"-n",           "1", "--master-port", port, "--rdzv-timeout-s", "60",
                                  "--deadline-s", "1"};
    args.insert(args.end(), nodes.begin(), nodes.end());
    const auto r = run_command(launch(args, "echo started"), options);
    EXPECT_EQ(r.exit_code, 124) << fmt::format("{}", fmt::join(nodes, " ")) << ": " << r.output;
    EXPECT_LT(r.seconds, 10.0) << r.output;
    EXPECT_NE(r.output.find("passed its deadline of 1.0 s while the nodes met"), std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("started"), std::string::npos) << r.output;
  }
}

TEST(Launcher, FailedRankStopsTheOthersAndItsCodeIsTheJobs) {
  const auto r = run_command(
      launch({"-n", "3", "--grace-s", "0.5"}, "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 3; fi; sleep 60"));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_LT(r.seconds, 20.0) << "the sleeping ranks were not stopped";
  EXPECT_NE(r.output.find("rank 1 exited with code 3"), std::string::npos) << r.output;
}

// SIGTERM, and SIGHUP (a terminal or ssh session that went away), reach every rank as
// from the launcher, and end the job without a restart.
TEST(Launcher, ForwardsSigtermAndSighupToEveryRank) {
  for (const auto& [sig, name] : {std::pair{SIGTERM, "TERM"}, std::pair{SIGHUP, "HUP"}}) {
    RunOptions options;
    options.signal = sig;
    options.signal_after = std::chrono::milliseconds(1500);
    const auto r = run_command(launch({"-n", "2", "--max-restarts", "2"},
                                      fmt::format("echo start-$TORCHELASTIC_RESTART_COUNT; "
                                                  "trap 'echo got-{0}-$RANK; exit 7' {0}; sleep 30 & wait",
                                                  name)),
                               options);
    EXPECT_EQ(r.exit_code, 128 + sig) << r.output;
    EXPECT_NE(r.output.find(fmt::format("[rank 0] got-{}-0", name)), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(fmt::format("[rank 1] got-{}-1", name)), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("start-1"), std::string::npos) << "restarted after a signal: " << r.output;
  }
}

// Started ignoring SIGHUP (`nohup`), the launcher keeps ignoring it, and so do its ranks:
// the job outlives the session that started it.
TEST(Launcher, AnIgnoredSighupStaysIgnored) {
  RunOptions options;
  options.signal = SIGHUP;
  options.signal_after = std::chrono::milliseconds(500);
  const auto r = run_command(
      {"sh", "-c", "trap '' HUP; exec " + launcher_path() + " -n 2 sh -c 'sleep 2; echo survived-$RANK'"},
      options);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0] survived-0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1] survived-1"), std::string::npos) << r.output;
}

TEST(Launcher, DeadlineStopsAHungJob) {
  const auto r = run_command(launch({"-n", "2", "--deadline-s", "1"}, "sleep 60"));
  EXPECT_EQ(r.exit_code, 124) << r.output;
  EXPECT_LT(r.seconds, 15.0);
}

// Note [Restarting a failed job]: rank 1 fails in the first two starts; the third start
// succeeds, each start knowing its number; every rank of a failed start is stopped first.
TEST(Launcher, MaxRestartsStartsEveryRankAgainAfterAFailure) {
  const auto r = run_command(
      launch({"-n", "2", "--grace-s", "0.5", "--max-restarts", "3"},
             "echo start-$RANK-$TORCHELASTIC_RESTART_COUNT-$FLATSHARD_RESTART_COUNT-"
             "$TORCHELASTIC_MAX_RESTARTS; "
             "if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" -lt 2 ]; then "
             "sleep 0.2; exit 3; fi; "
             "if [ \"$RANK\" = 0 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" -lt 2 ]; then sleep 60; fi; "
             "echo done-$RANK"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 30.0) << "rank 0 of a failed start was not stopped";
  for (int start = 0; start < 3; ++start) {
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_NE(r.output.find(fmt::format("[rank {0}] start-{0}-{1}-{1}-3", rank, start)), std::string::npos)
          << r.output;
    }
  }
  EXPECT_EQ(r.output.find("start-0-3"), std::string::npos) << "no fourth start: " << r.output;
  EXPECT_NE(r.output.find("rank 1 exited with code 3; restart 1 of 3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1 exited with code 3; restart 2 of 3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 0] done-0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1] done-1"), std::string::npos) << r.output;
}

// Out of restarts, the job fails with the last start's code; a killed rank counts as a
// failure; a signal to the launcher ends the job without a restart.
TEST(Launcher, MaxRestartsEndsWithTheLastFailureAndNeverAfterASignal) {
  const auto spent = run_command(
      launch({"-n", "2", "--grace-s", "0.5", "--max-restarts", "1"},
             "echo start-$TORCHELASTIC_RESTART_COUNT; if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; sleep 60"));
  EXPECT_EQ(spent.exit_code, 128 + SIGKILL) << spent.output;
  EXPECT_NE(spent.output.find("rank 0 was killed by signal 9; restart 1 of 1"), std::string::npos)
      << spent.output;
  EXPECT_NE(spent.output.find("no restart left (--max-restarts 1): the job fails"), std::string::npos)
      << spent.output;
  RunOptions options;
  options.signal = SIGTERM;
  options.signal_after = std::chrono::milliseconds(1500);
  const auto stopped = run_command(launch({"-n", "2", "--max-restarts", "5"},
                                          "echo start-$TORCHELASTIC_RESTART_COUNT; "
                                          "sleep 30 & wait"),
                                   options);
  EXPECT_EQ(stopped.exit_code, 128 + SIGTERM) << stopped.output;
  EXPECT_EQ(stopped.output.find("start-1"), std::string::npos)
      << "restarted after a signal: " << stopped.output;
}

// Whether process `pid` runs: gone, or a zombie no one has reaped yet, it does not.
bool running(int pid) {
  FILE* stat = std::fopen(fmt::format("/proc/{}/stat", pid).c_str(), "r");
  if (stat == nullptr) return false;
  char line[512] = {};
  const bool read = std::fgets(line, sizeof(line), stat) != nullptr;
  std::fclose(stat);
  const char* paren = read ? std::strrchr(line, ')') : nullptr;
  return paren == nullptr || paren[2] != 'Z';
}

// The process id a rank wrote to `file` (0 when it wrote none); the file goes.
int take_pid(const std::string& file) {
  int pid = 0;
  if (FILE* f = std::fopen(file.c_str(), "r")) {
    if (std::fscanf(f, "%d", &pid) != 1) pid = 0;
    std::fclose(f);
  }
  std::remove(file.c_str());
  return pid;
}

// A rank that exits with a code above 128 exited: the restart names its code, not a signal.
// What it started and left running (a shell's background job, in its process group) is
// stopped with the other ranks, not left behind.
TEST(Launcher, AHighExitCodeIsACodeAndAnExitedRanksChildrenStop) {
  const std::string pid_file = fmt::format("/tmp/flatshard-launcher-helper-{}", ::getpid());
  std::remove(pid_file.c_str());
  const auto r = run_command(launch({"-n", "2", "--grace-s", "0.5", "--max-restarts", "1"},
                                    "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then "
                                    "if [ \"$RANK\" = 1 ]; then sleep 60 & echo $! > " +
                                        pid_file + "; exit 200; fi; sleep 60; fi; echo done-$RANK"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1 exited with code 200; restart 1 of 1"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("killed by signal"), std::string::npos) << r.output;
  const int pid = take_pid(pid_file);
  ASSERT_GT(pid, 0) << "rank 1 did not start its helper";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (running(pid) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(running(pid)) << "rank 1's background job (pid " << pid << ") outlived the launcher";
  if (running(pid)) ::kill(pid, SIGKILL);
}

// Note [What a rank leaves running]: every rank exits by itself, one leaving a background
// job. After a failed start (no rank left to stop) the launcher stops it before it returns;
// after a successful one it is the program's, and runs on.
TEST(Launcher, WhatRanksLeaveRunningStopsAfterAFailure) {
  for (const int code : {3, 0}) {
    const std::string pid_file = fmt::format("/tmp/flatshard-launcher-leftover-{}", ::getpid());
    std::remove(pid_file.c_str());
    const auto r =
        run_command(launch({"-n", "2"}, fmt::format("if [ \"$RANK\" = 1 ]; then sleep 60 > /dev/null "
                                                    "2>&1 & echo $! > {}; fi; exit {}",
                                                    pid_file, code)));
    EXPECT_EQ(r.exit_code, code) << r.output;
    EXPECT_LT(r.seconds, 10.0) << r.output;
    const int pid = take_pid(pid_file);
    ASSERT_GT(pid, 0) << "rank 1 did not start its helper";
    if (code != 0) {
      EXPECT_FALSE(running(pid)) << "rank 1's background job (pid " << pid << ") outlived a failed job";
      EXPECT_NE(r.output.find("stopping what the ranks left running"), std::string::npos) << r.output;
    } else {
      EXPECT_TRUE(running(pid)) << "a successful job's background work was stopped";
    }
    if (running(pid)) ::kill(pid, SIGKILL);
  }
}

TEST(Launcher, BadArgumentsPrintUsage) {
  for (auto args : std::vector<std::vector<std::string>>{
           {launcher_path()},
           {launcher_path(), "-n", "0", "true"},
           {launcher_path(), "--nnodes", "2", "-n", "1", "true"},
           {launcher_path(), "--bogus", "true"},
           {launcher_path(), "--max-restarts", "-1", "true"},
           {launcher_path(), "--nnodes", "2:1", "--master-port", "9", "true"},
           {launcher_path(), "--nnodes", "1:2", "true"}}) {
    const auto r = run_command(args);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("usage: flatshard-run"), std::string::npos) << r.output;
  }
}

TEST(Launcher, MissingProgramIsExitCode127) {
  const auto r = run_command({launcher_path(), "-n", "1", "/nonexistent/program"});
  EXPECT_EQ(r.exit_code, 127) << r.output;
}

}  // namespace
