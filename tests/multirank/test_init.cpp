// init() for real: every rendezvous method across processes, and the ways a
// rendezvous fails (port in use, unreachable master, a rank that never comes).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "flatshard/flatshard.h"
#include "src/tcp/auth.h"
#include "src/tcp/socket.h"
#include "src/tcp/store.h"
#include "tests/support/multirank.h"
#include "tests/support/subprocess.h"

namespace {

using flatshard::testing::launch_current_test;
using flatshard::testing::LaunchSpec;

// A socket listening on a free port; the port stays taken while it lives.
struct HeldPort {
  int fd = -1;
  int port = 0;
  explicit HeldPort(bool listen_on_it) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    if (listen_on_it) ::listen(fd, 1);
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
  }
  ~HeldPort() { ::close(fd); }
};

void expect_working_world(const flatshard::World& world) {
  auto comm = flatshard::Communicator::create(world);
  auto t = at::full({17}, static_cast<float>(world.rank() + 1));
  comm->all_reduce(t, flatshard::ReduceOp::Sum).wait();
  const int n = world.world_size();
  EXPECT_TRUE(at::equal(t, at::full({17}, n * (n + 1) / 2.0f)));
}

// The TCP states of this process's IPv4 connections whose local port is `port`: the timer
// column of /proc/net/tcp ("tr", 2 while a keepalive timer is pending) of each established one.
std::vector<int> established_timers(int port) {
  std::ifstream in("/proc/net/tcp");
  std::string line;
  std::getline(in, line);  // the header
  std::vector<int> timers;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state, queues, timer;
    fields >> slot >> local >> remote >> state >> queues >> timer;
    if (state != "01") continue;  // ESTABLISHED
    if (std::stoi(local.substr(local.find(':') + 1), nullptr, 16) != port) continue;
    timers.push_back(std::stoi(timer.substr(0, timer.find(':')), nullptr, 16));
  }
  return timers;
}

