// Ranks doing the same work between barriers, no bytes moved: the share of the time each
// one waits. Ranks drift apart between two synchronisations wherever they do not run at one
// pace (cores shared by more ranks than there are, cores of uneven speed, a noisy
// neighbour), and the rank ahead waits at the next one: time that Note [Communication
// wait] counts though no collective had bytes to move. bench/step_time_cpu.sh prints it
// beside the engine's measured waits.
//
//   flatshard-run -n N bench_desync [--interval-ms 10] [--seconds 3]
//
// Every rank calibrates its work with all ranks running at once (as in the job), rank 0's
// figure is broadcast so that all do exactly the same, then each loop is the work and a
// barrier. A barrier costs its ring steps' latency even between ranks in step: bare
// barriers, with no work between them, time that floor first. Rank 0 prints one CSV line:
// world,interval_ms,wall_interval_ms,wait_share,barrier_ms,core_share (the ranks' mean share
// of the wall time spent in the barrier's wait, a bare barrier's mean time, and the ranks'
// mean share of the wall time spent in the wait woken with no core to run on; both from the
// communicator's wait clock, Note [Communication wait]).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "flatshard/flatshard.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  double interval_ms = 10, seconds = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--interval-ms") interval_ms = std::atof(argv[i + 1]);
    if (a == "--seconds") seconds = std::atof(argv[i + 1]);
  }
  if (interval_ms <= 0 || seconds <= 0) {
    std::fprintf(stderr, "bench_desync: --interval-ms and --seconds take positive numbers\n");
    return 2;
  }
  flatshard::World world = flatshard::init();
  auto comm = flatshard::Communicator::create(world);
  const auto a = at::randn({96, 96});
  auto out = at::empty({96, 96});
  auto work = [&](std::int64_t matmuls) {
    for (std::int64_t i = 0; i < matmuls; ++i) at::mm_out(out, a, a);
  };
  // The floor: bare barriers (as many on every rank: a count decided by each rank's clock
  // would leave one rank in a barrier the others never issue).
  constexpr int kBare = 200;
  comm->barrier().wait();
  const auto bare_start = Clock::now();
  for (int i = 0; i < kBare; ++i) comm->barrier().wait();
  auto barrier_ms = at::tensor({seconds_since(bare_start) * 1e3 / kBare}, at::kDouble);
  comm->all_reduce(barrier_ms, flatshard::ReduceOp::Avg).wait();
  // Matmuls per millisecond with every rank running: rank 0's, for all.
  comm->barrier().wait();
  std::int64_t done = 0;
  const auto start = Clock::now();
  while (seconds_since(start) < 0.3) {
    work(16);
    done += 16;
  }
  auto matmuls_per_ms = at::tensor({static_cast<double>(done) / (seconds_since(start) * 1e3)}, at::kDouble);
  comm->broadcast(matmuls_per_ms, 0).wait();
  const auto matmuls_per_interval =
      std::max<std::int64_t>(1, static_cast<std::int64_t>(matmuls_per_ms.item<double>() * interval_ms));
  const int loops = std::max(2, static_cast<int>(seconds * 1e3 / interval_ms));
  comm->barrier().wait();
  comm->time_waits(true);
  const auto begin = Clock::now();
  for (int i = 0; i < loops; ++i) {
    work(matmuls_per_interval);
    comm->barrier().wait();
  }
  const double wall_s = seconds_since(begin);
  comm->time_waits(false);
  const flatshard::CommunicationWait waited = comm->waited();
  auto share = at::tensor({waited.ms * 1e-3 / wall_s, waited.core_ms * 1e-3 / wall_s}, at::kDouble);
  comm->all_reduce(share, flatshard::ReduceOp::Avg).wait();
  if (world.rank() == 0) {
    std::printf("%d,%.2f,%.2f,%.4f,%.3f,%.4f\n", world.world_size(), interval_ms, wall_s * 1e3 / loops,
                share[0].item<double>(), barrier_ms.item<double>(), share[1].item<double>());
  }
  return 0;
}
