// NCCL on the caller's CUDA streams, with a watchdog that enforces deadlines by aborting
// the NCCL communicator (include/flatshard/cuda/nccl.h).
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "flatshard/cuda/nccl.h"
#include "flatshard/errors.h"
#include "flatshard/shard.h"

namespace flatshard::cuda {
namespace {

std::string cuda_string(cudaError_t e) {
  return fmt::format("{} ({})", cudaGetErrorName(e), cudaGetErrorString(e));
}

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
    default:
      throw InvalidArgument(
          fmt::format("flatshard::cuda::NcclCommunicator: dtype {} has no NCCL type", c10::toString(t)));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Avg ? ncclAvg : ncclSum; }

class Nccl final : public NcclCommunicator {
 public:
  Nccl(const World& world, const CommunicatorOptions& options, int device)
      : rank_(world.rank()), n_(world.world_size()), device_(device), options_(options) {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice", 0);
    ncclUniqueId id;
    const std::string key = fmt::format("flatshard/nccl/{}/unique_id", options_.name);
    if (rank_ == 0) {
      check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId", 0);
      if (world.store) {
        const auto* b = reinterpret_cast<const std::uint8_t*>(&id);
        world.store->set(key, std::vector<std::uint8_t>(b, b + sizeof(id)));
      }
    } else {
      if (!world.store)
        throw InvalidArgument("flatshard::cuda::NcclCommunicator: a multi-rank world needs a store");
      world.store->wait({key}, options_.timeout);
      const auto bytes = world.store->get(key);
      if (bytes.size() != sizeof(id)) {
        throw RendezvousError(
            fmt::format("flatshard::cuda::NcclCommunicator (rank {}/{}): the NCCL id in the store "
                        "has {} bytes, not {}: ranks built against different NCCLs?",
                        rank_, n_, bytes.size(), sizeof(id)));
      }
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    // Non-blocking init, so that the watchdog's deadline also covers a peer that never joins.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm_, n_, id, rank_, &config);
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    while (r == ncclInProgress) {
      if (std::chrono::steady_clock::now() > deadline) {
        ncclCommAbort(comm_);
        throw CommError(
            CommError::Kind::Timeout, rank_, n_, "nccl_init", 0, -1,
            fmt::format("flatshard::cuda::NcclCommunicator (rank {}/{}): NCCL init did not complete "
                        "within {} s: is every rank started, on its own GPU?",
                        rank_, n_, options_.timeout.count() / 1000.0));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      ncclCommGetAsyncError(comm_, &r);
    }
    check_nccl(r, "ncclCommInitRank", 0);
    watchdog_ = std::thread([this] { watch(); });
  }

  ~Nccl() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    for (auto& f : inflight_) cudaEventDestroy(f.done);
    if (comm_ && !aborted_) ncclCommDestroy(comm_);
  }

  void all_gather(const at::Tensor& output, const at::Tensor& input, void* stream) override {
    check_tensor(output, "all_gather");
    check_tensor(input, "all_gather");
    if (input.numel() * n_ != output.numel() || input.scalar_type() != output.scalar_type()) {
      throw invalid("all_gather",
                    fmt::format("output has {} elements, input {}: output must be world_size x input",
                                output.numel(), input.numel()));
    }
    enqueue("all_gather", stream, [&](cudaStream_t s) {
      return ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(), nccl_type(input.scalar_type()),
                           comm_, s);
    });
  }

  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, void* stream) override {
    check_tensor(output, "reduce_scatter");
    check_tensor(input, "reduce_scatter");
    if (output.numel() * n_ != input.numel() || input.scalar_type() != output.scalar_type()) {
      throw invalid("reduce_scatter",
                    fmt::format("input has {} elements, output {}: input must be world_size x "
                                "output",
                                input.numel(), output.numel()));
    }
    enqueue("reduce_scatter", stream, [&](cudaStream_t s) {
      return ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(),
                               nccl_type(input.scalar_type()), nccl_op(op), comm_, s);
    });
  }

  void all_reduce(const at::Tensor& tensor, ReduceOp op, void* stream) override {
    check_tensor(tensor, "all_reduce");
    enqueue("all_reduce", stream, [&](cudaStream_t s) {
      return ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                           nccl_type(tensor.scalar_type()), nccl_op(op), comm_, s);
    });
  }

  void broadcast(const at::Tensor& tensor, int root, void* stream) override {
    check_tensor(tensor, "broadcast");
    if (root < 0 || root >= n_) throw invalid("broadcast", fmt::format("root {} is not a rank", root));
    enqueue("broadcast", stream, [&](cudaStream_t s) {
      return ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                           nccl_type(tensor.scalar_type()), root, comm_, s);
    });
  }

  void check() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_) throw *error_;
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(mu_);
    fail_locked(CommError::Kind::Aborted, "abort", seq_, reason);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return n_; }

 private:
  struct InFlight {
    cudaEvent_t done;
    std::string op;
    std::uint64_t seq;
    std::chrono::steady_clock::time_point deadline;
  };

  InvalidArgument invalid(const char* op, const std::string& what) const {
    return InvalidArgument(fmt::format("flatshard::cuda::NcclCommunicator (rank {}/{}) {} #{}: {}", rank_, n_,
                                       op, seq_ + 1, what));
  }

  void check_tensor(const at::Tensor& t, const char* op) const {
    if (!t.defined() || !t.is_cuda() || t.get_device() != device_ || !t.is_contiguous()) {
      throw invalid(op, fmt::format("tensors must be contiguous CUDA tensors on device {} (got {})", device_,
                                    t.defined() ? t.device().str() : "undefined"));
    }
  }

  void check_cuda(cudaError_t e, const char* what, std::uint64_t seq) const {
    if (e != cudaSuccess) {
      throw CommError(CommError::Kind::Aborted, rank_, n_, what, seq, -1,
                      fmt::format("flatshard::cuda::NcclCommunicator (rank {}/{}): {} failed: {}", rank_, n_,
                                  what, cuda_string(e)));
    }
  }

  void check_nccl(ncclResult_t r, const char* what, std::uint64_t seq) const {
    if (r != ncclSuccess && r != ncclInProgress) {
      throw CommError(r == ncclInvalidArgument || r == ncclInvalidUsage ? CommError::Kind::Mismatch
                                                                        : CommError::Kind::Aborted,
                      rank_, n_, what, seq, -1,
                      fmt::format("flatshard::cuda::NcclCommunicator (rank {}/{}) {} #{}: {}: {}", rank_, n_,
                                  what, seq, ncclGetErrorString(r), ncclGetLastError(comm_)));
    }
  }

  template <typename Launch>
  void enqueue(const char* op, void* stream, Launch&& launch) {
    check();
    const std::uint64_t seq = ++seq_;
    auto s = static_cast<cudaStream_t>(stream);
    check_cuda(cudaSetDevice(device_), "cudaSetDevice", seq);
    check_nccl(launch(s), op, seq);
    InFlight f{nullptr, op, seq, std::chrono::steady_clock::now() + options_.timeout};
    check_cuda(cudaEventCreateWithFlags(&f.done, cudaEventDisableTiming), "cudaEventCreate", seq);
    check_cuda(cudaEventRecord(f.done, s), "cudaEventRecord", seq);
    {
      std::lock_guard<std::mutex> lock(mu_);
      inflight_.push_back(std::move(f));
    }
    cv_.notify_all();
  }

  void fail_locked(CommError::Kind kind, const std::string& op, std::uint64_t seq, const std::string& why) {
    if (!error_) {
      error_.emplace(
          kind, rank_, n_, op, seq, -1,
          fmt::format("flatshard::cuda::NcclCommunicator (rank {}/{}) {} #{}: {}", rank_, n_, op, seq, why));
    }
    if (!aborted_) {
      aborted_ = true;
      ncclCommAbort(comm_);  // kernels waiting for a peer return; the communicator is gone
    }
  }

  // Retires finished ops; aborts on a deadline passed or an asynchronous NCCL error.
  void watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(20));
      while (!inflight_.empty()) {
        auto& f = inflight_.front();
        const cudaError_t q = cudaEventQuery(f.done);
        if (q == cudaSuccess) {
          cudaEventDestroy(f.done);
          inflight_.pop_front();
          continue;
        }
        if (q != cudaErrorNotReady) {
          fail_locked(CommError::Kind::Aborted, f.op, f.seq, "CUDA error: " + cuda_string(q));
        } else if (std::chrono::steady_clock::now() > f.deadline && !aborted_) {
          fail_locked(CommError::Kind::Timeout, f.op, f.seq,
                      fmt::format("did not complete within {} s (a peer died or issued other collectives); "
                                  "NCCL was aborted",
                                  options_.timeout.count() / 1000.0));
        }
        break;
      }
      if (!aborted_ && comm_) {
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(comm_, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          fail_locked(CommError::Kind::Aborted, inflight_.empty() ? "nccl" : inflight_.front().op,
                      inflight_.empty() ? seq_ : inflight_.front().seq,
                      fmt::format("NCCL error: {}: {}", ncclGetErrorString(async), ncclGetLastError(comm_)));
        }
      }
    }
  }

  int rank_, n_, device_;
  CommunicatorOptions options_;
  ncclComm_t comm_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<InFlight> inflight_;
  std::optional<CommError> error_;
  bool aborted_ = false;
  bool stop_ = false;
  std::uint64_t seq_ = 0;
  std::thread watchdog_;
};

}  // namespace

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(const World& world,
                                                           const CommunicatorOptions& options, int device) {
  return std::make_unique<Nccl>(world, options, device);
}

CudaMemoryStats cuda_memory_stats(int device) {
  using c10::CachingDeviceAllocator::StatType;
  const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  const auto all = static_cast<std::size_t>(StatType::AGGREGATE);
  CudaMemoryStats out;
  out.allocated_bytes = s.allocated_bytes[all].current;
  out.peak_allocated_bytes = s.allocated_bytes[all].peak;
  out.reserved_bytes = s.reserved_bytes[all].current;
  out.alloc_retries = s.num_alloc_retries;
  return out;
}

void reset_cuda_peak(int device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
}

}  // namespace flatshard::cuda
