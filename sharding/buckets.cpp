#include "sharding/buckets.h"

namespace flatshard::sharding {

std::vector<std::vector<int>> assign_buckets(const std::vector<std::int64_t>& param_bytes,
                                             const std::vector<int>& order, std::int64_t first_cap_bytes,
                                             std::int64_t cap_bytes) {
  std::vector<std::vector<int>> buckets;
  std::int64_t filled = 0;  // bytes in the last bucket
  for (int index : order) {
    const std::int64_t limit = buckets.size() <= 1 ? first_cap_bytes : cap_bytes;
    if (buckets.empty() || (filled > 0 && filled + param_bytes[index] > limit)) {
      buckets.emplace_back();
      filled = 0;
    }
    buckets.back().push_back(index);
    filled += param_bytes[index];
  }
  return buckets;
}

}  // namespace flatshard::sharding
