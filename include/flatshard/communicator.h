// Collectives over the ranks of a World.
//
// Contracts shared by every op (the CPU backend and the CUDA backend alike):
//  - Order: on each stream, every rank issues the same collectives in the same order
//    with matching sizes and dtypes. Ops on different streams are independent and may
//    run concurrently. A rank that issues a different op is detected (the first
//    message of every step carries the op, its sequence number and its byte count)
//    and every rank gets CommError{Mismatch}.
//  - Asynchrony: every op returns at once with a Work. The tensors belong to the op
//    until Work::wait() returns (or its event completes): do not read the outputs or
//    write the inputs before then.
//  - Tensors: contiguous, on the communicator's device, same dtype for input and
//    output. Sizes are derived from the tensors; nothing else is passed.
//  - Devices: on the CPU each stream is a worker thread that runs the op (TCP rings).
//    On CUDA (link flatshard::cuda) the same path numbers, checks and logs the op, and
//    the stream's worker issues it to a high-priority CUDA stream of the communicator:
//    NCCL (Transport::Nccl, one rank per GPU), or the TCP rings through host memory
//    (Transport::Tcp: several ranks may share a GPU). The op waits on the device for
//    the work the issuing thread's current CUDA stream had queued when it was issued.
//    Work::wait() then makes the caller's current CUDA stream wait; the host does not.
//  - Slots: a flat buffer of N elements is split between ranks by shard_range(N,
//    world_size, rank) (shard.h), so sizes need not divide by the world size.
//  - Deadlines: every op has one (CommunicatorOptions::timeout, or the op's own).
//    A dead, stuck or missing peer makes the op fail with CommError on every
//    surviving rank within the deadline; after the first failure the communicator
//    is aborted and every later op fails at once (CommError{Aborted}).
//  - Sequence numbers: ops are numbered 1, 2, ... per communicator in the order the
//    host issues them; errors and logs name them ("all_gather #12").
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "flatshard/stream.h"
#include "flatshard/world.h"

namespace flatshard {

enum class ReduceOp { Sum, Avg };

// The streams a communicator owns. Each has its own connections, so ops on two
// streams run concurrently. By default an op runs on the stream named after it
// (broadcast and barrier on AllReduce).
enum class StreamRole { AllGather, ReduceScatter, AllReduce };
constexpr int kNumStreamRoles = 3;
const char* to_string(StreamRole role);

// How bytes move between ranks.
enum class Transport {
  Auto,  // the CPU: TCP rings (or FLATSHARD_TRANSPORT=tcp|mpi); CUDA: NCCL
  Tcp,   // TCP rings (CUDA tensors go through host memory)
  Nccl,  // NCCL (CUDA only; one rank per GPU)
  Mpi,   // MPI's collectives (CPU only; link flatshard::mpi; ranks started by mpirun or srun)
};

struct CommunicatorOptions {
  // Default deadline of every collective.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Store key prefix, so that several communicators can be made over one World.
  std::string name = "default";
  // The device whose tensors the collectives move (the CPU, or one CUDA device).
  c10::Device device{c10::kCPU};
  Transport transport = Transport::Auto;
  // CPU rings between ranks on one machine: the receiver copies each message straight
  // out of the sender's memory (Linux process_vm_readv), so the bytes are copied once
  // instead of through a socket. Each link checks at creation that it can; links that
  // cannot (other machines, a kernel that refuses) send through the socket. The
  // environment variable FLATSHARD_DIRECT_COPY=0 turns it off for every communicator.
  bool direct_copy = true;
};

struct CollectiveOptions {
  std::optional<StreamRole> stream;  // default: the op's own stream
  std::optional<std::chrono::milliseconds> timeout;
  std::vector<Event> wait_for;  // the op starts after these complete
};

namespace comm {
class Backend;
struct Collective;
class WaitClock;
}  // namespace comm

// Note [Communication wait]: how long the caller's compute stalled in Work::wait() for
// the ops of one communicator, while Communicator::time_waits is on. On the CPU that is
// the time the calling thread blocked; on CUDA the time the caller's current stream sat
// at the wait, measured by timing events recorded on that stream just before and just
// after it. Either way, the communication that compute did not hide.
//
// On a Linux CPU host, `core_ms` is the part of `ms` the waiting thread spent ready to run
// with no core to run on (the kernel's run delay, /proc/thread-self/schedstat, read
// around each wait): once the op completes, a thread whose cores are taken by other ranks
// waits for one, which is contention for the cores rather than communication. It is near
// 0 where ranks have cores to spare, and 0 on CUDA. PeerWait::op_ms() includes it.
struct CommunicationWait {
  double ms = 0;
  std::int64_t waits = 0;  // Work::wait() calls counted
  double core_ms = 0;      // of ms, waiting for a core (CPU, Linux)
  CommunicationWait& operator+=(const CommunicationWait& o) {
    ms += o.ms;
    waits += o.waits;
    core_ms += o.core_ms;
    return *this;
  }
};

// Note [Waiting for peers]: the timed waits of CommunicationWait split at the moment the
// last rank of the communicator issued the op waited for. Before it this rank waited for
// a slower peer to reach the op (ranks drifting apart between syncs, a straggler); after
// it, for the op itself: its bytes, and the ops queued ahead of it.
struct PeerWait {
  double ms = 0;       // every timed wait, as CommunicationWait::ms
  double peer_ms = 0;  // of ms, before the last rank had issued the op
  std::int64_t waits = 0;
  double op_ms() const { return ms - peer_ms; }
  PeerWait& operator+=(const PeerWait& o) {
    ms += o.ms;
    peer_ms += o.peer_ms;
    waits += o.waits;
    return *this;
  }
};

// The handle of one issued collective.
class Work {
 public:
  Work(Event event, std::uint64_t seq, std::shared_ptr<comm::WaitClock> clock = nullptr)
      : event_(std::move(event)), seq_(seq), clock_(std::move(clock)) {}
  // The caller waits for the op; rethrows its CommError. On the CPU the host blocks
  // until the op completes; on CUDA the caller's current stream waits for it (the host
  // waits only until it is issued).
  void wait() const;
  // Blocks the host until the op has completed, on the device too.
  void synchronize() const { event_.synchronize(); }
  bool is_completed() const { return event_.query(); }
  // For another stream to wait on (CollectiveOptions::wait_for).
  const Event& event() const { return event_; }
  std::uint64_t seq() const { return seq_; }

