// Transport::Mpi (flatshard::mpi): the ranks started by mpirun, the collectives over MPI
// against the TCP rings, and every strategy against single-process training over MPI.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "flatshard/flatshard.h"
#include "tests/support/cases.h"
#include "tests/support/models.h"
#include "tests/support/multirank.h"
#include "tests/support/subprocess.h"
#include "tests/support/training.h"

namespace {

using flatshard::Strategy;
using flatshard::Transport;
using flatshard::testing::gpt_batch;
using flatshard::testing::gpt_factory;
using flatshard::testing::token_loss;
using flatshard::testing::TrainSpec;

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// The parent: runs the current test at each world size under mpirun (Debian's Open MPI),
// every rank in rank mode, and expects every rank to pass.
flatshard::testing::RunResult mpirun_current_test(int world,
                                                  const std::map<std::string, std::string>& env = {}) {
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  flatshard::testing::RunOptions options;
  options.deadline = std::chrono::seconds(240);
  options.env = env;
  options.env["FLATSHARD_TEST_RANK_MODE"] = "1";
  options.env["MASTER_PORT"] = std::to_string(free_port());
  std::vector<std::string> argv = {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np",
                                   std::to_string(world)};
  for (const auto& [name, value] : options.env) {
    argv.push_back("-x");
    argv.push_back(name);
  }
  argv.push_back(std::string(self, static_cast<std::size_t>(n > 0 ? n : 0)));
  argv.push_back(std::string("--gtest_filter=") + info->test_suite_name() + "." + info->name());
  argv.push_back("--gtest_color=no");
  return flatshard::testing::run_command(argv, options);
}

void run_under_mpirun(const std::vector<int>& worlds, const std::map<std::string, std::string>& env = {}) {
  for (int world : worlds) {
    const auto r = mpirun_current_test(world, env);
    EXPECT_EQ(r.exit_code, 0) << "world " << world << "\n" << r.output;
    std::size_t passed = 0;
    for (auto at = r.output.find("[  PASSED  ] 1 test"); at != std::string::npos;
         at = r.output.find("[  PASSED  ] 1 test", at + 1)) {
      ++passed;
    }
    EXPECT_EQ(passed, static_cast<std::size_t>(world)) << "world " << world << "\n" << r.output;
  }
}

// Whether MPI was initialized: only Transport::Mpi does that in these programs.
bool mpi_in_use() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  return initialized != 0;
}

#define FLATSHARD_RUN_UNDER_MPIRUN(...)          \
  do {                                           \
    if (!::flatshard::testing::in_rank_mode()) { \
      run_under_mpirun(__VA_ARGS__);             \
      return;                                    \
    }                                            \
  } while (0)

