// The allocator's view of memory, beside the engine's own byte counts.
//
// On the CPU, install_counting_allocator() wraps LibTorch's CPU allocator (through
// c10::SetCPUAllocator) so that every tensor allocation is counted: current and peak
// live bytes for the whole process. Install it before creating the model, so that
// everything allocated later is counted; tensors allocated earlier are freed by their
// original allocator and never counted. On CUDA the same figures come from the caching
// allocator's statistics (cuda_allocator_stats; link flatshard::cuda), with the bytes it
// reserves from the driver and its allocation retries besides.
#pragma once

#include <cstdint>

namespace flatshard::memory {

struct AllocatorStats {
  bool installed = false;
  std::int64_t current_bytes = 0;   // live bytes allocated through the counting allocator
  std::int64_t peak_bytes = 0;      // the most live at once since install or the last reset
  std::int64_t allocations = 0;     // calls since install
  std::int64_t reserved_bytes = 0;  // CUDA: bytes the caching allocator holds (cached included)
  std::int64_t alloc_retries = 0;   // CUDA: allocations that had to free the cache and retry
};

// Idempotent; thread-safe.
void install_counting_allocator();
AllocatorStats allocator_stats();
// Peak := current.
void reset_allocator_peak();

// The CUDA caching allocator's figures for `device` (defined by flatshard::cuda).
AllocatorStats cuda_allocator_stats(int device);
void reset_cuda_allocator_peak(int device);

// Total memory of CUDA device `device`, in bytes; 0 when flatshard::cuda is not linked.
std::int64_t cuda_total_bytes(int device);
namespace detail {
void set_cuda_total_bytes(std::int64_t (*query)(int device));  // flatshard::cuda registers it
}

}  // namespace flatshard::memory
