// A multi-rank collective demo: every rank contributes its rank number, and the
// collectives' results are checked and timed on each rank.
//
//   flatshard-run -n 4 ./build/examples/collective_demo [--mib 16]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "flatshard/flatshard.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t mib = 16;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--mib") == 0) mib = std::atoll(argv[i + 1]);
  }
  at::set_num_threads(1);
  try {
    auto world = flatshard::init();
    auto comm = flatshard::Communicator::create(world);
    const int rank = world.rank();
    const int n = world.world_size();
    const std::int64_t numel = mib * (1 << 20) / 4 + 3;  // deliberately not divisible by n

    // all_reduce: the sum of 0..n-1 everywhere.
    auto t = at::full({numel}, static_cast<float>(rank));
    auto start = std::chrono::steady_clock::now();
    comm->all_reduce(t, flatshard::ReduceOp::Sum).wait();
    const double ar_s = seconds_since(start);
    const float expect_sum = n * (n - 1) / 2.0f;
    const bool ar_ok = at::all(t == expect_sum).item<bool>();

    // reduce_scatter (avg) of the same buffer: each rank's slot holds the mean.
    auto full = at::full({numel}, static_cast<float>(rank));
    const auto slot = flatshard::shard_range(numel, n, rank);
    auto mine = at::empty({slot.numel});
    start = std::chrono::steady_clock::now();
    comm->reduce_scatter(mine, full, flatshard::ReduceOp::Avg).wait();
    const double rs_s = seconds_since(start);
    const bool rs_ok = at::allclose(mine, at::full({slot.numel}, (n - 1) / 2.0f));

    // all_gather in place: each rank writes its rank into its slot.
    auto gathered = at::empty({numel});
    auto my_slot = gathered.narrow(0, slot.offset, slot.numel);
    my_slot.fill_(static_cast<float>(rank));
    start = std::chrono::steady_clock::now();
    comm->all_gather(gathered, my_slot).wait();
    const double ag_s = seconds_since(start);
    bool ag_ok = true;
    for (int r = 0; r < n; ++r) {
      const auto s = flatshard::shard_range(numel, n, r);
      ag_ok = ag_ok && at::all(gathered.narrow(0, s.offset, s.numel) == static_cast<float>(r)).item<bool>();
    }
    comm->barrier().wait();

    const double mb = numel * 4 / 1e6;
    std::printf(
        "rank %d/%d: all_reduce %s %.1f MB/s | reduce_scatter %s %.1f MB/s | all_gather %s %.1f MB/s "
        "(%.1f MB buffer)\n",
        rank, n, ar_ok ? "ok" : "WRONG", mb / ar_s, rs_ok ? "ok" : "WRONG", mb / rs_s, ag_ok ? "ok" : "WRONG",
        mb / ag_s, mb);
    return ar_ok && rs_ok && ag_ok ? 0 : 1;
  } catch (const flatshard::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
