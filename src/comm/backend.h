// The seam between the Communicator (one path for every op: validation, numbering,
// logging, errors) and a transport that moves the bytes (TCP rings on the CPU; NCCL
// on CUDA).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include <ATen/core/Tensor.h>

#include "flatshard/communicator.h"
#include "flatshard/errors.h"

namespace flatshard::comm {

enum class OpKind : std::uint8_t {
  AllGather = 1,
  ReduceScatter,
  AllReduce,
  Broadcast,
  Barrier,
  NeighborExchange
};
const char* to_string(OpKind kind);

// One validated collective, as the transport sees it.
struct Collective {
  OpKind kind = OpKind::Barrier;
  std::uint64_t seq = 0;  // the communicator's number for this op (for messages)
  at::Tensor input;       // all_gather: this rank's slot; reduce_scatter: the full buffer
  at::Tensor output;      // all_gather: the full buffer; reduce_scatter: this rank's slot;
                          // all_reduce and broadcast: the tensor (input is the same);
                          // neighbor_exchange: the previous rank's input, then the next's
  ReduceOp reduce = ReduceOp::Sum;
  int root = 0;
  std::chrono::steady_clock::time_point deadline;
  // Device transports: what the op waits for on the device before it starts. `ready`
  // is recorded by Backend::issue on the issuing thread; `after` are the op's
  // CollectiveOptions::wait_for events (their host halves are complete when run starts).
  std::shared_ptr<DeviceEvent> ready;
  std::vector<Event> after;
  // NCCL: the op's place in its device's launch order (Note [One launch order per
  // device]), taken by Backend::issue.
  std::uint64_t launch_ticket = 0;
};

// What a transport throws when an op fails after it started; the Communicator turns
// it into a CommError that names the op.
struct TransportFailure : std::runtime_error {
  TransportFailure(CommError::Kind kind, int peer, const std::string& detail)
      : std::runtime_error(detail), kind(kind), peer(peer) {}
  CommError::Kind kind;
  int peer;  // the rank whose connection failed or was waited for; -1 if unknown
};

class Backend {
 public:
  virtual ~Backend() = default;
  // On the issuing thread, when the op is enqueued: a device transport records in
  // `op.ready` what the op must wait for (the current stream's work so far).
  virtual void issue(Collective& /*op*/) {}
  // On the calling thread (a stream's worker), over the connections of `channel` (one
  // per stream): runs `op` to completion (the CPU; returns null) or issues it to the
  // channel's device stream and returns the event recorded after it. Throws
  // TransportFailure.
  virtual std::shared_ptr<DeviceEvent> run(const Collective& op, int channel) = 0;
  // Makes every op in progress on any channel, and every later op, fail at once.
  // Safe to call from any thread.
  virtual void abort() = 0;
  // Whether every incoming link copies straight from the sender (CPU rings on one machine).
  virtual bool copies_directly() const { return false; }
};

// Note [Rendezvous keys per creation]
// A transport publishes what its peers need to join it (ring addresses, NCCL's unique
// id) in the world's store, and the store outlives it: a key named after the
// communicator alone would hand the second communicator of that name (a model wrapped
// again, after loading a checkpoint say) the first one's stale address or id, and it
// would join the wrong communicator or wait out its deadline. Communicators of a world are
// created collectively, in the same order on each of its ranks, so the n-th creation of a
// name on a world is the n-th on every rank of it: its keys live under
// "flatshard/comm/NAME/n/", the same on every rank and never reused. Each rank counts its
// creations in the world's own store (a subworld's is under its own prefix), so that
// communicators of one name made on a subworld by some ranks do not shift the count of
// the whole world's on those ranks, and a store kept across restarts keeps counting. Each
// call counts one creation.
std::string next_rendezvous_prefix(const World& world, const std::string& name);

// What `op` does on a world of one rank, where nothing crosses: all-gather and
// reduce-scatter copy when input and output differ, neighbour exchange copies the input
// into both halves, the rest leave the tensor as it is.
void run_on_one_rank(const Collective& op);

// The CPU transport: `num_channels` independent rings of TCP connections.
std::unique_ptr<Backend> make_tcp_ring_backend(const World& world, const CommunicatorOptions& options,
                                               int num_channels);

// Transports for devices, registered by the library that implements them (flatshard::cuda
// registers CUDA's when it is linked). A factory makes the transport for `options.device`.
using BackendFactory = std::unique_ptr<Backend> (*)(const World& world, const CommunicatorOptions& options,
                                                    int num_channels);
void register_device_backend(c10::DeviceType type, BackendFactory factory);
BackendFactory device_backend(c10::DeviceType type);

// Transports for the CPU beside the TCP rings, registered likewise (flatshard::mpi
// registers Transport::Mpi's when it is linked).
void register_cpu_transport(Transport transport, BackendFactory factory);
BackendFactory cpu_transport(Transport transport);

}  // namespace flatshard::comm