// Every op over MPI gives what it gives over the TCP rings, bit for bit where the order
// of the additions cannot differ (integers, gathers, broadcasts, exchanges), and to
// rounding for floating sums (MPI may add in another order), with even and uneven slots.
TEST(Mpi, CollectivesMatchTheRings) {
  if (!flatshard::testing::in_rank_mode()) {
    run_under_mpirun({2, 3});
    run_under_mpirun({2}, {{"FLATSHARD_MPI_BLOCKING", "1"}});  // MPI's blocking collectives
    return;
  }
  auto world = flatshard::init();
  ASSERT_GT(world.world_size(), 1);
  const int n = world.world_size(), rank = world.rank();
  flatshard::CommunicatorOptions mpi_options, tcp_options;
  mpi_options.name = "mpi";
  mpi_options.transport = Transport::Mpi;
  tcp_options.name = "tcp";
  tcp_options.transport = Transport::Tcp;
  auto mpi = flatshard::Communicator::create(world, mpi_options);
  auto tcp = flatshard::Communicator::create(world, tcp_options);
  at::manual_seed(1234 + rank);
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    for (const std::int64_t numel : {std::int64_t{6} * n, std::int64_t{1000} * n + 1}) {
      SCOPED_TRACE(::testing::Message() << c10::toString(dtype) << " " << numel);
      const at::Tensor x =
          dtype == at::kLong ? at::randint(-1000, 1000, {numel}, at::kLong) : at::randn({numel}).to(dtype);
      const bool exact = dtype == at::kLong;
      const auto same = [&](const at::Tensor& a, const at::Tensor& b) {
        if (exact) return at::equal(a, b);
        return at::allclose(a.to(at::kFloat), b.to(at::kFloat), dtype == at::kBFloat16 ? 2e-2 : 1e-5,
                            dtype == at::kBFloat16 ? 6e-2 : 1e-5);  // bf16: a few ulps at the sums' size
      };
      // all_reduce, sum and (floating) average
      for (const auto op : {flatshard::ReduceOp::Sum, flatshard::ReduceOp::Avg}) {
        if (exact && op == flatshard::ReduceOp::Avg) continue;
        at::Tensor a = x.clone(), b = x.clone();
        mpi->all_reduce(a, op).wait();
        tcp->all_reduce(b, op).wait();
        EXPECT_TRUE(same(a, b)) << "all_reduce";
        EXPECT_FALSE(at::equal(a, x)) << "all_reduce left the tensor as it was";
      }
      // reduce_scatter into this rank's shard_range slot, apart and in place
      const flatshard::ShardRange slot = flatshard::shard_range(numel, n, rank);
      {
        at::Tensor a = at::empty({slot.numel}, x.options()), b = at::empty({slot.numel}, x.options());
        mpi->reduce_scatter(a, x, flatshard::ReduceOp::Sum).wait();
        tcp->reduce_scatter(b, x, flatshard::ReduceOp::Sum).wait();
        EXPECT_TRUE(same(a, b)) << "reduce_scatter";
        at::Tensor whole = x.clone();
        at::Tensor mine = whole.narrow(0, slot.offset, slot.numel);
        mpi->reduce_scatter(mine, whole, flatshard::ReduceOp::Sum).wait();
        EXPECT_TRUE(same(mine, b)) << "reduce_scatter in place";
      }
      // all_gather of every rank's slot, apart and in place
      {
        const at::Tensor part = x.narrow(0, slot.offset, slot.numel).clone();
        at::Tensor a = at::empty({numel}, x.options()), b = at::empty({numel}, x.options());
        mpi->all_gather(a, part).wait();
        tcp->all_gather(b, part).wait();
        EXPECT_TRUE(at::equal(a, b)) << "all_gather";
        at::Tensor c = at::zeros({numel}, x.options());
        c.narrow(0, slot.offset, slot.numel).copy_(part);
        mpi->all_gather(c, c.narrow(0, slot.offset, slot.numel)).wait();
        EXPECT_TRUE(at::equal(c, b)) << "all_gather in place";
      }
      // broadcast from the last rank
      {
        at::Tensor a = x.clone(), b = x.clone();
        mpi->broadcast(a, n - 1).wait();
        tcp->broadcast(b, n - 1).wait();
        EXPECT_TRUE(at::equal(a, b)) << "broadcast";
      }
      // neighbour exchange
      {
        at::Tensor a = at::empty({2 * numel}, x.options()), b = at::empty({2 * numel}, x.options());
        mpi->neighbor_exchange(a, x).wait();
        tcp->neighbor_exchange(b, x).wait();
        EXPECT_TRUE(at::equal(a, b)) << "neighbor_exchange";
      }
    }
  }
  // A type MPI cannot move is refused on every rank before anything moves: an
  // InvalidArgument, and the communicator still works.
  at::Tensor flags = at::zeros({2 * n}, at::kBool);
  EXPECT_THROW(mpi->all_gather(flags, at::ones({2}, at::kBool)).wait(), flatshard::InvalidArgument);
  mpi->barrier().wait();
  EXPECT_TRUE(mpi_in_use());
}

