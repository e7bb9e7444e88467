// Transport::Mpi: the collectives of a CPU Communicator over MPI (an existing, tuned engine
// that every HPC site has), one MPI communicator per stream role. Linking flatshard::mpi
// registers it (Note [MPI under the scheduler]).
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "flatshard/errors.h"
#include "flatshard/shard.h"
#include "src/comm/backend.h"

// Referenced by flatshard::mpi's link options (-u), so that a static link keeps this file,
// and with it the registration below.
extern "C" {
int flatshard_mpi_link_anchor = 0;
}

namespace flatshard::mpi {
namespace {

using comm::Collective;
using comm::OpKind;
using comm::TransportFailure;

// Note [MPI under the scheduler]
// The scheduler runs each stream role's ops in order on a worker thread of its own, the
// same order on every rank (as for the TCP rings), so each role gets an MPI communicator
// of its own (MPI_Comm_dup). By default its ops are MPI's non-blocking collectives,
// polled with MPI_Testall (yielding for a millisecond, then sleeping up to 200 us between
// tests) until they complete, the op's deadline passes or the Communicator aborts; then
// the op fails with a CommError like any other. MPI cannot cancel a collective: after a
// deadline or an abort the transport refuses every later op, and the buffers MPI still
// holds are kept for the life of the process. FLATSHARD_MPI_BLOCKING=1 uses MPI's blocking
// collectives instead, whose algorithms are usually the tuned ones (Open MPI's non-blocking
// collectives are a separate, slower implementation): a watchdog thread then watches
// each op's deadline and, since nothing can interrupt a blocking collective, ends the job
// through MPI_Abort after printing which op on which rank, rather than letting it hang.
// MPI runs with MPI_THREAD_MULTIPLE (three workers call it at once); init happens on the
// first MPI communicator (or is the program's own, if it called MPI_Init_thread itself),
// finalize at exit. The World's ranks are mapped to MPI_COMM_WORLD's through the store
// (each rank publishes its MPI rank), so subworlds (hybrid sharding's groups) get
// communicators of exactly their members (MPI_Comm_create_group). Slots of an all-gather
// or a reduce-scatter follow shard_range, as on the rings (uneven sizes: MPI's
// v-variants). bf16 and fp16 sums are MPI user ops that add in fp32 and round once per
// pair; Avg divides after the sum. Not done, where the rings do it: checking that ranks
// agree on an op's kind, size and dtype (a mismatch is MPI's undefined behaviour, bounded
// by the deadline).

MPI_Op g_bf16_sum = MPI_OP_NULL;
MPI_Op g_half_sum = MPI_OP_NULL;

template <typename T>
void sum_16(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = T(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

// Buffers of ops that MPI still holds after their wait was given up (a deadline, an
// abort): MPI may write into them whenever the peers arrive, so they live as long as the
// process.
std::atomic<bool> g_stranded{false};  // some op's wait was given up: MPI still holds it

void keep_alive(std::shared_ptr<void> p) {
  static std::mutex mutex;
  static auto* kept = new std::vector<std::shared_ptr<void>>();  // never freed, on purpose
  g_stranded.store(true);
  std::lock_guard<std::mutex> lock(mutex);
  kept->push_back(std::move(p));
}

void strand(const at::Tensor& t) {
  if (t.defined()) keep_alive(std::make_shared<at::Tensor>(t));
}

// MPI_Finalize with collectives still pending is not allowed, and may wait for peers that
// never come: a process that gave up on an op leaves MPI unfinalized (its launcher then
// ends the job, which an op past its deadline has failed anyway).
void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (g_stranded.load()) {
    std::fprintf(stderr,
                 "flatshard: MPI is left unfinalized: collectives given up at their deadline are still "
                 "pending\n");
    return;
  }
  MPI_Finalize();
}

// MPI, initialized with MPI_THREAD_MULTIPLE once per process.
void ensure_mpi(const World& world) {
  static std::mutex mutex;
  static bool ready = false;
  std::lock_guard<std::mutex> lock(mutex);
  if (ready) return;
  int initialized = 0, provided = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
      throw RendezvousError(
          fmt::format("flatshard::Communicator::create (rank {}/{}): MPI_Init_thread failed; start "
                      "the ranks with mpirun or srun",
                      world.rank(), world.world_size()));
    }
    std::atexit(finalize_at_exit);
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    throw RendezvousError(fmt::format(
        "flatshard::Communicator::create (rank {}/{}): Transport::Mpi needs MPI_THREAD_MULTIPLE (the "
        "scheduler's three stream workers call MPI at once); this MPI provides level {}",
        world.rank(), world.world_size(), provided));
  }
  MPI_Op_create(&sum_16<c10::BFloat16>, 1, &g_bf16_sum);
  MPI_Op_create(&sum_16<c10::Half>, 1, &g_half_sum);
  ready = true;
}

MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kShort: return MPI_INT16_T;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kBFloat16:
    case at::kHalf: return MPI_UINT16_T;  // summed by the user ops above
    default:
      throw InvalidArgument(
          fmt::format("flatshard: Transport::Mpi does not move {} tensors", c10::toString(t)));
  }
}

