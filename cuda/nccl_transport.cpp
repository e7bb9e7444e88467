// The NCCL transport: one NCCL communicator per stream role, each on its own
// high-priority CUDA stream, launched in one order per device (Note [One launch order per
// device]), with a watchdog that aborts NCCL at a deadline (Note [NCCL calls from several
// threads]).
#include <nccl.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "cuda/device.h"
#include "src/comm/in_flight.h"
#include "src/comm/launch_order.h"
#include "src/comm/per_device.h"
#include "src/errors.h"

namespace flatshard::cuda {
namespace {

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kDouble: return ncclFloat64;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    default: throw InvalidArgument(fmt::format("flatshard: dtype {} has no NCCL type", c10::toString(t)));
  }
}

class NcclTransport;

// Note [Aborting the communicators together]: the FlatShard NCCL transports of one device
// (a wrapper's, hybrid's replica groups', a user's own communicators) share one lock, which
// every NCCL call on their communicators holds, so that a failure can abort them all in one
// group call.
struct DeviceNccl {
  std::mutex mutex;
  std::vector<NcclTransport*> live;  // guarded by mutex: made, and not yet destroyed
};

class NcclTransport final : public comm::Backend {
 public:
  NcclTransport(const World& world, const CommunicatorOptions& options, int channels)
      : rank_(world.rank()),
        n_(world.world_size()),
        prefix_(comm::next_rendezvous_prefix(world, options.name)),
        options_(options),
        streams_(options.device.index() < 0 ? 0 : options.device.index(), channels),
        order_(comm::LaunchOrder::for_device(streams_.device())),
        health_(std::make_shared<Health>(world.rank(), world.world_size())),
        device_(comm::one_per_device<DeviceNccl>(streams_.device())),
        mutex_(device_.mutex) {
    const std::string& prefix = prefix_;
    const int device = streams_.device();
    barrier_buffer_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device));
    comms_.resize(static_cast<std::size_t>(channels), nullptr);
    try {
      for (int c = 0; c < channels; ++c) comms_[static_cast<std::size_t>(c)] = init_comm(world, prefix, c);
    } catch (...) {
      // The destructor does not run for a constructor that throws: the channels made so far
      // are aborted here, so that a caller that retries does not keep their threads and memory.
      abort_together(std::exchange(comms_, {}));
      throw;
    }
    health_->set_confirm([this](const std::string& op) { confirm(op); });
    watchdog_ = std::thread([this] { watch(); });
    std::lock_guard<std::mutex> lock(mutex_);
    device_.live.push_back(this);
  }

  ~NcclTransport() override {
    health_->set_confirm(nullptr);  // waits out a waiter confirming now
    {
      // Issued ops finish first; the watchdog still enforces their deadlines.
      std::unique_lock<std::mutex> lock(mutex_);
      while (!inflight_.empty() && !aborted_) cv_.wait_for(lock, std::chrono::milliseconds(5));
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    inflight_.clear();
    std::vector<ncclComm_t> mine;
    {
      // Out of the device's transports, and taken: no other transport's failure aborts them
      // while they are finalized, which may take up to the timeout, without the lock.
      std::lock_guard<std::mutex> lock(mutex_);
      device_.live.erase(std::remove(device_.live.begin(), device_.live.end(), this), device_.live.end());
      if (!aborted_) mine = std::exchange(comms_, {});
      aborted_ = true;
    }
    finalize_and_destroy(std::move(mine));
    comm::InFlightBuffers::instance().release_completed();
  }

  void issue(Collective& op) override {
    check_device_tensors(op, streams_.device());
    // NCCL's slots are equal: FullyShard and DDP pad their flat buffers so.
    const std::int64_t full = op.kind == OpKind::AllGather ? op.output.numel() : op.input.numel();
    if ((op.kind == OpKind::AllGather || op.kind == OpKind::ReduceScatter) && full % n_ != 0) {
      throw InvalidArgument(fmt::format(
          "flatshard: {} #{} on rank {}/{}: NCCL needs a buffer whose size divides by the world size, got {} "
          "elements; pad it (shard.h padded_numel) or use Transport::Tcp",
          comm::to_string(op.kind), op.seq, rank_, n_, full));
    }
    if (op.kind != OpKind::Barrier) nccl_type(op.input.scalar_type());  // refuse unsupported dtypes here
    const c10::cuda::CUDAGuard on_device(static_cast<c10::DeviceIndex>(streams_.device()));
    op.ready = std::make_shared<CudaEvent>(current_stream(streams_.device()), streams_.device(), nullptr);
    op.launch_ticket = order_.take();  // last: an op refused above takes no place in the order
  }

  std::shared_ptr<DeviceEvent> run(const Collective& op, int channel) override {
    // Note [One launch order per device]: this op launches after every op issued before
    // it on this GPU, by any communicator, and its turn ends once NCCL has taken it.
    const comm::LaunchTurn turn(order_, op.launch_ticket);
    if (!order_.wait_turn(op.launch_ticket, op.deadline, [this] { return health_->failed(); })) {
      health_->check();  // aborted while it waited: that failure
      const std::string why = "an op issued before it on this GPU was not launched before this op's deadline";
      fail(CommError::Kind::Timeout, fmt::format("{} #{}: {}", comm::to_string(op.kind), op.seq, why));
      throw TransportFailure(CommError::Kind::Timeout, -1, why);
    }
    health_->check();
    check_cuda(cudaSetDevice(streams_.device()), "cudaSetDevice");
    const cudaStream_t s = streams_[channel];
    streams_.wait_inputs(op, channel);
    ncclResult_t r = ncclSuccess;
    {
      std::lock_guard<std::mutex> lock(mutex_);  // Note [NCCL calls from several threads]
      r = launch_locked(op, channel, s);
    }
    settle(channel, r, op);
    if (op.kind == OpKind::NeighborExchange && n_ <= 2) {
      // One neighbour: its half twice. Copied once NCCL has taken the group (a non-blocking
      // communicator's ncclGroupEnd answers ncclInProgress until then, which settle waits out).
      const std::size_t bytes = op.input.nbytes();
      char* out = static_cast<char*>(op.output.data_ptr());
      check_cuda(cudaMemcpyAsync(out + bytes, out, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
    }
    auto done = std::make_shared<CudaEvent>(s, streams_.device(), health_);
    done->set_op(fmt::format("{} #{}", comm::to_string(op.kind), op.seq));
    comm::InFlightBuffers::instance().track(done, op);  // Note [Buffers a collective touches]
    {
      std::lock_guard<std::mutex> lock(mutex_);
      inflight_.push_back({done, comm::to_string(op.kind), op.seq, op.deadline});
    }
    cv_.notify_all();
    return done;
  }

  void abort() override { fail(CommError::Kind::Aborted, "aborted after a failure on another stream"); }

 private:
  // Hands `op` to NCCL on `channel`'s communicator and stream.
  ncclResult_t launch_locked(const Collective& op, int channel, cudaStream_t s) {
    if (aborted_) {
      health_->check();  // the failure that aborted it, when one is recorded
      throw TransportFailure(CommError::Kind::Aborted, -1, "the NCCL transport was aborted");
    }
    ncclComm_t comm = comms_.at(static_cast<std::size_t>(channel));
    const ncclRedOp_t red = op.reduce == ReduceOp::Avg ? ncclAvg : ncclSum;
    ncclResult_t r = ncclSuccess;
    switch (op.kind) {
      case OpKind::AllGather: {
        const std::int64_t slot = op.output.numel() / n_;
        // In place when the input is this rank's slot of the output.
        r = ncclAllGather(op.input.data_ptr(), op.output.data_ptr(), static_cast<std::size_t>(slot),
                          nccl_type(op.input.scalar_type()), comm, s);
        break;
      }
      case OpKind::ReduceScatter:
        r = ncclReduceScatter(op.input.data_ptr(), op.output.data_ptr(),
                              static_cast<std::size_t>(op.output.numel()), nccl_type(op.input.scalar_type()),
                              red, comm, s);
        break;
      case OpKind::AllReduce:
        r = ncclAllReduce(op.input.data_ptr(), op.output.data_ptr(),
                          static_cast<std::size_t>(op.input.numel()), nccl_type(op.input.scalar_type()), red,
                          comm, s);
        break;
      case OpKind::Broadcast:
        r = ncclBroadcast(op.input.data_ptr(), op.output.data_ptr(),
                          static_cast<std::size_t>(op.input.numel()), nccl_type(op.input.scalar_type()),
                          op.root, comm, s);
        break;
      case OpKind::NeighborExchange: {
        // Point-to-point in one group: to both neighbours, from both (once at world sizes 1
        // and 2, then the half is copied, as the CPU rings do).
        const auto count = static_cast<std::size_t>(op.input.numel());
        const ncclDataType_t type = nccl_type(op.input.scalar_type());
        const int next = (rank_ + 1) % n_, prev = (rank_ + n_ - 1) % n_;
        char* out = static_cast<char*>(op.output.data_ptr());
        const std::size_t bytes = op.input.nbytes();
        r = ncclGroupStart();
        if (r == ncclSuccess) r = ncclSend(op.input.data_ptr(), count, type, next, comm, s);
        if (r == ncclSuccess) r = ncclRecv(out, count, type, prev, comm, s);
        if (r == ncclSuccess && n_ > 2) r = ncclSend(op.input.data_ptr(), count, type, prev, comm, s);
        if (r == ncclSuccess && n_ > 2) r = ncclRecv(out + bytes, count, type, next, comm, s);
        const ncclResult_t ended = ncclGroupEnd();
        if (r == ncclSuccess) r = ended;
        break;
      }
      case OpKind::Barrier:
        r = ncclAllReduce(barrier_buffer_.data_ptr(), barrier_buffer_.data_ptr(), 1, ncclInt32, ncclSum, comm,
                          s);
        break;
    }
    return r;
  }

  struct InFlight {
    std::shared_ptr<CudaEvent> done;
    const char* op;
    std::uint64_t seq;
    std::chrono::steady_clock::time_point deadline;
  };

  ncclComm_t init_comm(const World& world, const std::string& prefix, int channel) {
    ncclUniqueId id;
    const std::string key = fmt::format("{}nccl/{}/unique_id", prefix, channel);
    if (n_ > 1 && !world.store)
      throw InvalidArgument(
          fmt::format("flatshard: NCCL in a world of {} ranks (rank {}) needs the world's store", n_, rank_));
    if (rank_ == 0) {
      nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId");
      if (n_ > 1) {
        const auto* b = reinterpret_cast<const std::uint8_t*>(&id);
        world.store->set(key, std::vector<std::uint8_t>(b, b + sizeof(id)));
      }
    } else {
      try {
        world.store->wait({key}, options_.timeout);
      } catch (const std::exception& e) {  // the store's own error: a timeout, a lost rank 0
        throw CommError(CommError::Kind::Timeout, rank_, n_, "nccl_init", 0, 0,
                        fmt::format("flatshard: NCCL init (rank {}/{}): rank 0's NCCL id did not arrive "
                                    "within {} s ({}): is rank 0 running, and making the same communicators?",
                                    rank_, n_, options_.timeout.count() / 1000.0, first_line(e.what())));
      }
      const auto bytes = world.store->get(key);
      if (bytes.size() != sizeof(id)) {
        throw RendezvousError(fmt::format(
            "flatshard: NCCL init (rank {}/{}): the NCCL id in the store has {} bytes, not {}: ranks built "
            "against different NCCLs?",
            rank_, n_, bytes.size(), sizeof(id)));
      }
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    // Non-blocking, so that a peer that never joins is bounded by the deadline.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    ncclResult_t r = ncclCommInitRankConfig(&comm, n_, id, rank_, &config);
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    while (r == ncclInProgress) {
      if (std::chrono::steady_clock::now() > deadline) {
        ncclCommAbort(comm);
        throw CommError(
            CommError::Kind::Timeout, rank_, n_, "nccl_init", 0, -1,
            fmt::format("flatshard: NCCL init (rank {}/{}) did not complete within {} s: is every "
                        "rank started, each on its own GPU?",
                        rank_, n_, options_.timeout.count() / 1000.0));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      ncclCommGetAsyncError(comm, &r);
    }
    if (r != ncclSuccess && comm != nullptr) ncclCommAbort(comm);
    nccl_ok(r, "ncclCommInitRankConfig");
    return comm;
  }

  void nccl_ok(ncclResult_t r, const char* what) const {
    if (r != ncclSuccess) {
      throw RendezvousError(fmt::format("flatshard: NCCL init (rank {}/{}): {} failed: {}", rank_, n_, what,
                                        ncclGetErrorString(r)));
    }
  }

  // A non-blocking communicator may return ncclInProgress: the call is complete only
  // once its asynchronous state is success (bounded by the op's deadline). Polled under
  // the lock one query at a time, so that the watchdog can abort in between.
  void settle(int channel, ncclResult_t r, const Collective& op) {
    const char* last_error = "";
    while (r == ncclInProgress) {
      if (std::chrono::steady_clock::now() > op.deadline) {
        const std::string why = "NCCL did not accept the op before its deadline";
        fail(CommError::Kind::Timeout, fmt::format("{} #{}: {}", comm::to_string(op.kind), op.seq, why));
        throw TransportFailure(CommError::Kind::Timeout, -1, why);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      health_->check();  // aborted meanwhile: that failure
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_) throw TransportFailure(CommError::Kind::Aborted, -1, "the NCCL transport was aborted");
      ncclCommGetAsyncError(comms_[static_cast<std::size_t>(channel)], &r);
    }
    if (r != ncclSuccess) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!aborted_) last_error = ncclGetLastError(comms_[static_cast<std::size_t>(channel)]);
      }
      const auto kind = r == ncclInvalidArgument || r == ncclInvalidUsage ? CommError::Kind::Mismatch
                                                                          : CommError::Kind::Aborted;
      throw TransportFailure(kind, -1, fmt::format("NCCL: {}: {}", ncclGetErrorString(r), last_error));
    }
  }

  // Note [NCCL calls from several threads]
  // NCCL's calls on a communicator are not thread-safe: one thread at a time may call
  // into it, and ncclCommAbort frees it, so a later or concurrent call from another
  // thread touches freed memory. Here three kinds of thread call into the communicators
  // (the role workers launching and settling ops, the watchdog polling for asynchronous
  // errors and aborting, and a Communicator aborting after another stream's failure):
  // every NCCL call on them is made holding mutex_ (the device's lock, which every transport
  // on the device shares: Note [Aborting the communicators together]), and none after
  // aborted_ is set, when they are aborted and forgotten. Calls that wait (a non-blocking op NCCL has not yet
  // taken) poll one query at a time under the lock, so an abort is never held up by them.
  // Teardown follows NCCL's rules for non-blocking communicators: ncclCommFinalize (which
  // flushes outstanding operations and may answer ncclInProgress), polled to success
  // within the timeout, then ncclCommDestroy; a communicator that fails or times out
  // finalizing, or was in error, is aborted instead. The destructor takes the communicators
  // out of the transport first: no other thread calls into them then.
  void finalize_and_destroy(std::vector<ncclComm_t> comms) {
    bool ok = true;
    for (auto c : comms) {
      if (c && ncclCommFinalize(c) != ncclSuccess) {
        ncclResult_t state = ncclSuccess;
        ncclCommGetAsyncError(c, &state);
        ok = ok && (state == ncclSuccess || state == ncclInProgress);
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (auto c : comms) {
      ncclResult_t state = ncclInProgress;
      while (ok && c && state == ncclInProgress) {
        ncclCommGetAsyncError(c, &state);
        if (state == ncclInProgress && std::chrono::steady_clock::now() > deadline) ok = false;
        if (state == ncclInProgress) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      ok = ok && (!c || state == ncclSuccess);
    }
    if (!ok) {
      abort_together(std::move(comms));
      return;
    }
    for (auto c : comms) {
      if (c) ncclCommDestroy(c);
    }
  }

  // Note [Aborting the communicators together]
  // Aborting one communicator frees its device memory, which waits for the device, and so
  // for the kernels of the device's other communicators, still spinning on the lost peer:
  // aborted one after another, the first abort can wait forever on the second's kernel.
  // NCCL (2.22 and later) aborts the communicators of one group call together. So a
  // failure aborts, in one group call, every communicator of every FlatShard NCCL transport
  // on the device, not only the failing transport's: hybrid sharding's shard group and
  // replica groups are two transports, and a peer lost to one is lost to the job. The
  // transports of a device share one lock (DeviceNccl): under it the failure marks every
  // one of them failed (their waiters and new ops fail at once, naming the first failure)
  // and takes their communicators, which no thread calls into once taken; the abort itself,
  // which may wait for the device, runs after the lock is let go, so that no launch, poll or
  // confirmation on the device waits for it.
  static void abort_together(std::vector<ncclComm_t> comms) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 22, 0)
    ncclGroupStart();
#endif
    for (auto c : comms) {
      if (c) ncclCommAbort(c);  // kernels waiting for a peer return; frees the communicator
    }
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 22, 0)
    ncclGroupEnd();
#endif
  }

  // Records the transport's first failure and aborts every communicator of the device.
  void fail(CommError::Kind kind, const std::string& why) {
    std::vector<ncclComm_t> dead;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      dead = fail_locked(kind, why);
    }
    abort_together(std::move(dead));
  }

  // Under mutex_: records the failure, marks every transport of the device failed and
  // returns their communicators, for the caller to abort once it has let go of the lock.
  [[nodiscard]] std::vector<ncclComm_t> fail_locked(CommError::Kind kind, const std::string& why) {
    health_->fail(kind, why);
    std::vector<ncclComm_t> dead;
    if (aborted_) return dead;
    std::vector<NcclTransport*> failing{this};
    for (NcclTransport* t : device_.live) {
      if (t != this && !t->aborted_) failing.push_back(t);
    }
    for (NcclTransport* t : failing) {
      t->aborted_ = true;
      for (auto& c : t->comms_) {
        if (c) dead.push_back(c);
        c = nullptr;
      }
      if (t == this) continue;
      t->health_->fail(CommError::Kind::Aborted,
                       fmt::format("aborted with the device's other NCCL communicators after '{}' failed: {}",
                                   options_.name, why));
      t->cv_.notify_all();
    }
    return dead;
  }

  // Retires finished ops, wherever they are in the queue (the streams finish out of issue
  // order); aborts NCCL when any op still running passes its deadline (ops may have
  // shorter deadlines than older ones still running on another stream) or NCCL reports an
  // asynchronous error (a peer lost).
  void watch() {
    cudaSetDevice(streams_.device());
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(20));
      std::vector<ncclComm_t> dead;
      const auto now = std::chrono::steady_clock::now();
      for (auto it = inflight_.begin(); it != inflight_.end() && dead.empty();) {
        const cudaError_t q = cudaEventQuery(it->done->get());
        if (q == cudaSuccess) {
          it = inflight_.erase(it);
          continue;
        }
        if (q != cudaErrorNotReady) {
          dead = fail_locked(CommError::Kind::Aborted,
                             fmt::format("{} #{}: CUDA error {}", it->op, it->seq, cuda_string(q)));
        } else if (now > it->deadline && !aborted_) {
          dead = fail_locked(
              CommError::Kind::Timeout,
              fmt::format("{} #{} did not complete within its deadline (a peer died, is stuck, or issued "
                          "other collectives); NCCL was aborted",
                          it->op, it->seq));
        }
        ++it;
      }
      if (dead.empty()) dead = check_async_locked();
      if (!dead.empty()) {  // Note [Aborting the communicators together]: without the lock
        lock.unlock();
        abort_together(std::move(dead));
        lock.lock();
      }
    }
  }

  // Health::confirm for a waiter whose op's event has completed (Note [An op complete on
  // the device is not yet a success]).
  void confirm(const std::string& op) {
    std::vector<ncclComm_t> dead;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      dead = check_async_locked(op, "its kernels returned after NCCL failed, its output undefined; ");
    }
    abort_together(std::move(dead));
  }

  // Fails the transport when NCCL reports an asynchronous error on any communicator,
  // naming `op`, or else the oldest op not yet complete (the one a peer failed to join).
  // Returns the communicators to abort (fail_locked).
  [[nodiscard]] std::vector<ncclComm_t> check_async_locked(const std::string& op = "",
                                                           const std::string& context = "") {
    if (aborted_) return {};  // the failure is recorded already
    for (auto c : comms_) {   // under mutex_: Note [NCCL calls from several threads]
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(c, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        const std::string name = !op.empty() ? op + ": "
                                 : inflight_.empty()
                                     ? std::string()
                                     : fmt::format("{} #{}: ", inflight_.front().op, inflight_.front().seq);
        return fail_locked(CommError::Kind::PeerLost,
                           fmt::format("{}{}NCCL error: {}: {}", name, context, ncclGetErrorString(async),
                                       ncclGetLastError(c)));
      }
    }
    return {};
  }

  int rank_, n_;
  // Taken before anything else is made (Note [Rendezvous keys per creation]): a creation
  // that fails later on one rank has still counted there as on the others, so that the
  // next communicator of this name meets under one key on every rank.
  std::string prefix_;
  CommunicatorOptions options_;
  RoleStreams streams_;
  comm::LaunchOrder& order_;  // this device's (Note [One launch order per device])
  std::shared_ptr<Health> health_;
  at::Tensor barrier_buffer_;
  DeviceNccl& device_;
  std::vector<ncclComm_t> comms_;  // guarded by mutex_ once the watchdog runs; null once aborted
  std::mutex& mutex_;              // the device's: every NCCL call on its communicators holds it
  std::condition_variable cv_;
  std::deque<InFlight> inflight_;  // guarded by mutex_
  bool aborted_ = false;           // guarded by mutex_
  bool stop_ = false;              // guarded by mutex_
  std::thread watchdog_;
};

}  // namespace

std::unique_ptr<comm::Backend> make_nccl_transport(const World& world, const CommunicatorOptions& options,
                                                   int channels) {
  return std::make_unique<NcclTransport>(world, options, channels);
}

}  // namespace flatshard::cuda
