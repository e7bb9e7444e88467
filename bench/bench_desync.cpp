// Ranks doing the same work between barriers, no bytes moved: the share of the time each
// one waits. Ranks drift apart between two synchronisations wherever they do not run at one
// pace (cores shared by more ranks than there are, cores of uneven speed, a noisy
// neighbour), and the rank ahead waits at the next one: time that Note [Communication
// wait] counts though no collective had bytes to move. bench/step_time_cpu.sh prints it
// beside the engine's measured waits.
//
//   flatshard-run -n N bench_desync [--interval-ms 10] [--seconds 3]
//
// Every rank calibrates its work alone-together (all ranks running at once, as in the
// job), rank 0's figure is broadcast so that all do exactly the same, then each loop is the
// work and a barrier. Rank 0 prints one CSV line: world,interval_ms,wall_interval_ms,
// wait_share (the ranks' mean share of the wall time spent in the barrier's wait).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
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
  auto work = [&](std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) at::mm_out(out, a, a);
  };
  // Matmuls per millisecond with every rank running: rank 0's, for all.
  comm->barrier().wait();
  std::int64_t done = 0;
  const auto start = Clock::now();
  while (seconds_since(start) < 0.3) {
    work(16);
    done += 16;
  }
  auto rate = at::tensor({static_cast<double>(done) / 300.0}, at::kDouble);
  comm->broadcast(rate, 0).wait();
  const auto per_interval =
      std::max<std::int64_t>(1, static_cast<std::int64_t>(rate.item<double>() * interval_ms));
  const int loops = std::max(2, static_cast<int>(seconds * 1e3 / interval_ms));
  comm->barrier().wait();
  double waited = 0;
  const auto begin = Clock::now();
  for (int i = 0; i < loops; ++i) {
    work(per_interval);
    const auto w = Clock::now();
    comm->barrier().wait();
    waited += seconds_since(w);
  }
  const double wall = seconds_since(begin);
  auto share = at::tensor({waited / wall}, at::kDouble);
  comm->all_reduce(share, flatshard::ReduceOp::Avg).wait();
  if (world.rank() == 0) {
    std::printf("%d,%.2f,%.2f,%.4f\n", world.world_size(), interval_ms, wall * 1e3 / loops,
                share.item<double>());
  }
  return 0;
}
