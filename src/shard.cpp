#include "flatshard/shard.h"

#include "src/errors.h"

namespace flatshard {

ShardRange shard_range(std::int64_t numel, int world_size, int rank) {
  FLATSHARD_ASSERT(numel >= 0 && world_size > 0 && rank >= 0 && rank < world_size,
                   "shard_range arguments out of range");
  const std::int64_t base = numel / world_size;
  const std::int64_t extra = numel % world_size;
  const std::int64_t r = rank;
  return ShardRange{r * base + (r < extra ? r : extra), base + (r < extra ? 1 : 0)};
}

std::int64_t padded_numel(std::int64_t numel, int world_size, std::int64_t align_numel) {
  FLATSHARD_ASSERT(numel >= 0 && world_size > 0 && align_numel > 0, "padded_numel arguments out of range");
  const std::int64_t unit = static_cast<std::int64_t>(world_size) * align_numel;
  return (numel + unit - 1) / unit * unit;
}

}  // namespace flatshard
