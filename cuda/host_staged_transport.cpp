// The TCP rings through pinned host memory, for CUDA tensors of several ranks on one GPU
// (which NCCL refuses): each op waits for its inputs on the device, crosses to the host,
// runs the ring and comes back on its role's stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/device.h"
#include "flatshard/shard.h"
#include "src/comm/in_flight.h"

namespace flatshard::cuda {
namespace {

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
        case OpKind::NeighborExchange:
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
    auto done = std::make_shared<CudaEvent>(s, streams_.device(), nullptr);
    comm::InFlightBuffers::instance().track(done, op);  // the copy back still writes op.output
    return done;
  }

  void abort() override { rings_->abort(); }

 private:
  RoleStreams streams_;
  int rank_, n_;
  std::unique_ptr<comm::Backend> rings_;
};

}  // namespace

std::unique_ptr<comm::Backend> make_host_staged_transport(const World& world,
                                                          const CommunicatorOptions& options, int channels) {
  return std::make_unique<HostStagedTransport>(world, options, channels);
}

}  // namespace flatshard::cuda
