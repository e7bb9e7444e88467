// Gradient bucket assignment (pure logic, unit-tested).
#pragma once

#include <cstdint>
#include <vector>

namespace flatshard::sharding {

// Splits parameters, taken in `order` (indices into param_bytes), into consecutive
// buckets: the first holds up to first_cap_bytes, each later one up to cap_bytes. A
// parameter never splits; one larger than the cap gets a bucket of its own. Empty
// input gives no buckets.
std::vector<std::vector<int>> assign_buckets(const std::vector<std::int64_t>& param_bytes,
                                             const std::vector<int>& order, std::int64_t first_cap_bytes,
                                             std::int64_t cap_bytes);

}  // namespace flatshard::sharding