// Every strategy trains over MPI as single-process training does on the same global
// batch (hybrid sharding at world 4, in groups of 2: its group and replica communicators
// are MPI communicators of their members only).
TEST(Mpi, EveryStrategyMatchesSingleProcess) {
  FLATSHARD_RUN_UNDER_MPIRUN({2, 4});
  auto world = flatshard::init();
  for (Strategy strategy : flatshard::testing::every_strategy(world.world_size())) {
    SCOPED_TRACE(to_string(strategy));
    TrainSpec spec;
    spec.strategy = strategy;
    spec.shard_group_size = strategy == Strategy::HybridShard ? 2 : 0;
    spec.transport = Transport::Mpi;
    spec.steps = 6;
    const auto r = flatshard::testing::train_and_compare<flatshard::testing::GPT>(
        world, gpt_factory(), [&](int s) { return gpt_batch(s, spec.global_batch); }, token_loss, spec);
    EXPECT_LE(r.max_rel_weight_diff, flatshard::testing::kFp32Tolerance) << r.worst_param;
    EXPECT_LE(r.max_rel_loss_diff, flatshard::testing::kFp32Tolerance);
  }
  EXPECT_TRUE(mpi_in_use()) << "the strategies did not communicate over MPI";
}

// A rank that never creates a communicator the others create: their creation fails
// within its deadline with a RendezvousError that names the missing rank (not the
// store's own error type).
TEST(Mpi, ARankThatNeverCreatesTheCommunicatorIsARendezvousError) {
  FLATSHARD_RUN_UNDER_MPIRUN({2});
  auto world = flatshard::init();
  flatshard::CommunicatorOptions options;
  options.transport = Transport::Mpi;
  options.timeout = std::chrono::seconds(2);
  auto both = flatshard::Communicator::create(world, options);  // every rank is in MPI
  if (world.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    return;
  }
  options.name = "rank-0-alone";
  try {
    flatshard::Communicator::create(world, options);
    ADD_FAILURE() << "created without rank 1";
  } catch (const flatshard::RendezvousError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 did not publish its MPI rank"), std::string::npos)
        << e.what();
  }
}

// A peer that never joins: over the non-blocking collectives the waiting rank gets a
// CommError (Timeout) naming the op, its number and the rank within the deadline; over
// the blocking ones the watchdog ends the whole job through MPI_Abort, saying which op,
// instead of letting it hang.
TEST(Mpi, APeerThatNeverJoinsIsBoundedByTheDeadline) {
  if (!flatshard::testing::in_rank_mode()) {
    auto start = std::chrono::steady_clock::now();
    {
      // Non-blocking: rank 0's checks pass (the CommError); it then leaves MPI unfinalized,
      // since the collective it gave up is still pending, and mpirun ends the job.
      const auto r = mpirun_current_test(2);
      EXPECT_NE(r.output.find("[  PASSED  ] 1 test"), std::string::npos) << r.output;
      EXPECT_EQ(r.output.find("[  FAILED  ]"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("MPI is left unfinalized"), std::string::npos) << r.output;
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60)) << r.output;
    }
    start = std::chrono::steady_clock::now();
    const auto r = mpirun_current_test(2, {{"FLATSHARD_MPI_BLOCKING", "1"}});
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("rank 0/2: all_reduce #2 did not complete within its deadline over MPI"),
              std::string::npos)
        << r.output;
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60)) << r.output;
    return;
  }
  auto world = flatshard::init();
  flatshard::CommunicatorOptions options;
  options.transport = Transport::Mpi;
  options.timeout = std::chrono::seconds(2);
  auto comm = flatshard::Communicator::create(world, options);
  at::Tensor t = at::ones({1000});
  comm->all_reduce(t, flatshard::ReduceOp::Sum).wait();  // both ranks are up
  if (world.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(5));
  } else {
    const auto start = std::chrono::steady_clock::now();
    try {
      comm->all_reduce(t, flatshard::ReduceOp::Sum).wait();
      ADD_FAILURE() << "the all-reduce completed without its peer";
    } catch (const flatshard::CommError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("all_reduce #2"), std::string::npos) << what;
      EXPECT_NE(what.find("rank 0/2"), std::string::npos) << what;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
    return;
  }
  // Rank 1, late: its all-reduce meets the one rank 0 left posted, or fails at its own
  // deadline, or mpirun ends this rank first; none of these is a failure of the test.
  try {
    comm->all_reduce(t, flatshard::ReduceOp::Sum).wait();
  } catch (const flatshard::CommError&) {
  }
}

}  // namespace
