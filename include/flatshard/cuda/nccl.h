// NCCL collectives on CUDA streams (built when the CUDA toolkit is found: target
// flatshard::cuda). The same contracts as flatshard::Communicator — shapes, dtypes,
// deadlines, typed errors naming rank, op and sequence number — for CUDA tensors:
//
//   auto nccl = flatshard::cuda::NcclCommunicator::create(world, {.timeout = 5min}, world.local_rank());
//   nccl->all_gather(full, shard, stream);          // enqueued on `stream`; returns at once
//   nccl->reduce_scatter(shard_grad, full_grad, flatshard::ReduceOp::Avg, stream);
//
// Bootstrap: rank 0 creates the NCCL unique id and publishes it through the world's
// store; every rank reads it and joins (ncclCommInitRank). Ops are enqueued on the
// caller's stream and never block the host. A watchdog thread records an event after
// each op and checks it against the op's deadline and NCCL's asynchronous error: on
// timeout or error it aborts the NCCL communicator (ncclCommAbort), so kernels stuck
// waiting for a dead peer return and no rank hangs forever; the next call then throws
// CommError{Timeout} or CommError{Aborted} carrying NCCL's error string.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "flatshard/communicator.h"
#include "flatshard/world.h"

namespace flatshard::cuda {

class NcclCommunicator {
 public:
  // A collective over the world's ranks on CUDA device `device` (one rank per GPU: NCCL
  // refuses two ranks on one device). A collective itself.
  static std::unique_ptr<NcclCommunicator> create(const World& world, const CommunicatorOptions& options,
                                                  int device);
  virtual ~NcclCommunicator() = default;

  // `stream` is a cudaStream_t. Tensors are contiguous CUDA tensors on `device`, with the
  // shapes flatshard::Communicator documents.
  virtual void all_gather(const at::Tensor& output, const at::Tensor& input, void* stream) = 0;
  virtual void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                              void* stream) = 0;
  virtual void all_reduce(const at::Tensor& tensor, ReduceOp op, void* stream) = 0;
  virtual void broadcast(const at::Tensor& tensor, int root, void* stream) = 0;

  // Throws the error the watchdog recorded, if any (ops throw it too).
  virtual void check() = 0;
  // Aborts NCCL: every op in flight returns, every later call throws CommError{Aborted}.
  virtual void abort(const std::string& reason) = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
};

// The CUDA caching allocator's figures for a device, in the shape of the CPU report:
// current and peak allocated bytes, reserved bytes, and allocation retries.
struct CudaMemoryStats {
  std::int64_t allocated_bytes = 0;
  std::int64_t peak_allocated_bytes = 0;
  std::int64_t reserved_bytes = 0;
  std::int64_t alloc_retries = 0;
};
CudaMemoryStats cuda_memory_stats(int device);
void reset_cuda_peak(int device);

}  // namespace flatshard::cuda