 private:
  Event event_;
  std::uint64_t seq_;
  std::shared_ptr<comm::WaitClock> clock_;  // its communicator's, while it times waits
};

class Communicator {
 public:
  // Connects to the other ranks of `world` (a collective call: every rank makes the
  // same communicator, in the same order). Throws RendezvousError on failure.
  static std::unique_ptr<Communicator> create(const World& world, const CommunicatorOptions& options = {});
  ~Communicator();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  c10::Device device() const { return options_.device; }
  // The default deadline of its collectives (CommunicatorOptions::timeout).
  std::chrono::milliseconds timeout() const { return options_.timeout; }
  Stream& stream(StreamRole role);

  // all_gather: output.numel() == N; input is this rank's slot of it
  // (input.numel() == shard_range(N, world_size, rank).numel). In place when `input`
  // is exactly that slot of `output` (same storage and offset): no copy is made.
  // After the op every rank holds every rank's slot in `output`.
  Work all_gather(const at::Tensor& output, const at::Tensor& input, const CollectiveOptions& options = {});

  // reduce_scatter: input.numel() == N; output.numel() == this rank's slot size.
  // output = reduction over ranks of input's slot of this rank (Avg divides by the
  // world size; floating dtypes only). `input` is not modified. `output` may be this
  // rank's slot of `input`. Moves (N - slot) elements per rank: a reduce-scatter's
  // bytes, not an all-reduce's.
  Work reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                      const CollectiveOptions& options = {});

  // all_reduce: in place on `tensor` (reduce-scatter then all-gather over a ring).
  Work all_reduce(const at::Tensor& tensor, ReduceOp op, const CollectiveOptions& options = {});

  // broadcast: in place; `root`'s `tensor` is copied to every rank's `tensor`.
  Work broadcast(const at::Tensor& tensor, int root, const CollectiveOptions& options = {});

  // neighbor_exchange: output.numel() == 2 * input.numel(); the first half of `output`
  // receives the previous rank's `input` (rank - 1, mod the world size), the second half
  // the next rank's (rank + 1). Each rank sends its input to both neighbours (once at
  // world size 2, where they are the same rank): the exchange of decentralized training,
  // whose cost does not grow with the world size. Runs on the AllGather stream.
  Work neighbor_exchange(const at::Tensor& output, const at::Tensor& input,
                         const CollectiveOptions& options = {});

  // barrier: completes on a rank once every rank has issued it.
  Work barrier(const CollectiveOptions& options = {});

  // Number of collectives issued so far (the last sequence number).
  std::uint64_t issued() const { return next_seq_ - 1; }
  // Bytes this rank has sent to other ranks in the ops issued so far (what the ring
  // algorithms send: docs/communicator.md), for measuring what a compression saves.
  std::uint64_t bytes_sent() const { return bytes_sent_; }
  // Whether every link this rank receives on copies directly from its sender's memory
  // (CommunicatorOptions::direct_copy). False at world size 1.
  bool copies_directly() const;

  // Note [Communication wait]. Off by default: on CUDA each timed wait records two timing
  // events. Ops issued while it is on are timed when waited for.
  void time_waits(bool on);
  // The waits timed since the last reset. On CUDA it blocks the host until the timed
  // waits have passed on the device: read it after the steps being measured.
  CommunicationWait waited();
  void reset_waited();
  // Note [Waiting for peers]: waited(), split into waiting for the last rank to issue each
  // op and waiting for the op, over the ops issued since the last reset_waited() while
  // waits were timed. A collective call: every rank of the communicator calls it at the
  // same point. CPU communicators whose ranks share one host's clock only; otherwise, or
  // where the ranks timed different ops, it throws InvalidArgument on every rank.
  PeerWait waited_for_peers();

 private:
  Communicator(int rank, int world_size, CommunicatorOptions options, std::unique_ptr<comm::Backend> backend);
  Work enqueue(comm::Collective collective, StreamRole default_role, const CollectiveOptions& options);

  int rank_;
  int world_size_;
  CommunicatorOptions options_;
  std::unique_ptr<comm::Backend> backend_;
  std::unique_ptr<Stream> streams_[kNumStreamRoles];
  std::uint64_t next_seq_ = 1;    // host-side only: ops are issued from one thread
  std::uint64_t bytes_sent_ = 0;  // likewise
  std::shared_ptr<comm::WaitClock> clock_;
  bool time_waits_ = false;  // host-side, like next_seq_
  std::uint64_t ring_bytes_sent(const comm::Collective& c, std::size_t bytes) const;
};

}  // namespace flatshard
