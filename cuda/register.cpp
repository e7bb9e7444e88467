// Linking flatshard::cuda registers what the device-neutral scheduler and optimizers
// use for CUDA tensors: the transports (NCCL, or the TCP rings through host memory), the
// step kernels (optim/), and the CUDA allocator's figures (memory.h).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/device.h"
#include "cuda/scratch.h"
#include "flatshard/memory.h"
#include "optim/step_kernels.h"
#include "src/memory/pinned_host.h"

// Referenced by flatshard::cuda's link options (-u), so that a static link keeps this
// file, and with it the registrations below.
extern "C" {
int flatshard_cuda_link_anchor = 0;
}

namespace flatshard::cuda {
namespace {

std::unique_ptr<comm::Backend> make_cuda_transport(const World& world, const CommunicatorOptions& options,
                                                   int channels) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    throw InvalidArgument(
        fmt::format("flatshard::Communicator::create (rank {}/{}): {} was asked for but no CUDA "
                    "device is visible (check CUDA_VISIBLE_DEVICES and the driver)",
                    world.rank(), world.world_size(), options.device.str()));
  }
  if (options.transport == Transport::Tcp) return make_host_staged_transport(world, options, channels);
  return make_nccl_transport(world, options, channels);
}

// --- step kernels ----------------------------------------------------------------------

void* resolve(void* stream) {
  if (stream) return stream;
  return c10::cuda::getCurrentCUDAStream().stream();
}

// The device that holds `ptr`: the step kernels run there, whatever device is current on
// the calling thread (a rank that never called cudaSetDevice on a host of several GPUs
// has device 0 current), as an ATen op runs on its tensors' device.
c10::DeviceIndex device_of(const void* ptr) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess || a.type != cudaMemoryTypeDevice) {
    cudaGetLastError();  // not device memory: the current device, as before
    return c10::cuda::current_device();
  }
  return static_cast<c10::DeviceIndex>(a.device);
}

void sgd(float* param, const float* grad, float* momentum, std::int64_t numel,
         const optim::kernels::SgdHyper& h, void* stream) {
  const c10::cuda::CUDAGuard guard(device_of(param));
  optim::kernels::cuda::sgd_step(param, grad, momentum, numel, h, resolve(stream));
}

void adam(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::int64_t numel,
          const optim::kernels::AdamHyper& h, void* stream) {
  const c10::cuda::CUDAGuard guard(device_of(param));
  optim::kernels::cuda::adam_step(param, grad, exp_avg, exp_avg_sq, numel, h, resolve(stream));
}

double sum_of_squares(const float* x, std::int64_t numel, void* stream) {
  const c10::cuda::CUDAGuard guard(device_of(x));
  return optim::kernels::cuda::sum_of_squares(x, numel, resolve(stream));
}

const optim::kernels::DeviceKernels kKernels{&sgd, &adam, &sum_of_squares};

void* scratch_allocate(std::size_t bytes, void* stream) {
  return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, static_cast<cudaStream_t>(stream));
}
void scratch_release(void* ptr) { c10::cuda::CUDACachingAllocator::raw_delete(ptr); }

// Note [Page-locked at its size]
void* lock_host_memory(std::size_t bytes, const char** error) {
  void* ptr = nullptr;
  const cudaError_t e = cudaHostAlloc(&ptr, bytes, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    *error = cudaGetErrorString(e);
    cudaGetLastError();  // clears it: the failure is reported by the caller, not by later calls
    return nullptr;
  }
  return ptr;
}

// cudaFreeHost waits for the device work in flight, so that no copy is left reading or
// writing the block.
void unlock_host_memory(void* ptr) { cudaFreeHost(ptr); }

const bool kRegistered = [] {
  memory::PinnedHost::instance().set_functions(&lock_host_memory, &unlock_host_memory);
  comm::register_device_backend(c10::DeviceType::CUDA, &make_cuda_transport);
  optim::kernels::register_cuda_kernels(kKernels);
  optim::kernels::cuda::set_scratch_functions({&scratch_allocate, &scratch_release});
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
