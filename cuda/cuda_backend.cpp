// The CUDA half of the scheduler: CUDA events as the device halves of Events, and the
// two transports the Communicator uses for CUDA tensors (communicator.h):
//  - NCCL, one NCCL communicator per stream role (so that ops issued concurrently by
//    the roles' workers never interleave on one NCCL communicator), each on its own
//    high-priority CUDA stream, with a watchdog that aborts NCCL at a deadline;
//  - the TCP rings through pinned host memory, for several ranks on one GPU.
// Linking flatshard::cuda registers both, and the CUDA step kernels (optim/).
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "flatshard/errors.h"
#include "flatshard/memory.h"
#include "flatshard/shard.h"
#include "optim/step_kernels.h"
#include "src/comm/backend.h"

// Referenced by flatshard::cuda's link options (-u), so that a static link keeps this
// file, and with it the registrations below.
extern "C" {
int flatshard_cuda_link_anchor = 0;
}

namespace flatshard::cuda {
namespace {

using comm::Collective;
using comm::OpKind;
using comm::TransportFailure;

std::string cuda_string(cudaError_t e) {
  return fmt::format("{} ({})", cudaGetErrorName(e), cudaGetErrorString(e));
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw TransportFailure(CommError::Kind::Aborted, -1, fmt::format("{} failed: {}", what, cuda_string(e)));
  }
}

cudaStream_t current_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

// A transport's failure, shared with the events it hands out, so that a host that
// synchronizes on an op of an aborted transport gets the transport's error.
struct Health {
  std::mutex mutex;
  std::optional<TransportFailure> failure;  // guarded by mutex; the first one

  void fail(CommError::Kind kind, const std::string& detail) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!failure) failure.emplace(kind, -1, detail);
  }
  bool failed() {
    std::lock_guard<std::mutex> lock(mutex);
    return failure.has_value();
  }
  void check() {
    std::lock_guard<std::mutex> lock(mutex);
    if (failure) throw *failure;
  }
};

class CudaEvent final : public DeviceEvent {
 public:
  // Records a new event on `stream`.
  CudaEvent(cudaStream_t stream, int device, std::shared_ptr<Health> health)
      : device_(device), health_(std::move(health)) {
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
    const cudaError_t e = cudaEventRecord(event_, stream);
    if (e != cudaSuccess) {
      cudaEventDestroy(event_);
      check_cuda(e, "cudaEventRecord");
    }
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  bool query() const override { return cudaEventQuery(event_) != cudaErrorNotReady; }

  void synchronize() const override {
    // Polled, so that a transport aborted by its watchdog (whose kernels then return)
    // is reported with the transport's error rather than waited on.
    cudaError_t e;
    while ((e = cudaEventQuery(event_)) == cudaErrorNotReady) {
      if (health_ && health_->failed()) break;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (health_) rethrow_as_comm_error();
    if (e != cudaSuccess && e != cudaErrorNotReady) {
      throw CommError(CommError::Kind::Aborted, -1, -1, "cuda", 0, -1,
                      fmt::format("flatshard: device work failed: {}", cuda_string(e)));
    }
  }

  void block(void* device_stream) const override {
    cudaStream_t s = device_stream ? static_cast<cudaStream_t>(device_stream) : current_stream(device_);
    const cudaError_t e = cudaStreamWaitEvent(s, event_, 0);
    if (e != cudaSuccess) {
      throw CommError(CommError::Kind::Aborted, -1, -1, "cuda", 0, -1,
                      fmt::format("flatshard: cudaStreamWaitEvent failed: {}", cuda_string(e)));
    }
  }

  cudaEvent_t get() const { return event_; }

 private:
  void rethrow_as_comm_error() const {
    std::lock_guard<std::mutex> lock(health_->mutex);
    if (health_->failure) {
      throw CommError(health_->failure->kind, -1, -1, "nccl", 0, -1,
                      fmt::format("flatshard: the CUDA transport failed: {}", health_->failure->what()));
    }
  }

  cudaEvent_t event_ = nullptr;
  int device_;
  std::shared_ptr<Health> health_;
};

// The streams of a device transport: one high-priority non-blocking stream per role,
// so that collectives are scheduled ahead of compute kernels waiting for the SMs.
class RoleStreams {
 public:
  RoleStreams(int device, int n) : device_(device) {
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    int least = 0, greatest = 0;
    check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    streams_.resize(static_cast<std::size_t>(n));
    for (auto& s : streams_)
      check_cuda(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest), "cudaStreamCreate");
  }
  ~RoleStreams() {
    for (auto s : streams_) {
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    }
  }
  cudaStream_t operator[](int role) const { return streams_.at(static_cast<std::size_t>(role)); }
  int device() const { return device_; }

  // Makes `role`'s stream wait for what the op waits for: the issuing stream's work
  // (`ready`) and the ops it was told to follow.
  void wait_inputs(const Collective& op, int role) const {
    const cudaStream_t s = (*this)[role];
    if (op.ready) op.ready->block(s);
    for (const Event& e : op.after) {
      if (auto d = e.device()) d->block(s);
    }
  }

 private:
  int device_;
  std::vector<cudaStream_t> streams_;
};

void check_device_tensors(const Collective& op, int device) {
  for (const at::Tensor* t : {&op.input, &op.output}) {
    if (t->defined() && (!t->is_cuda() || t->get_device() != device)) {
      throw InvalidArgument(
          fmt::format("flatshard: {} #{}: tensor on {} but this communicator moves tensors of cuda:{}",
                      comm::to_string(op.kind), op.seq, t->device().str(), device));
    }
  }
}

// --- NCCL --------------------------------------------------------------------------

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
      case OpKind::Barrier:
        r = ncclAllReduce(barrier_buffer_.data_ptr(), barrier_buffer_.data_ptr(), 1, ncclInt32, ncclSum, comm,
                          s);
        break;
    }
    settle(comm, r, op);
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

