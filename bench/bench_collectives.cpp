// Collective bandwidth over real ranks (start with flatshard-run -n 2). Every rank runs
// the same benchmarks with fixed iteration counts (the ranks must issue the same
// collectives), and rank 0 reports. Two families:
//   Communicator/<op>/<bytes>  the public API: validation, numbering, stream hand-off
//   Transport/<op>/<bytes>     the TCP ring transport called directly on this thread
// Bytes/s is the buffer size (the full flat buffer) over the time per op.
//
//   flatshard-run -n N bench_collectives [--beside-compute] [--bf16] [benchmark flags]
//
// --beside-compute keeps a compute thread busy on every rank (single-threaded matmuls, as
// a training rank's compute thread) for the whole run: the collectives as they run beside
// the compute in a step (bench/step_time_cpu.sh measures the link both ways, Note
// [Collectives beside compute] in src/plan/step_time.cpp). --bf16 moves bf16 values (as a
// bf16 communication hook's all-reduce does) in the same bytes: twice the values.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "flatshard/flatshard.h"
#include "src/comm/backend.h"

namespace {

using flatshard::ReduceOp;
using flatshard::comm::OpKind;

flatshard::World* g_world = nullptr;
flatshard::Communicator* g_comm = nullptr;
flatshard::comm::Backend* g_transport = nullptr;
at::ScalarType g_dtype = at::kFloat;

struct Buffers {
  at::Tensor full, slot;
};

Buffers make_buffers(std::int64_t bytes) {
  const auto options = at::TensorOptions().dtype(g_dtype);
  const std::int64_t numel = bytes / static_cast<std::int64_t>(c10::elementSize(g_dtype));
  const auto range = flatshard::shard_range(numel, g_world->world_size(), g_world->rank());
  return {at::ones({numel}, options), at::ones({range.numel}, options)};
}

void run_communicator(OpKind op, const Buffers& b) {
  switch (op) {
    case OpKind::AllGather: g_comm->all_gather(b.full, b.slot).wait(); break;
    case OpKind::ReduceScatter: g_comm->reduce_scatter(b.slot, b.full, ReduceOp::Sum).wait(); break;
    case OpKind::AllReduce: g_comm->all_reduce(b.full, ReduceOp::Sum).wait(); break;
    default: break;
  }
}

void run_transport(OpKind op, const Buffers& b) {
  flatshard::comm::Collective c;
  c.kind = op;
  c.deadline = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  c.input = op == OpKind::AllGather ? b.slot : b.full;
  c.output = op == OpKind::ReduceScatter ? b.slot : b.full;
  g_transport->run(c, 0);
}

void BM_Communicator(benchmark::State& state, OpKind op, std::int64_t bytes) {
  const auto b = make_buffers(bytes);
  g_comm->barrier().wait();
  for (auto _ : state) run_communicator(op, b);
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_Transport(benchmark::State& state, OpKind op, std::int64_t bytes) {
  const auto b = make_buffers(bytes);
  g_comm->barrier().wait();
  for (auto _ : state) run_transport(op, b);
  state.SetBytesProcessed(state.iterations() * bytes);
}

// Fixed iteration counts (every rank must run the same number of collectives), about
// 0.2-0.5 s of work per benchmark; one warm-up op before timing.
void register_all() {
  for (OpKind op : {OpKind::AllGather, OpKind::ReduceScatter, OpKind::AllReduce}) {
    for (std::int64_t bytes :
         {std::int64_t{64} << 10, std::int64_t{1} << 20, std::int64_t{16} << 20, std::int64_t{64} << 20}) {
      const int iterations = bytes <= (64 << 10)   ? 1000
                             : bytes <= (1 << 20)  ? 200
                             : bytes <= (16 << 20) ? 20
                                                   : 8;
      const std::string suffix = fmt::format("{}/{}", flatshard::comm::to_string(op), bytes);
      benchmark::RegisterBenchmark(("Communicator/" + suffix).c_str(), BM_Communicator, op, bytes)
          ->Iterations(iterations)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      benchmark::RegisterBenchmark(("Transport/" + suffix).c_str(), BM_Transport, op, bytes)
          ->Iterations(iterations)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
}

class SilentReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

// Single-threaded matmuls until `stop`: a rank's compute thread.
void keep_busy(const std::atomic<bool>& stop) {
  at::set_num_threads(1);
  const auto a = at::randn({256, 256});
  auto b = at::randn({256, 256});
  while (!stop.load(std::memory_order_relaxed)) b = at::tanh(at::mm(a, b));
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  bool beside_compute = false;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--beside-compute") == 0)
      beside_compute = true;
    else if (std::strcmp(argv[i], "--bf16") == 0)
      g_dtype = at::kBFloat16;
    else
      argv[kept++] = argv[i];
  }
  argc = kept;
  argv[argc] = nullptr;
  flatshard::World world = flatshard::init();
  auto comm = flatshard::Communicator::create(world);
  // The transport benchmarks get connections of their own, separate from comm's.
  flatshard::CommunicatorOptions transport_options;
  transport_options.name = "bench-transport";
  auto transport = flatshard::comm::make_tcp_ring_backend(world, transport_options, 1);
  g_world = &world;
  g_comm = comm.get();
  g_transport = transport.get();
  register_all();
  benchmark::Initialize(&argc, argv);
  std::atomic<bool> stop{false};
  std::thread busy;
  if (beside_compute) busy = std::thread(keep_busy, std::cref(stop));
  {
    struct Join {  // the compute thread stops however the benchmarks end, before the last barrier
      std::atomic<bool>& stop;
      std::thread& busy;
      ~Join() {
        stop = true;
        if (busy.joinable()) busy.join();
      }
    } join{stop, busy};
    if (world.rank() == 0) {
      benchmark::RunSpecifiedBenchmarks();
    } else {
      SilentReporter silent;
      benchmark::RunSpecifiedBenchmarks(&silent);
    }
  }
  comm->barrier().wait();
  benchmark::Shutdown();
  return 0;
}
