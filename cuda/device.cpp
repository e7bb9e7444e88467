#include "cuda/device.h"

#include <c10/cuda/CUDAStream.h>

namespace flatshard::cuda {

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

void check_device_tensors(const Collective& op, int device) {
  for (const at::Tensor* t : {&op.input, &op.output}) {
    if (t->defined() && (!t->is_cuda() || t->get_device() != device)) {
      throw InvalidArgument(
          fmt::format("flatshard: {} #{}: tensor on {} but this communicator moves tensors of cuda:{}",
                      comm::to_string(op.kind), op.seq, t->device().str(), device));
    }
  }
}

}  // namespace flatshard::cuda
