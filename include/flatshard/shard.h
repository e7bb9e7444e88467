// Shard math: the one place that decides which part of a flat buffer a rank owns.
#pragma once

#include <cstdint>

namespace flatshard {

// A contiguous slice [offset, offset + numel) of a flat buffer, in elements.
struct ShardRange {
  std::int64_t offset = 0;
  std::int64_t numel = 0;
  std::int64_t end() const { return offset + numel; }
  bool operator==(const ShardRange& o) const { return offset == o.offset && numel == o.numel; }
};

// Balanced split of `numel` elements over `world_size` ranks: the first
// numel % world_size ranks get one element more. Every collective that takes a flat
// buffer of `numel` elements uses this to find each rank's slot.
ShardRange shard_range(std::int64_t numel, int world_size, int rank);

// `numel` rounded up so that it splits evenly over `world_size` ranks and each shard
// is a multiple of `align_numel` elements (the flat-parameter padding rule).
std::int64_t padded_numel(std::int64_t numel, int world_size, std::int64_t align_numel = 1);

}  // namespace flatshard
