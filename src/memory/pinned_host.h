// Note [Page-locked at its size]: host memory for the states CPU offload keeps on the
// host next to a GPU, page-locked at the size asked for.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>

#include <ATen/core/Tensor.h>

namespace flatshard::memory {

class PinnedHost {
 public:
  // Page-locks `bytes` of new host memory (null on failure, with `*error` set), and
  // releases it. flatshard::cuda registers cudaHostAlloc and cudaFreeHost.
  using Alloc = void* (*)(std::size_t bytes, const char** error);
  using Free = void (*)(void* ptr);
  static constexpr std::size_t kPageBytes = 4096;

  static PinnedHost& instance();
  // Null functions: none (then empty() throws).
  void set_functions(Alloc alloc, Free free);

  // A page-locked tensor of `numel` elements of `dtype`, on a block of its bytes rounded
  // up to a page, released when its last tensor dies. Throws flatshard::Error when no
  // device library registered how to lock memory, or when the host cannot lock it.
  at::Tensor empty(std::int64_t numel, at::ScalarType dtype);
  std::size_t live_bytes() const;

 private:
  mutable std::mutex mutex_;
  Alloc alloc_ = nullptr;       // guarded by mutex_
  Free free_ = nullptr;         // guarded by mutex_
  std::size_t live_bytes_ = 0;  // guarded by mutex_
};

}  // namespace flatshard::memory
