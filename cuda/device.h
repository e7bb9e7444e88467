// What the CUDA transports share: CUDA errors as the scheduler's failures, a transport's
// health, CUDA events as the device halves of Events, and one high-priority stream per
// stream role. Internal to flatshard::cuda.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "flatshard/errors.h"
#include "src/comm/backend.h"

namespace flatshard::cuda {

using comm::Collective;
using comm::OpKind;
using comm::TransportFailure;

std::string cuda_string(cudaError_t e);
// Throws TransportFailure (Aborted) naming `what` unless `e` is cudaSuccess.
void check_cuda(cudaError_t e, const char* what);
// LibTorch's current stream on `device`.
cudaStream_t current_stream(int device);
// Refuses an op whose tensors are not on `device`.
void check_device_tensors(const Collective& op, int device);

// A transport's failure, shared with the events it hands out, so that a host that
// synchronizes on an op of an aborted transport gets the transport's error.
struct Health {
  Health(int rank = -1, int world_size = -1) : rank(rank), world_size(world_size) {}
  const int rank, world_size;  // for messages
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

  // Note [An op complete on the device is not yet a success]: NCCL may let an op's
  // kernels return after an asynchronous error (a peer lost), its output undefined, so
  // a waiter whose event has completed asks the transport to confirm before it trusts
  // the result. The NCCL transport installs the check and removes it before it goes;
  // confirm_mutex keeps it alive while a waiter runs it.
  void confirm(const std::string& op) {
    std::lock_guard<std::mutex> lock(confirm_mutex);
    if (confirm_check) confirm_check(op);
  }
  void set_confirm(std::function<void(const std::string& op)> check) {
    std::lock_guard<std::mutex> lock(confirm_mutex);
    confirm_check = std::move(check);
  }

 private:
  std::mutex confirm_mutex;  // taken before the transport's own lock, never after
  std::function<void(const std::string& op)> confirm_check;  // guarded by confirm_mutex
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
    if (health_ && e == cudaSuccess) health_->confirm(op_);
    if (health_) rethrow_as_comm_error();
    if (e != cudaSuccess && e != cudaErrorNotReady) {
      throw CommError(CommError::Kind::Aborted, -1, -1, "cuda", 0, -1,
                      fmt::format("flatshard: device work failed: {}", cuda_string(e)));
    }
  }

  void block(void* device_stream) const override {
    // A transport known to have failed is reported here: its aborted kernels return, and a
    // stream made to wait for one would go on with an output NCCL left undefined.
    if (health_) rethrow_as_comm_error();
    cudaStream_t s = device_stream ? static_cast<cudaStream_t>(device_stream) : current_stream(device_);
    const cudaError_t e = cudaStreamWaitEvent(s, event_, 0);
    if (e != cudaSuccess) {
      throw CommError(CommError::Kind::Aborted, -1, -1, "cuda", 0, -1,
                      fmt::format("flatshard: cudaStreamWaitEvent failed: {}", cuda_string(e)));
    }
  }

  cudaEvent_t get() const { return event_; }
  // The op this event ends ("all_reduce #2"), for errors found once it has completed.
  void set_op(std::string op) { op_ = std::move(op); }

 private:
  void rethrow_as_comm_error() const {
    std::lock_guard<std::mutex> lock(health_->mutex);
    if (health_->failure) {
      throw CommError(health_->failure->kind, health_->rank, health_->world_size, "nccl", 0, -1,
                      fmt::format("flatshard: the CUDA transport failed on rank {}/{}: {}", health_->rank,
                                  health_->world_size, health_->failure->what()));
    }
  }

  cudaEvent_t event_ = nullptr;
  int device_;
  std::shared_ptr<Health> health_;
  std::string op_;
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

// The transports (nccl_transport.cpp, host_staged_transport.cpp).
std::unique_ptr<comm::Backend> make_nccl_transport(const World& world, const CommunicatorOptions& options,
                                                   int channels);
std::unique_ptr<comm::Backend> make_host_staged_transport(const World& world,
                                                          const CommunicatorOptions& options, int channels);

}  // namespace flatshard::cuda