// --- TCP rings through host memory ---------------------------------------------------

class HostStagedTransport final : public comm::Backend {
 public:
  HostStagedTransport(const World& world, const CommunicatorOptions& options, int channels)
      : streams_(options.device.index() < 0 ? 0 : options.device.index(), channels),
        rank_(world.rank()),
        n_(world.world_size()) {
    CommunicatorOptions host = options;
    host.device = c10::Device(c10::kCPU);
    rings_ = comm::make_tcp_ring_backend(world, host, channels);
  }

  void issue(Collective& op) override {
    check_device_tensors(op, streams_.device());
    const c10::cuda::CUDAGuard on_device(static_cast<c10::DeviceIndex>(streams_.device()));
    op.ready = std::make_shared<CudaEvent>(current_stream(streams_.device()), streams_.device(), nullptr);
  }

  // The worker waits for the inputs on the device, moves them to pinned host memory,
  // runs the ring, and copies the result back on the role's stream.
  std::shared_ptr<DeviceEvent> run(const Collective& op, int channel) override {
    check_cuda(cudaSetDevice(streams_.device()), "cudaSetDevice");
    const cudaStream_t s = streams_[channel];
    streams_.wait_inputs(op, channel);
    c10::cuda::CUDAStreamGuard guard(
        c10::cuda::getStreamFromExternal(s, static_cast<c10::DeviceIndex>(streams_.device())));
    Collective hop = op;
    if (op.kind != OpKind::Barrier) {
      const auto pinned = op.input.options().device(at::kCPU).pinned_memory(true);
      switch (op.kind) {
        case OpKind::AllGather: {
          hop.output = at::empty({op.output.numel()}, pinned);
          const ShardRange mine = shard_range(op.output.numel(), n_, rank_);
          hop.input = hop.output.narrow(0, mine.offset, mine.numel);
          hop.input.copy_(op.input.reshape({-1}), /*non_blocking=*/true);
          break;
        }
        case OpKind::ReduceScatter:
          hop.input = at::empty({op.input.numel()}, pinned);
          hop.input.copy_(op.input.reshape({-1}), true);
          hop.output = at::empty({op.output.numel()}, pinned);
          break;
        default:  // all_reduce, broadcast: in place
          hop.input = at::empty({op.input.numel()}, pinned);
          hop.input.copy_(op.input.reshape({-1}), true);
          hop.output = hop.input;
          break;
      }
      check_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    }
    rings_->run(hop, channel);
    if (op.kind != OpKind::Barrier) op.output.view({-1}).copy_(hop.output, /*non_blocking=*/true);
    return std::make_shared<CudaEvent>(s, streams_.device(), nullptr);
  }

  void abort() override { rings_->abort(); }

 private:
  RoleStreams streams_;
  int rank_, n_;
  std::unique_ptr<comm::Backend> rings_;
};

std::unique_ptr<comm::Backend> make_cuda_transport(const World& world, const CommunicatorOptions& options,
                                                   int channels) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    throw InvalidArgument(
        fmt::format("flatshard::Communicator::create (rank {}/{}): {} was asked for but no CUDA "
                    "device is visible (check CUDA_VISIBLE_DEVICES and the driver)",
                    world.rank(), world.world_size(), options.device.str()));
  }
  if (options.transport == Transport::Tcp)
    return std::make_unique<HostStagedTransport>(world, options, channels);
  return std::make_unique<NcclTransport>(world, options, channels);
}

// --- step kernels ----------------------------------------------------------------------

void* resolve(void* stream) {
  if (stream) return stream;
  return c10::cuda::getCurrentCUDAStream().stream();
}

void sgd(float* param, const float* grad, float* momentum, std::int64_t numel,
         const optim::kernels::SgdHyper& h, void* stream) {
  optim::kernels::cuda::sgd_step(param, grad, momentum, numel, h, resolve(stream));
}

void adam(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
          const optim::kernels::AdamHyper& h, void* stream) {
  optim::kernels::cuda::adam_step(param, grad, exp_avg, exp_avg_sq, numel, h, resolve(stream));
}

double sum_of_squares(const float* x, std::int64_t numel, void* stream) {
  return optim::kernels::cuda::sum_of_squares(x, numel, resolve(stream));
}

const optim::kernels::DeviceKernels kKernels{&sgd, &adam, &sum_of_squares};

const bool kRegistered = [] {
  comm::register_device_backend(c10::DeviceType::CUDA, &make_cuda_transport);
  optim::kernels::register_cuda_kernels(kKernels);
  memory::detail::set_cuda_total_bytes([](int device) -> std::int64_t {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    std::size_t free = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return static_cast<std::int64_t>(total);
  });
  return true;
}();

}  // namespace
}  // namespace flatshard::cuda

namespace flatshard::memory {

AllocatorStats cuda_allocator_stats(int device) {
  using c10::CachingDeviceAllocator::StatType;
  const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  const auto all = static_cast<std::size_t>(StatType::AGGREGATE);
  AllocatorStats out;
  out.installed = true;
  out.current_bytes = s.allocated_bytes[all].current;
  out.peak_bytes = s.allocated_bytes[all].peak;
  out.allocations = s.allocation[all].allocated;
  out.reserved_bytes = s.reserved_bytes[all].current;
  out.alloc_retries = s.num_alloc_retries;
  return out;
}

void reset_cuda_allocator_peak(int device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
}

}  // namespace flatshard::memory
