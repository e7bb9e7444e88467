#include <gtest/gtest.h>

#include <numeric>

#include "sharding/buckets.h"

namespace {

using flatshard::sharding::assign_buckets;

TEST(AssignBuckets, FirstBucketSmallThenLargeAndOrderKept) {
  // Bytes of 6 parameters; taken in reverse order.
  const std::vector<std::int64_t> bytes = {100, 300, 200, 50, 400, 10};
  const std::vector<int> order = {5, 4, 3, 2, 1, 0};
  const auto b = assign_buckets(bytes, order, /*first=*/400, /*cap=*/600);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], (std::vector<int>{5}));        // 10 + 400 > 400: the first bucket closes
  EXPECT_EQ(b[1], (std::vector<int>{4, 3}));     // 400 + 50; + 200 > 600
  EXPECT_EQ(b[2], (std::vector<int>{2, 1, 0}));  // 200 + 300 + 100 = 600
}

TEST(AssignBuckets, OversizedParameterGetsItsOwnBucket) {
  const auto b = assign_buckets({10, 5000, 10}, {0, 1, 2}, 100, 100);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[1], (std::vector<int>{1}));
}

class BucketSweep : public ::testing::TestWithParam<std::tuple<int, std::int64_t>> {};

// Every parameter lands in exactly one bucket, in the given order, and no bucket with
// more than one parameter exceeds its cap.
TEST_P(BucketSweep, CoversEveryParameterOnceWithinCaps) {
  const auto [count, cap] = GetParam();
  std::vector<std::int64_t> bytes(count);
  for (int i = 0; i < count; ++i) bytes[i] = 1 + (i * 7919) % 97;
  std::vector<int> order(count);
  std::iota(order.rbegin(), order.rend(), 0);
  const auto buckets = assign_buckets(bytes, order, cap / 4 + 1, cap);
  std::vector<int> seen;
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    std::int64_t total = 0;
    for (int i : buckets[b]) total += bytes[i];
    if (buckets[b].size() > 1) EXPECT_LE(total, b == 0 ? cap / 4 + 1 : cap);
    EXPECT_FALSE(buckets[b].empty());
    seen.insert(seen.end(), buckets[b].begin(), buckets[b].end());
  }
  EXPECT_EQ(seen, order);
}

INSTANTIATE_TEST_SUITE_P(CountsAndCaps, BucketSweep,
                         ::testing::Combine(::testing::Values(0, 1, 2, 7, 64, 1000),
                                            ::testing::Values(std::int64_t{1}, std::int64_t{97},
                                                              std::int64_t{1000})));

}  // namespace