// Socket::keep_alive sets the probes it promises, and the rendezvous store keeps them on
// every rank's connection, which idles between requests for the whole job: a rank whose
// machine vanished is found gone instead of holding a serving thread until the job ends.
TEST(Sockets, KeepAliveProbesIdleConnections) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  flatshard::tcp::Socket s(fd, -1);
  s.keep_alive(10, 5, 3);
  const auto option = [&](int level, int name) {
    int value = -1;
    socklen_t len = sizeof(value);
    ::getsockopt(fd, level, name, &value, &len);
    return value;
  };
  EXPECT_EQ(option(SOL_SOCKET, SO_KEEPALIVE), 1);
  EXPECT_EQ(option(IPPROTO_TCP, TCP_KEEPIDLE), 10);
  EXPECT_EQ(option(IPPROTO_TCP, TCP_KEEPINTVL), 5);
  EXPECT_EQ(option(IPPROTO_TCP, TCP_KEEPCNT), 3);

  int port = 0;
  {
    HeldPort probe(false);
    port = probe.port;
  }
  auto store =
      flatshard::tcp::make_job_store("127.0.0.1", port, /*serve=*/true, "", std::chrono::seconds(10));
  store->set("k", std::vector<std::uint8_t>{1});
  // The server's end of the client's connection, once idle: while a reply is not yet
  // acknowledged its retransmit timer (1) shows instead.
  std::vector<int> timers;
  for (int i = 0; i < 100; ++i) {
    timers = established_timers(port);
    if (!timers.empty() && std::find(timers.begin(), timers.end(), 1) == timers.end()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_FALSE(timers.empty()) << "no connection to the store";
  for (int timer : timers)
    EXPECT_EQ(timer, 2) << "no keepalive timer on the store's end of a rank's connection";
}

TEST(InitMethods, TcpUrl) {
  if (!flatshard::testing::in_rank_mode()) {
    for (int n : {2, 3}) {
      int port;
      { port = HeldPort(false).port; }  // a port free a moment ago
      LaunchSpec spec;
      spec.ranks = n;
      spec.env["FLATSHARD_INIT_METHOD"] = "tcp://127.0.0.1:" + std::to_string(port);
      const auto r = launch_current_test(spec);
      EXPECT_EQ(r.exit_code, 0) << r.output;
    }
    return;
  }
  auto world = flatshard::init();
  EXPECT_EQ(world.spec.store_kind, "tcp");
  EXPECT_NE(std::getenv("MASTER_PORT"), nullptr);
  EXPECT_NE(std::to_string(world.spec.master_port), std::getenv("MASTER_PORT"))
      << "tcp:// must take precedence over MASTER_PORT";
  expect_working_world(world);
}

TEST(InitMethods, FileUrl) {
  if (!flatshard::testing::in_rank_mode()) {
    for (int n : {2, 3}) {
      const auto dir = std::filesystem::temp_directory_path() /
                       ("flatshard_file_init_" + std::to_string(::getpid()) + "_" + std::to_string(n));
      std::filesystem::remove_all(dir);
      std::filesystem::create_directories(dir);
      LaunchSpec spec;
      spec.ranks = n;
      spec.env["FLATSHARD_INIT_METHOD"] = "file://" + (dir / "store").string();
      const auto r = launch_current_test(spec);
      EXPECT_EQ(r.exit_code, 0) << r.output;
      std::filesystem::remove_all(dir);
    }
    return;
  }
  auto world = flatshard::init();
  EXPECT_EQ(world.spec.store_kind, "file");
  expect_working_world(world);
}

// A job that meets through a FileStore restarts: its failed start left the store's file
// behind with that start's rank claims, and flatshard-run removes it before the restart,
// whose ranks meet and finish (where the file stayed, they found their ranks claimed).
TEST(InitMethods, AFileStoreJobRestarts) {
  if (!flatshard::testing::in_rank_mode()) {
    const auto dir =
        std::filesystem::temp_directory_path() / ("flatshard_file_restart_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    LaunchSpec spec;
    spec.ranks = 2;
    spec.launcher_args = {"--max-restarts", "1", "--grace-s", "1"};
    spec.env["FLATSHARD_INIT_METHOD"] = "file://" + (dir / "store").string();
    const auto r = launch_current_test(spec);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("rank 1 exited with code 3; restart 1 of 1"), std::string::npos) << r.output;
    for (int rank : {0, 1})
      EXPECT_NE(r.output.find("met again: rank " + std::to_string(rank)), std::string::npos) << r.output;
    std::filesystem::remove_all(dir);
    return;
  }
  auto world = flatshard::init();
  if (std::string(std::getenv("FLATSHARD_RESTART_COUNT")) == "0") {
    if (world.rank() == 1) std::_Exit(3);                   // its claim, and rank 0's, stay in the file
    std::this_thread::sleep_for(std::chrono::seconds(30));  // until the launcher stops it
    return;
  }
  expect_working_world(world);
  std::printf("met again: rank %d\n", world.rank());
}

TEST(InitMethods, TorchrunEnvironmentFromTheLauncher) {
  FLATSHARD_RUN_RANKS({1, 2, 4});
  auto world = flatshard::init();
  EXPECT_EQ(world.rank(), std::atoi(std::getenv("RANK")));
  EXPECT_EQ(world.world_size(), std::atoi(std::getenv("WORLD_SIZE")));
  EXPECT_EQ(world.local_rank(), world.rank());
  EXPECT_EQ(world.local_world_size(), world.world_size());
  expect_working_world(world);
}

// Every rank adds rank + 1: the sum over the world, on every rank.
void expect_ranks_sum(const flatshard::World& world) {
  auto comm = flatshard::Communicator::create(world);
  auto t = at::full({5}, static_cast<float>(world.rank() + 1));
  comm->all_reduce(t, flatshard::ReduceOp::Sum).wait();
  const int n = world.world_size();
  EXPECT_TRUE(at::all(t == static_cast<float>(n * (n + 1) / 2)).item<bool>());
}

// Runs the current test's ranks under another launcher: `launcher` (its command and
// options), then this binary filtered to the current test, in rank mode.
flatshard::testing::RunResult run_current_test_under(std::vector<std::string> launcher,
                                                     const std::map<std::string, std::string>& env = {}) {
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  launcher.push_back(std::string(self, static_cast<std::size_t>(n > 0 ? n : 0)));
  launcher.push_back(std::string("--gtest_filter=") + info->test_suite_name() + "." + info->name());
  launcher.push_back("--gtest_color=no");
  flatshard::testing::RunOptions options;
  options.deadline = std::chrono::seconds(120);
  options.env = env;
  options.env["FLATSHARD_TEST_RANK_MODE"] = "1";
  return flatshard::testing::run_command(launcher, options);
}

// torchrun (the pinned torch's, `--no-python`) starts FlatShard ranks as it starts
// PyTorch's: the environment it sets is read by init(), and rank 0's store shares the port
// torchrun's agent serves (TORCHELASTIC_USE_AGENT_STORE, which LibTorch's TCPStore honours).
TEST(Launchers, TorchrunStartsFlatShardRanks) {
  if (flatshard::testing::in_rank_mode()) {
    auto world = flatshard::init();
    EXPECT_EQ(world.world_size(), 2);
    EXPECT_NE(std::getenv("TORCHELASTIC_RUN_ID"), nullptr) << "started by torchrun";
    expect_ranks_sum(world);
    return;
  }
  const auto r =
      run_current_test_under({FLATSHARD_TORCHRUN, "--no-python", "--standalone", "--nproc-per-node", "2"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[  PASSED  ] 1 test"), std::string::npos) << r.output;
}

// torchrun's agent keeps its store across restarts (--max-restarts): the second attempt's
// ranks meet in a store that still holds the first's keys (its join count, its ranks'
// claims), so each attempt keeps to keys of its own, as PyTorch's workers do. Rank 1 fails
// the first attempt after meeting; the second meets again and passes.
TEST(Launchers, TorchrunRestartsMeetAgain) {
  if (flatshard::testing::in_rank_mode()) {
    auto world = flatshard::init();
    expect_ranks_sum(world);
    if (std::string(std::getenv("TORCHELASTIC_RESTART_COUNT")) == "0" && world.rank() == 1) std::_Exit(3);
    return;
  }
  const auto r = run_current_test_under(
      {FLATSHARD_TORCHRUN, "--no-python", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[  PASSED  ] 1 test"), std::string::npos) << r.output;
}

// Open MPI's mpirun (Debian's openmpi-bin, which scripts/setup.sh installs) starts FlatShard
// ranks: init() reads OMPI_COMM_WORLD_*, and on one machine needs nothing more.
TEST(Launchers, MpirunStartsFlatShardRanks) {
  if (flatshard::testing::in_rank_mode()) {
    auto world = flatshard::init();
    EXPECT_EQ(world.world_size(), 2);
    EXPECT_EQ(world.rank(), std::atoi(std::getenv("OMPI_COMM_WORLD_RANK")));
    expect_ranks_sum(world);
    return;
  }
  const auto r = run_current_test_under({"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[  PASSED  ] 1 test"), std::string::npos) << r.output;
}

// The local addresses of the sockets listening on `port` (from /proc/net/tcp and tcp6, as
// the kernel writes them: "0100007F" is 127.0.0.1, "00000000" every IPv4 interface).
std::vector<std::string> listening_addresses(int port) {
  std::vector<std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (state != "0A" || colon == std::string::npos) continue;  // 0A: LISTEN
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port) out.push_back(local.substr(0, colon));
    }
  }
  return out;
}

// Two "nodes" on one machine: two flatshard-run processes, --nnodes 2 and a node rank
// each, two ranks per node, meet at one master port and make one world of four, proving
// the job secret both nodes were given (a launcher of several nodes makes none itself).
TEST(Launchers, TwoNodesOfFlatshardRunMakeOneWorld) {
  if (flatshard::testing::in_rank_mode()) {
    auto world = flatshard::init();
    EXPECT_EQ(world.world_size(), 4);
    EXPECT_EQ(world.local_world_size(), 2);
    EXPECT_EQ(world.rank(), 2 * std::atoi(std::getenv("GROUP_RANK")) + world.local_rank());
    EXPECT_EQ(flatshard::tcp::job_secret(), "two-nodes-one-job");
    expect_ranks_sum(world);
    return;
  }
  int port = 0;
  {
    HeldPort free_now(false);  // released before the nodes start
    port = free_now.port;
  }
  flatshard::testing::RunResult results[2];
  std::thread nodes[2];
  for (int node = 0; node < 2; ++node) {
    nodes[node] = std::thread([&, node] {
      results[node] = run_current_test_under(
          {flatshard::testing::launcher_path(), "-n", "2", "--nnodes", "2", "--node-rank",
           std::to_string(node), "--master-port", std::to_string(port), "--deadline-s", "90"},
          {{"FLATSHARD_JOB_SECRET", "two-nodes-one-job"}});
    });
  }
  for (auto& t : nodes) t.join();
  for (int node = 0; node < 2; ++node) {
    EXPECT_EQ(results[node].exit_code, 0) << "node " << node << "\n" << results[node].output;
    EXPECT_NE(results[node].output.find("[rank " + std::to_string(2 * node + 1) + "] [  PASSED  ] 1 test"),
              std::string::npos)
        << results[node].output;
  }
}

// The same two nodes meeting at an IPv6 master (Note [Either family] in src/tcp/socket.cpp):
// the launchers' rendezvous, the store and the ring all listen on ::1 alone, a loopback
// address of IPv6's family, and every rank reaches them.
TEST(Launchers, TwoNodesMeetAtAnIPv6Master) {
  if (flatshard::testing::in_rank_mode()) {
    auto world = flatshard::init();
    EXPECT_EQ(world.world_size(), 2);
    EXPECT_EQ(world.spec.master_addr, "::1");
    if (world.rank() == 0) {
      // /proc/net/tcp6 writes ::1 as four 32-bit words in the host's order.
      EXPECT_EQ(listening_addresses(world.spec.master_port),
                std::vector<std::string>{"00000000000000000000000001000000"});
    }
    expect_ranks_sum(world);
    return;
  }
  int port = 0;
  {
    HeldPort free_now(false);
    port = free_now.port;
  }
  flatshard::testing::RunResult results[2];
  std::thread nodes[2];
  for (int node = 0; node < 2; ++node) {
    nodes[node] = std::thread([&, node] {
      results[node] = run_current_test_under({flatshard::testing::launcher_path(), "-n", "1", "--nnodes", "2",
                                              "--node-rank", std::to_string(node), "--master-addr", "::1",
                                              "--master-port", std::to_string(port), "--deadline-s", "60"},
                                             {{"FLATSHARD_JOB_SECRET", "two-nodes-over-ipv6"}});
    });
  }
  for (auto& t : nodes) t.join();
  for (int node = 0; node < 2; ++node) {
    EXPECT_EQ(results[node].exit_code, 0) << "node " << node << "\n" << results[node].output;
    EXPECT_NE(results[node].output.find("[rank " + std::to_string(node) + "] [  PASSED  ] 1 test"),
              std::string::npos)
        << results[node].output;
  }
}

// A job on one machine (master 127.0.0.1, as flatshard-run sets it) serves its store on the
// loopback interface only: nothing from another machine can reach its keys.
TEST(Rendezvous, AOneMachineJobServesItsStoreOnLoopbackOnly) {
  FLATSHARD_RUN_RANKS({2});
  auto world = flatshard::init();
  EXPECT_EQ(world.spec.master_addr, "127.0.0.1");
  if (world.rank() == 0) {
    const auto addresses = listening_addresses(world.spec.master_port);
    ASSERT_FALSE(addresses.empty()) << "rank 0 serves the store on port " << world.spec.master_port;
    for (const auto& a : addresses) EXPECT_EQ(a, "0100007F") << "a listening socket on another address";
  }
  expect_working_world(world);
}

// A job across machines (LOCAL_WORLD_SIZE below WORLD_SIZE) whose MASTER_ADDR is a name this
// machine resolves to loopback (here "127.1", which is no dotted address and resolves to
// 127.0.0.1; in the field a host name that /etc/hosts maps to 127.0.1.1) fails init() at
// once with an InitError saying what to set, where rank 0 would have served its store on
// loopback and the other machines waited out their deadline. A loopback address given as
// such (nodes simulated on one machine, as Launchers.TwoNodesOfFlatshardRunMakeOneWorld
// does) is taken.
TEST(Rendezvous, ALoopbackMasterOfAJobAcrossMachinesIsRefused) {
  // These variables only, for this test's run: what a launcher around the test set is
  // cleared, and all of it restored after, whatever the test's outcome.
  struct Environment {
    std::map<std::string, std::optional<std::string>> saved;
    explicit Environment(const std::map<std::string, std::string>& vars) {
      for (const char* name :
           {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "GROUP_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
            "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE", "FLATSHARD_INIT_METHOD", "FLATSHARD_JOB_SECRET"}) {
        const char* v = std::getenv(name);
        saved[name] = v ? std::optional<std::string>(v) : std::nullopt;
        ::unsetenv(name);
      }
      for (const auto& [name, value] : vars) ::setenv(name.c_str(), value.c_str(), 1);
    }
    ~Environment() {
      for (const auto& [name, value] : saved) {
        if (value) {
          ::setenv(name.c_str(), value->c_str(), 1);
        } else {
          ::unsetenv(name.c_str());
        }
      }
    }
  } environment({{"RANK", "0"},
                 {"WORLD_SIZE", "2"},
                 {"LOCAL_WORLD_SIZE", "1"},
                 {"MASTER_ADDR", "127.1"},
                 {"MASTER_PORT", "29517"},
                 {"FLATSHARD_JOB_SECRET", "s"}});
  const auto start = std::chrono::steady_clock::now();
  try {
    flatshard::InitOptions o;
    o.timeout = std::chrono::seconds(20);
    flatshard::init(o);
    ADD_FAILURE() << "a loopback master was taken for a job across machines";
  } catch (const flatshard::InitError& e) {
    EXPECT_NE(std::string(e.what()).find("set MASTER_ADDR"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// A job whose launcher says it runs on one machine (here flatshard-run: LOCAL_WORLD_SIZE
// equals WORLD_SIZE) serves its store and takes its ring links on loopback even when
// MASTER_ADDR names another address (torchrun names the host), and needs no secret.
TEST(Rendezvous, AOneMachineJobUsesLoopbackWhateverItsMasterIsCalled) {
  if (!flatshard::testing::in_rank_mode()) {
    LaunchSpec spec;
    spec.ranks = 2;
    spec.launcher_args = {"--master-addr", "10.255.255.1"};
    spec.env = {{"FLATSHARD_JOB_SECRET", ""}};  // none: the launcher keeps what it is given
    const auto r = launch_current_test(spec);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return;
  }
  auto world = flatshard::init();
  EXPECT_EQ(world.spec.master_addr, "10.255.255.1");
  EXPECT_TRUE(flatshard::tcp::job_secret().empty());
  if (world.rank() == 0) {
    const auto addresses = listening_addresses(world.spec.master_port);
    ASSERT_FALSE(addresses.empty());
    for (const auto& a : addresses) EXPECT_EQ(a, "0100007F") << "a listening socket on another address";
  }
  expect_working_world(world);
}

// The ring's links of a job on one machine are accepted on the loopback interface only
// (src/tcp/ring_links.cpp makes its listener so when the ring is reached over loopback).
TEST(Rendezvous, RingListenersOfAOneMachineJobListenOnLoopbackOnly) {
  EXPECT_TRUE(flatshard::tcp::is_loopback("127.0.0.1"));
  EXPECT_TRUE(flatshard::tcp::is_loopback("127.3.2.1"));
  EXPECT_FALSE(flatshard::tcp::is_loopback("10.0.0.1"));
  EXPECT_FALSE(flatshard::tcp::is_loopback("localhost"));  // a name, not an address: left as is
  EXPECT_TRUE(flatshard::tcp::is_loopback("::1"));
  EXPECT_TRUE(flatshard::tcp::is_loopback("::ffff:127.0.0.1"));
  EXPECT_FALSE(flatshard::tcp::is_loopback("::ffff:10.0.0.1"));
  EXPECT_FALSE(flatshard::tcp::is_loopback("fd00::2"));
  EXPECT_EQ(flatshard::tcp::loopback_address_of("::1"), "::1");
  EXPECT_EQ(flatshard::tcp::loopback_address_of("localhost"), "127.0.0.1");  // IPv4's first
  EXPECT_EQ(flatshard::tcp::loopback_address_of("10.0.0.1"), "");
  EXPECT_EQ(flatshard::tcp::local_address_toward("::1", 80), "::1");
  const flatshard::tcp::Listener loopback("127.0.0.1"), loopback6("::1"), any("");
  EXPECT_EQ(listening_addresses(loopback.port()), std::vector<std::string>{"0100007F"});
  EXPECT_EQ(listening_addresses(loopback6.port()),
            std::vector<std::string>{"00000000000000000000000001000000"});
  // Every interface: one IPv6 socket that takes IPv4 as well.
  EXPECT_EQ(listening_addresses(any.port()), std::vector<std::string>{"00000000000000000000000000000000"});
  for (const std::string host : {"127.0.0.1", "::1"}) {
    auto s = flatshard::tcp::Socket::connect(host, any.port(), 0,
                                             std::chrono::steady_clock::now() + std::chrono::seconds(5));
    EXPECT_TRUE(s.valid()) << host;
  }
}

TEST(Rendezvous, PortInUseIsATypedErrorOnRankZero) {
  HeldPort taken(true);
  flatshard::InitOptions options;
  options.init_method = "tcp://127.0.0.1:" + std::to_string(taken.port);
  options.rank = 0;
  options.world_size = 2;
  options.timeout = std::chrono::seconds(2);
  try {
    flatshard::init(options);
    FAIL() << "init succeeded on a port that is in use";
  } catch (const flatshard::RendezvousError& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_PORT"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 0/2"), std::string::npos) << e.what();
  }
}

TEST(Rendezvous, UnreachableMasterFailsWithinTheTimeout) {
  int port;
  { port = HeldPort(false).port; }  // nobody listens there
  flatshard::InitOptions options;
  options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  options.rank = 1;
  options.world_size = 2;
  options.timeout = std::chrono::seconds(2);
  const auto start = std::chrono::steady_clock::now();
  try {
    flatshard::init(options);
    FAIL() << "init reached a master that does not exist";
  } catch (const flatshard::RendezvousError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot reach the rendezvous store"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
}

TEST(Rendezvous, MissingRankIsReportedByCount) {
  int port;
  { port = HeldPort(false).port; }
  flatshard::InitOptions options;
  options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  options.rank = 0;
  options.world_size = 3;
  options.timeout = std::chrono::milliseconds(1500);
  try {
    flatshard::init(options);
    FAIL() << "init completed without ranks 1 and 2";
  } catch (const flatshard::RendezvousError& e) {
    EXPECT_NE(std::string(e.what()).find("only 1 of 3 ranks joined"), std::string::npos) << e.what();
  }
}

// Two processes given one RANK (rank 2 of three takes rank 1's number): the second to
// claim it is told so at once, naming the first, instead of the job counting three ranks
// joined and waiting out a collective's timeout for the rank nobody is.
TEST(Rendezvous, ARankGivenTwiceIsNamed) {
  if (!flatshard::testing::in_rank_mode()) {
    LaunchSpec spec;
    spec.ranks = 3;
    spec.deadline = std::chrono::seconds(60);
    const auto r = launch_current_test(spec);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("rank 1 was already claimed by"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("only 2 of 3 ranks joined"), std::string::npos) << r.output;
    return;
  }
  if (std::string(std::getenv("RANK")) == "2") ::setenv("RANK", "1", 1);
  flatshard::InitOptions options;
  options.timeout = std::chrono::milliseconds(3000);
  try {
    flatshard::init(options);
    ADD_FAILURE() << "init completed with rank 1 given twice";
  } catch (const flatshard::RendezvousError& e) {
    std::printf("init failed: %s\n", e.what());
  }
}

// The job's store (Note [The job's store]) keeps TCPStore's meanings: set and get, add
// as decimal text, compareSet's three cases, check, delete, the key count, and a get or
// wait that times out instead of hanging.
TEST(JobStore, KeepsTheMeaningsOfTcpStore) {
  int port;
  { port = HeldPort(false).port; }
  const auto timeout = std::chrono::milliseconds(3000);
  auto server = flatshard::tcp::make_job_store("127.0.0.1", port, true, "s3cret", timeout);
  auto other = flatshard::tcp::make_job_store("127.0.0.1", port, false, "s3cret", timeout);
  const auto b = [](const std::string& s) { return std::vector<std::uint8_t>(s.begin(), s.end()); };
  server->set("a", b("one"));
  EXPECT_EQ(other->get("a"), b("one"));
  EXPECT_EQ(other->add("n", 5), 5);
  EXPECT_EQ(server->add("n", -2), 3);
  EXPECT_EQ(other->get("n"), b("3"));
  EXPECT_EQ(other->compareSet("a", b("one"), b("two")), b("two"));    // held the expected: swapped
  EXPECT_EQ(other->compareSet("a", b("one"), b("three")), b("two"));  // did not: what it holds
  EXPECT_EQ(other->compareSet("m", b("x"), b("y")), b("x"));          // missing, expected given
  EXPECT_FALSE(other->check({"m"}));
  EXPECT_EQ(other->compareSet("m", b(""), b("y")), b("y"));  // missing, expected empty: set
  EXPECT_TRUE(other->check({"a", "n", "m"}));
  EXPECT_EQ(other->getNumKeys(), 3);
  EXPECT_TRUE(other->deleteKey("m"));
  EXPECT_FALSE(other->deleteKey("m"));
  EXPECT_FALSE(other->check({"a", "m"}));
  // A get waits on the server until another client sets the key.
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    server->set("late", b("here"));
  });
  EXPECT_EQ(other->get("late"), b("here"));
  later.join();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(other->wait({"never"}, std::chrono::milliseconds(300)), c10::DistStoreError);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GT(waited, 0.25);
  EXPECT_LT(waited, 3.0);
  auto copy = other->clone();  // a second connection to the same keys
  EXPECT_EQ(copy->get("a"), b("two"));
}

// A rank whose secret differs from rank 0's cannot join the store, and is told why.
TEST(JobStore, ADifferentSecretCannotJoin) {
  int port;
  { port = HeldPort(false).port; }
  const auto timeout = std::chrono::milliseconds(3000);
  auto server = flatshard::tcp::make_job_store("127.0.0.1", port, true, "ours", timeout);
  try {
    flatshard::tcp::make_job_store("127.0.0.1", port, false, "theirs", timeout);
    FAIL() << "a client with another secret joined the store";
  } catch (const flatshard::tcp::IoError& e) {
    EXPECT_NE(e.detail.find("FLATSHARD_JOB_SECRET"), std::string::npos) << e.detail;
  }
  EXPECT_NO_THROW(flatshard::tcp::make_job_store("127.0.0.1", port, false, "ours", timeout));
}

// A job whose master is another machine's address listens beyond loopback, so it must
// carry a secret: without FLATSHARD_JOB_SECRET, init() refuses, naming the variable.
TEST(Rendezvous, AJobAcrossMachinesNeedsASecret) {
  const char* had = std::getenv("FLATSHARD_JOB_SECRET");
  const std::string saved = had == nullptr ? "" : had;
  ::unsetenv("FLATSHARD_JOB_SECRET");
  flatshard::InitOptions options;
  options.init_method = "tcp://10.255.255.1:29500";
  options.rank = 1;
  options.world_size = 2;
  options.timeout = std::chrono::seconds(2);
  try {
    flatshard::init(options);
    ADD_FAILURE() << "init went on without a secret";
  } catch (const flatshard::RendezvousError& e) {
    EXPECT_NE(std::string(e.what()).find("FLATSHARD_JOB_SECRET"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1/2"), std::string::npos) << e.what();
  }
  if (had != nullptr) ::setenv("FLATSHARD_JOB_SECRET", saved.c_str(), 1);
}

// Whether the peer closes `s` before `deadline` (whatever it sends first is read and
// dropped).
bool closed_by_peer(flatshard::tcp::Socket& s, flatshard::tcp::Clock::time_point deadline) {
  char byte;
  try {
    for (;;) s.recv_all(&byte, 1, deadline);
  } catch (const flatshard::tcp::IoError& e) {
    return e.kind == flatshard::tcp::IoError::Kind::Closed;
  }
}

// Strangers at `host:port`: one sends garbage, one proves the wrong secret, one proves
// none, and (with `silent`) one, connected first, says nothing at all. They connect before
// this returns (so they queue ahead of anyone connecting later); the returned thread waits
// for the listener's answers and expects each to be refused: the connection closed by
// the listener, not a deadline passed.
std::thread send_strangers(const std::string& host, int port, const char* purpose, bool silent = false) {
  namespace tcp = flatshard::tcp;
  const auto deadline = tcp::Clock::now() + std::chrono::seconds(60);
  tcp::Socket quiet;
  if (silent) quiet = tcp::Socket::connect(host, port, -1, deadline);
  std::vector<tcp::Socket> sockets;
  for (int i = 0; i < 3; ++i) sockets.push_back(tcp::Socket::connect(host, port, -1, deadline));
  std::vector<char> garbage(200);
  for (std::size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<char>(i * 37 + 11);
  sockets[0].send_all(garbage.data(), garbage.size(), deadline);
  return std::thread([sockets = std::move(sockets), quiet = std::move(quiet), purpose, deadline]() mutable {
    EXPECT_TRUE(closed_by_peer(sockets[0], deadline)) << purpose << ": garbage was not refused";
    const std::string secrets[] = {"not the job's secret", ""};
    for (int i = 0; i < 2; ++i) {
      try {
        tcp::prove_secret(sockets[i + 1], secrets[i], purpose, deadline);
        ADD_FAILURE() << purpose << ": a proof of '" << secrets[i] << "' was accepted";
      } catch (const tcp::IoError& e) {
        EXPECT_EQ(e.kind, tcp::IoError::Kind::Closed) << purpose << ": " << e.detail;
        EXPECT_NE(e.detail.find("refused this rank's proof"), std::string::npos) << e.detail;
      }
    }
    if (quiet.valid()) EXPECT_TRUE(closed_by_peer(quiet, deadline)) << purpose << ": the silent one was kept";
  });
}

// Note [Proving the job's secret]: strangers at the store's port and at a ring listener
// (garbage, the wrong secret, none, and one that connects and says nothing)
// are refused and logged, while the job's own ranks join, make a ring and reduce.
TEST(Rendezvous, StrangersAreRefusedAndLoggedAndTheJobGoesOn) {
  if (!flatshard::testing::in_rank_mode()) {
    LaunchSpec spec;
    spec.ranks = 2;
    spec.deadline = std::chrono::seconds(90);
    const auto r = launch_current_test(spec);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto count = [&](const std::string& what) {
      std::size_t n = 0;
      for (auto at = r.output.find(what); at != std::string::npos; at = r.output.find(what, at + 1)) ++n;
      return n;
    };
    EXPECT_GE(count("the rendezvous store refused a connection from 127.0.0.1:"), 3u) << r.output;
    EXPECT_EQ(count("communicator 'strangers': refused a ring link from 127.0.0.1:"), 4u) << r.output;
    return;
  }
  namespace tcp = flatshard::tcp;
  auto world = flatshard::init();
  ASSERT_EQ(world.world_size(), 2);
  const std::string secret = tcp::job_secret();
  ASSERT_FALSE(secret.empty()) << "flatshard-run gives a job on one machine a secret";
  const auto soon = [] { return tcp::Clock::now() + std::chrono::seconds(10); };
  const std::string host = world.spec.master_addr;
  const int port = world.spec.master_port;
  world.store->set("before", std::vector<std::uint8_t>{1, 2, 3});
  tcp::Socket silent;
  if (world.rank() == 0) {
    // The store: the job's own secret is accepted on this port (so the refusals below are
    // the secret's doing), strangers are not.
    {
      tcp::Socket s = tcp::Socket::connect(host, port, -1, soon());
      EXPECT_NO_THROW(tcp::prove_secret(s, secret, tcp::kStorePurpose, soon()));
    }
    send_strangers(host, port, tcp::kStorePurpose).join();
    silent = tcp::Socket::connect(host, port, -1, soon());  // held open, says nothing
  }
  // Rank 1's ring listener: the strangers connect before this rank's links, so they are
  // the first that rank 1 accepts; it must refuse them and still take this rank's.
  std::thread ring_strangers;
  if (world.rank() == 0) {
    const std::string key = "flatshard/comm/strangers/0/1";
    world.store->wait({key}, std::chrono::seconds(30));
    const auto value = world.store->get(key);
    const std::string address(value.begin(), value.end());
    const auto colon = address.rfind(':');
    ring_strangers = send_strangers(address.substr(0, colon), std::stoi(address.substr(colon + 1)),
                                    tcp::kRingPurpose, /*silent=*/true);
  }
  flatshard::CommunicatorOptions options;
  options.name = "strangers";
  const auto creating = std::chrono::steady_clock::now();
  auto comm = flatshard::Communicator::create(world, options);
  // The silent stranger, first in rank 1's queue, holds nobody up (a listener that checked
  // one connection at a time would wait out its 5 s to prove the secret).
  EXPECT_LT(std::chrono::steady_clock::now() - creating, std::chrono::seconds(4));
  auto t = at::full({33}, static_cast<float>(world.rank() + 1));
  comm->all_reduce(t, flatshard::ReduceOp::Sum).wait();
  EXPECT_TRUE(at::equal(t, at::full({33}, 3.0f)));
  EXPECT_EQ(world.store->get("before"), (std::vector<std::uint8_t>{1, 2, 3}));
  if (ring_strangers.joinable()) ring_strangers.join();
  comm->barrier().wait();
}

// Transport::Mpi lives in flatshard::mpi: a program that does not link it is told so by
// name, and FLATSHARD_TRANSPORT takes tcp or mpi only.
TEST(Transports, MpiWithoutFlatshardMpiAndUnknownNamesAreRefused) {
  const auto world = flatshard::init();  // one rank
  flatshard::CommunicatorOptions options;
  options.transport = flatshard::Transport::Mpi;
  try {
    flatshard::Communicator::create(world, options);
    ADD_FAILURE() << "Transport::Mpi without flatshard::mpi";
  } catch (const flatshard::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("flatshard::mpi"), std::string::npos) << e.what();
  }
  ::setenv("FLATSHARD_TRANSPORT", "carrier-pigeon", 1);
  try {
    flatshard::Communicator::create(world);
    ADD_FAILURE() << "an unknown FLATSHARD_TRANSPORT";
  } catch (const flatshard::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("carrier-pigeon"), std::string::npos) << e.what();
  }
  ::setenv("FLATSHARD_TRANSPORT", "tcp", 1);
  EXPECT_NO_THROW(flatshard::Communicator::create(world));
  ::unsetenv("FLATSHARD_TRANSPORT");
}

}  // namespace