MPI_Op mpi_sum(at::ScalarType t) {
  if (t == at::kBFloat16) return g_bf16_sum;
  if (t == at::kHalf) return g_half_sum;
  return MPI_SUM;
}

int as_count(std::int64_t n) {
  if (n > INT_MAX) {
    throw InvalidArgument(fmt::format(
        "flatshard: Transport::Mpi counts elements in int; {} is too many for one op (use Transport::Tcp)",
        n));
  }
  return static_cast<int>(n);
}

class MpiBackend final : public comm::Backend {
 public:
  MpiBackend(const World& world, const CommunicatorOptions& options, int channels)
      : rank_(world.rank()), n_(world.world_size()) {
    if (n_ == 1) return;  // nothing crosses: no MPI at all
    ensure_mpi(world);
    // Each rank publishes its MPI rank; the group is MPI_COMM_WORLD's ranks in World order.
    const std::string prefix = comm::next_rendezvous_prefix(world, options.name) + "mpi/";
    int mine = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &mine);
    const std::string text = std::to_string(mine);
    std::vector<int> members(static_cast<std::size_t>(n_));
    int waiting_for = rank_;
    try {
      world.store->set(prefix + std::to_string(rank_), std::vector<std::uint8_t>(text.begin(), text.end()));
      for (int r = 0; r < n_; ++r) {
        waiting_for = r;
        const std::string key = prefix + std::to_string(r);
        world.store->wait({key}, options.timeout);
        const auto v = world.store->get(key);
        members[static_cast<std::size_t>(r)] = std::stoi(std::string(v.begin(), v.end()));
      }
    } catch (const c10::Error& e) {  // the store's timeout or a lost store
      throw RendezvousError(fmt::format(
          "flatshard::Communicator::create (rank {}/{}, communicator '{}'): rank {} did not publish its MPI "
          "rank "
          "within {} ms ({}): every rank must create the communicator, with the same name; check that rank's "
          "output",
          rank_, n_, options.name, waiting_for, options.timeout.count(), e.what_without_backtrace()));
    }
    MPI_Group everyone = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
    MPI_Comm_group(MPI_COMM_WORLD, &everyone);
    MPI_Group_incl(everyone, n_, members.data(), &group);
    MPI_Comm base = MPI_COMM_NULL;
    const int tag = static_cast<int>(std::hash<std::string>{}(prefix) % 30000);
    const int rc = MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &base);
    MPI_Group_free(&group);
    MPI_Group_free(&everyone);
    if (rc != MPI_SUCCESS || base == MPI_COMM_NULL) {
      throw RendezvousError(
          fmt::format("flatshard::Communicator::create (rank {}/{}, communicator '{}'): "
                      "MPI_Comm_create_group failed: are "
                      "the ranks started by one mpirun (or srun) and FlatShard's ranks MPI's?",
                      rank_, n_, options.name));
    }
    comms_.resize(static_cast<std::size_t>(channels), MPI_COMM_NULL);
    for (auto& c : comms_) MPI_Comm_dup(base, &c);
    MPI_Comm_free(&base);
    const char* blocking = std::getenv("FLATSHARD_MPI_BLOCKING");
    blocking_ = blocking != nullptr && std::string(blocking) == "1";
    if (blocking_) {
      flights_.resize(static_cast<std::size_t>(channels));
      watchdog_ = std::thread([this] { watch(); });
    }
  }

  ~MpiBackend() override {
    if (watchdog_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(watch_mutex_);
        stop_ = true;
      }
      watch_cv_.notify_all();
      watchdog_.join();
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized || aborted_.load()) return;  // an op MPI could not cancel may still hold them
    for (auto& c : comms_) MPI_Comm_free(&c);
  }

  std::shared_ptr<DeviceEvent> run(const Collective& op, int channel) override {
    if (aborted_.load()) {
      throw TransportFailure(CommError::Kind::Aborted, -1,
                             "the communicator was aborted by an earlier failure");
    }
    if (n_ == 1) {
      comm::run_on_one_rank(op);
      return nullptr;
    }
    const MPI_Comm comm = comms_.at(static_cast<std::size_t>(channel));
    if (blocking_ && op.kind != OpKind::NeighborExchange) {
      const Watched watched(*this, channel, op);
      run_blocking(op, comm);
      return nullptr;
    }
    switch (op.kind) {
      case OpKind::AllGather: all_gather(op, comm); break;
      case OpKind::ReduceScatter: reduce_scatter(op, comm); break;
      case OpKind::AllReduce: all_reduce(op, comm); break;
      case OpKind::Broadcast: {
        MPI_Request r;
        MPI_Ibcast(op.output.data_ptr(), as_count(op.output.numel()), mpi_type(op.output.scalar_type()),
                   op.root, comm, &r);
        wait(&r, 1, op);
        break;
      }
      case OpKind::Barrier: {
        MPI_Request r;
        MPI_Ibarrier(comm, &r);
        wait(&r, 1, op);
        break;
      }
      case OpKind::NeighborExchange: neighbor_exchange(op, comm); break;
    }
    return nullptr;
  }

  void abort() override { aborted_.store(true); }

 private:
  // FLATSHARD_MPI_BLOCKING=1: MPI's blocking collectives (its tuned algorithms; Note [MPI
  // under the scheduler]), each watched by the watchdog below.
  void run_blocking(const Collective& op, MPI_Comm comm) {
    const auto dtype = (op.output.defined() ? op.output : op.input).scalar_type();
    switch (op.kind) {
      case OpKind::AllGather: {
        std::vector<int> counts, offsets;
        slots(op.output.numel(), counts, offsets);
        const MPI_Datatype type = mpi_type(dtype);
        char* out = static_cast<char*>(op.output.data_ptr());
        const char* mine = out + static_cast<std::size_t>(offsets[static_cast<std::size_t>(rank_)]) *
                                     op.output.element_size();
        const void* send = op.input.data_ptr() == mine ? MPI_IN_PLACE : op.input.data_ptr();
        MPI_Allgatherv(send, counts[static_cast<std::size_t>(rank_)], type, out, counts.data(),
                       offsets.data(), type, comm);
        break;
      }
      case OpKind::ReduceScatter: {
        std::vector<int> counts, offsets;
        slots(op.input.numel(), counts, offsets);
        const bool overlap = op.output.storage().is_alias_of(op.input.storage());
        at::Tensor out = overlap ? at::empty_like(op.output) : op.output;
        MPI_Reduce_scatter(op.input.data_ptr(), out.data_ptr(), counts.data(), mpi_type(dtype),
                           mpi_sum(dtype), comm);
        if (op.reduce == ReduceOp::Avg) out.div_(n_);
        if (overlap) op.output.copy_(out);
        break;
      }
      case OpKind::AllReduce:
        MPI_Allreduce(MPI_IN_PLACE, op.output.data_ptr(), as_count(op.output.numel()), mpi_type(dtype),
                      mpi_sum(dtype), comm);
        if (op.reduce == ReduceOp::Avg) op.output.div_(n_);
        break;
      case OpKind::Broadcast:
        MPI_Bcast(op.output.data_ptr(), as_count(op.output.numel()), mpi_type(dtype), op.root, comm);
        break;
      case OpKind::Barrier: MPI_Barrier(comm); break;
      case OpKind::NeighborExchange: break;  // always non-blocking
    }
  }

  // A blocking op in flight on a channel, for the watchdog.
  struct Flight {
    bool active = false;
    std::string what;
    std::chrono::steady_clock::time_point deadline;
  };
  class Watched {
   public:
    Watched(MpiBackend& b, int channel, const Collective& op) : b_(b), channel_(channel) {
      std::lock_guard<std::mutex> lock(b_.watch_mutex_);
      b_.flights_[static_cast<std::size_t>(channel)] = {
          true, fmt::format("{} #{}", comm::to_string(op.kind), op.seq), op.deadline};
    }
    ~Watched() {
      std::lock_guard<std::mutex> lock(b_.watch_mutex_);
      b_.flights_[static_cast<std::size_t>(channel_)].active = false;
    }
    Watched(const Watched&) = delete;
    Watched& operator=(const Watched&) = delete;

   private:
    MpiBackend& b_;
    int channel_;
  };

  // MPI cannot interrupt a blocking collective: a blocking op past its deadline ends the
  // job (MPI_Abort, which mpirun and srun carry to every rank) after saying which op.
  void watch() {
    std::unique_lock<std::mutex> lock(watch_mutex_);
    while (!stop_) {
      watch_cv_.wait_for(lock, std::chrono::milliseconds(50));
      for (const Flight& f : flights_) {
        if (f.active && std::chrono::steady_clock::now() > f.deadline) {
          std::fprintf(
              stderr,
              "flatshard: rank %d/%d: %s did not complete within its deadline over MPI's blocking "
              "collectives (a peer died, is stuck, or issued other collectives); MPI cannot interrupt it, "
              "so the job is aborted (MPI_Abort)\n",
              rank_, n_, f.what.c_str());
          std::fflush(stderr);
          MPI_Abort(MPI_COMM_WORLD, 1);
        }
      }
    }
  }

  int next() const { return (rank_ + 1) % n_; }
  int prev() const { return (rank_ + n_ - 1) % n_; }

  // Every rank's slot (shard_range) of a buffer of `numel` elements.
  void slots(std::int64_t numel, std::vector<int>& counts, std::vector<int>& offsets) const {
    counts.resize(static_cast<std::size_t>(n_));
    offsets.resize(static_cast<std::size_t>(n_));
    for (int r = 0; r < n_; ++r) {
      const ShardRange s = shard_range(numel, n_, r);
      counts[static_cast<std::size_t>(r)] = as_count(s.numel);
      offsets[static_cast<std::size_t>(r)] = as_count(s.offset);
    }
  }

  void all_gather(const Collective& op, MPI_Comm comm) {
    // MPI may read the counts until the op completes: they outlive an op given up.
    auto layout = std::make_shared<std::pair<std::vector<int>, std::vector<int>>>();
    auto& [counts, offsets] = *layout;
    slots(op.output.numel(), counts, offsets);
    const MPI_Datatype type = mpi_type(op.output.scalar_type());
    char* out = static_cast<char*>(op.output.data_ptr());
    const char* mine =
        out + static_cast<std::size_t>(offsets[static_cast<std::size_t>(rank_)]) * op.output.element_size();
    const void* send = op.input.data_ptr() == mine ? MPI_IN_PLACE : op.input.data_ptr();
    MPI_Request r;
    MPI_Iallgatherv(send, counts[static_cast<std::size_t>(rank_)], type, out, counts.data(), offsets.data(),
                    type, comm, &r);
    try {
      wait(&r, 1, op);
    } catch (...) {
      keep_alive(layout);
      throw;
    }
  }

  void reduce_scatter(const Collective& op, MPI_Comm comm) {
    auto layout = std::make_shared<std::pair<std::vector<int>, std::vector<int>>>();
    auto& [counts, offsets] = *layout;
    slots(op.input.numel(), counts, offsets);
    const auto dtype = op.input.scalar_type();
    // The output may be this rank's slot of the input (in place): MPI wants them apart.
    const bool overlap = op.output.storage().is_alias_of(op.input.storage());
    at::Tensor out = overlap ? at::empty_like(op.output) : op.output;
    MPI_Request r;
    MPI_Ireduce_scatter(op.input.data_ptr(), out.data_ptr(), counts.data(), mpi_type(dtype), mpi_sum(dtype),
                        comm, &r);
    try {
      wait(&r, 1, op);
    } catch (...) {
      strand(out);
      keep_alive(layout);
      throw;
    }
    if (op.reduce == ReduceOp::Avg) out.div_(n_);
    if (overlap) op.output.copy_(out);
  }

  void all_reduce(const Collective& op, MPI_Comm comm) {
    const auto dtype = op.output.scalar_type();
    MPI_Request r;
    MPI_Iallreduce(MPI_IN_PLACE, op.output.data_ptr(), as_count(op.output.numel()), mpi_type(dtype),
                   mpi_sum(dtype), comm, &r);
    wait(&r, 1, op);
    if (op.reduce == ReduceOp::Avg) op.output.div_(n_);
  }

  // The previous rank's input into the first half of the output, the next rank's into the
  // second (tags tell them apart at world 2, where both are one rank).
  void neighbor_exchange(const Collective& op, MPI_Comm comm) {
    const int count = as_count(op.input.numel());
    const MPI_Datatype type = mpi_type(op.input.scalar_type());
    char* out = static_cast<char*>(op.output.data_ptr());
    const std::size_t half = op.input.nbytes();
    MPI_Request r[4];
    MPI_Irecv(out, count, type, prev(), kToNext, comm, &r[0]);
    MPI_Irecv(out + half, count, type, next(), kToPrev, comm, &r[1]);
    MPI_Isend(op.input.data_ptr(), count, type, next(), kToNext, comm, &r[2]);
    MPI_Isend(op.input.data_ptr(), count, type, prev(), kToPrev, comm, &r[3]);
    wait(r, 4, op);
  }

  // Polls until the requests complete, the op's deadline passes or the transport aborts:
  // yielding for the first millisecond (each test is also what moves MPI's non-blocking
  // collectives on, so small ops finish in microseconds), then sleeping up to 200 us
  // between tests (so that a long wait leaves the cores to compute).
  void wait(MPI_Request* requests, int count, const Collective& op) {
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1);
    auto pause = std::chrono::microseconds(1);
    for (;;) {
      int done = 0;
      MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE);
      if (done) return;
      if (aborted_.load()) {
        strand(op.input);
        strand(op.output);
        throw TransportFailure(CommError::Kind::Aborted, -1, "aborted after a failure on another stream");
      }
      if (std::chrono::steady_clock::now() > op.deadline) {
        aborted_.store(true);
        strand(op.input);
        strand(op.output);
        throw TransportFailure(
            CommError::Kind::Timeout, -1,
            "did not complete within its deadline (a peer died, is stuck, or issued other "
            "collectives); MPI cannot cancel it, so this communicator refuses every later op");
      }
      if (std::chrono::steady_clock::now() < spin_until) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(200));
    }
  }

  static constexpr int kToNext = 1;
  static constexpr int kToPrev = 2;
  const int rank_, n_;
  std::vector<MPI_Comm> comms_;
  std::atomic<bool> aborted_{false};
  bool blocking_ = false;
  std::mutex watch_mutex_;
  std::condition_variable watch_cv_;
  std::vector<Flight> flights_;  // guarded by watch_mutex_, one per channel
  bool stop_ = false;            // guarded by watch_mutex_
  std::thread watchdog_;
};

std::unique_ptr<comm::Backend> make_mpi_transport(const World& world, const CommunicatorOptions& options,
                                                  int channels) {
  return std::make_unique<MpiBackend>(world, options, channels);
}

const bool registered = [] {
  comm::register_cpu_transport(Transport::Mpi, &make_mpi_transport);
  return true;
}();

}  // namespace
}  // namespace flatshard::mpi
