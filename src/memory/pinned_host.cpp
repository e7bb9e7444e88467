#include "src/memory/pinned_host.h"

#include <ATen/ops/from_blob.h>
#include <fmt/format.h>

#include <algorithm>

#include "flatshard/errors.h"

namespace flatshard::memory {

// Note [Page-locked at its size]
// Under CPU offload next to a GPU the fp32 master shards and their gradients live in
// page-locked host memory, so that their copies to and from the GPU run asynchronously.
// PyTorch's pinned allocator (the caching host allocator behind pin_memory) rounds every
// block up to a power of two: a unit whose master shard is 805 MB takes 1 GiB, and over a
// model the masters and gradients can take up to twice their bytes (a 5.5B-parameter
// model offloaded at world 1 holds 40 GiB of them, which take 54 GiB that way). These
// states do not come and go: a group allocates its master once and its gradient's block
// once, and reuses that block every step (FlatParamGroup::empty_master_grad: a sharded
// unit's reduced shard lands straight in it, a replicated bucket's average is copied
// into its slice of it; only a gradient added to an earlier one lands apart), so they
// need neither size classes nor a cache. Each is a block of exactly its bytes (rounded to
// a page), page-locked by the device library and released when its last tensor dies.
// Short-lived staging buffers (landings, checkpoint staging) stay with PyTorch's
// allocator, which tracks the copies in flight on them.
PinnedHost& PinnedHost::instance() {
  static PinnedHost* host = new PinnedHost();  // never destroyed: blocks may die at exit
  return *host;
}

void PinnedHost::set_functions(Alloc alloc, Free free) {
  std::lock_guard<std::mutex> lock(mutex_);
  alloc_ = alloc;
  free_ = free;
}

at::Tensor PinnedHost::empty(std::int64_t numel, at::ScalarType dtype) {
  const std::size_t need =
      static_cast<std::size_t>(std::max<std::int64_t>(0, numel)) * c10::elementSize(dtype);
  const std::size_t bytes = std::max(kPageBytes, (need + kPageBytes - 1) / kPageBytes * kPageBytes);
  void* ptr = nullptr;
  Free free = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (alloc_ == nullptr || free_ == nullptr) {
      throw Error(
          "flatshard: page-locked host memory was asked for, but no device library registered how to "
          "lock it; link flatshard::cuda");
    }
    const char* error = "no reason given";
    ptr = alloc_(bytes, &error);
    if (ptr == nullptr) {
      throw Error(fmt::format(
          "flatshard: locking {:.1f} MiB of host memory for CPU offload failed ({}), with {:.1f} MiB "
          "locked already. The host cannot hold the offloaded states: use more ranks (each holds only its "
          "shard), give the job more memory (or a higher locked-memory limit, ulimit -l), or turn "
          "cpu_offload off",
          bytes / 1048576.0, error, live_bytes_ / 1048576.0));
    }
    live_bytes_ += bytes;
    free = free_;
  }
  return at::from_blob(
      ptr, {numel},
      [this, bytes, free](void* p) {
        free(p);
        std::lock_guard<std::mutex> lock(mutex_);
        live_bytes_ -= bytes;
      },
      at::TensorOptions().dtype(dtype).device(c10::kCPU));
}

std::size_t PinnedHost::live_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_bytes_;
}

}  // namespace flatshard::memory
