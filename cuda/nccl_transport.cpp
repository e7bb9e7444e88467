// The NCCL transport: one NCCL communicator per stream role (so that ops issued
// concurrently by the roles' workers never interleave on one NCCL communicator), each on
// its own high-priority CUDA stream, with a watchdog that aborts NCCL at a deadline.
#include <nccl.h>

#include <condition_variable>
#include <cstring>
#include <deque>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "cuda/device.h"

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

class NcclTransport final : public comm::Backend {
 public:
  NcclTransport(const World& world, const CommunicatorOptions& options, int channels)
      : rank_(world.rank()),
        n_(world.world_size()),
        options_(options),
        streams_(options.device.index() < 0 ? 0 : options.device.index(), channels),
        health_(std::make_shared<Health>()) {
    const int device = streams_.device();
    barrier_buffer_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device));
    comms_.resize(static_cast<std::size_t>(channels), nullptr);
    for (int c = 0; c < channels; ++c) comms_[static_cast<std::size_t>(c)] = init_comm(world, c);
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclTransport() override {
    {
      // Issued ops finish first; the watchdog still enforces their deadlines.
      std::unique_lock<std::mutex> lock(mutex_);
      while (!inflight_.empty() && !aborted_) cv_.wait_for(lock, std::chrono::milliseconds(5));
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    inflight_.clear();
    if (!aborted_) {
      for (auto c : comms_) {
        if (c) ncclCommDestroy(c);
      }
    }
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
  }

  std::shared_ptr<DeviceEvent> run(const Collective& op, int channel) override {
    health_->check();
    check_cuda(cudaSetDevice(streams_.device()), "cudaSetDevice");
    const cudaStream_t s = streams_[channel];
    streams_.wait_inputs(op, channel);
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
    settle(comm, r, op);
    if (op.kind == OpKind::NeighborExchange && n_ <= 2) {
      // One neighbour: its half twice. Copied once NCCL has taken the group (a non-blocking
      // communicator's ncclGroupEnd answers ncclInProgress until then, which settle waits out).
      const std::size_t bytes = op.input.nbytes();
      char* out = static_cast<char*>(op.output.data_ptr());
      check_cuda(cudaMemcpyAsync(out + bytes, out, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
    }
    auto done = std::make_shared<CudaEvent>(s, streams_.device(), health_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      inflight_.push_back({done, comm::to_string(op.kind), op.seq, op.deadline});
    }
    cv_.notify_all();
    return done;
  }

  void abort() override {
    std::lock_guard<std::mutex> lock(mutex_);
    fail_locked(CommError::Kind::Aborted, "aborted after a failure on another stream");
  }

 private:
  struct InFlight {
    std::shared_ptr<CudaEvent> done;
    const char* op;
    std::uint64_t seq;
    std::chrono::steady_clock::time_point deadline;
  };

  ncclComm_t init_comm(const World& world, int channel) {
    ncclUniqueId id;
    const std::string key = fmt::format("flatshard/{}/nccl/{}/unique_id", options_.name, channel);
    if (rank_ == 0) {
      nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId");
      if (n_ > 1) {
        const auto* b = reinterpret_cast<const std::uint8_t*>(&id);
        world.store->set(key, std::vector<std::uint8_t>(b, b + sizeof(id)));
      }
    } else {
      if (!world.store)
        throw InvalidArgument("flatshard: NCCL in a multi-rank world needs the world's store");
      world.store->wait({key}, options_.timeout);
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
  // once its asynchronous state is success (bounded by the op's deadline).
  void settle(ncclComm_t comm, ncclResult_t r, const Collective& op) {
    while (r == ncclInProgress) {
      if (std::chrono::steady_clock::now() > op.deadline) {
        abort();
        throw TransportFailure(CommError::Kind::Timeout, -1,
                               "NCCL did not accept the op before its deadline");
      }
      std::this_thread::yield();
      ncclCommGetAsyncError(comm, &r);
    }
    if (r != ncclSuccess) {
      const auto kind = r == ncclInvalidArgument || r == ncclInvalidUsage ? CommError::Kind::Mismatch
                                                                          : CommError::Kind::Aborted;
      throw TransportFailure(kind, -1,
                             fmt::format("NCCL: {}: {}", ncclGetErrorString(r), ncclGetLastError(comm)));
    }
  }

  void fail_locked(CommError::Kind kind, const std::string& why) {
    health_->fail(kind, why);
    if (!aborted_) {
      aborted_ = true;
      for (auto c : comms_) {
        if (c) ncclCommAbort(c);  // kernels waiting for a peer return
      }
    }
  }

  // Retires finished ops in order; aborts NCCL when one passes its deadline or NCCL
  // reports an asynchronous error (a peer lost).
  void watch() {
    cudaSetDevice(streams_.device());
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(20));
      while (!inflight_.empty()) {
        auto& f = inflight_.front();
        const cudaError_t q = cudaEventQuery(f.done->get());
        if (q == cudaSuccess) {
          inflight_.pop_front();
          continue;
        }
        if (q != cudaErrorNotReady) {
          fail_locked(CommError::Kind::Aborted,
                      fmt::format("{} #{}: CUDA error {}", f.op, f.seq, cuda_string(q)));
        } else if (std::chrono::steady_clock::now() > f.deadline && !aborted_) {
          fail_locked(
              CommError::Kind::Timeout,
              fmt::format("{} #{} did not complete within its deadline (a peer died, is stuck, or issued "
                          "other collectives); NCCL was aborted",
                          f.op, f.seq));
        }
        break;
      }
      if (aborted_) continue;
      for (auto c : comms_) {
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(c, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          fail_locked(CommError::Kind::PeerLost,
                      fmt::format("NCCL error: {}: {}", ncclGetErrorString(async), ncclGetLastError(c)));
          break;
        }
      }
    }
  }

  int rank_, n_;
  CommunicatorOptions options_;
  RoleStreams streams_;
  std::shared_ptr<Health> health_;
  at::Tensor barrier_buffer_;
  std::vector<ncclComm_t> comms_;
  std::mutex mutex_;
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
