#include <gtest/gtest.h>

#include "flatshard/shard.h"

namespace {

using flatshard::padded_numel;
using flatshard::shard_range;

class ShardSweep : public ::testing::TestWithParam<std::tuple<std::int64_t, int>> {};

// Slots tile [0, numel) in rank order, and differ in size by at most one element.
TEST_P(ShardSweep, RangesTileTheBufferAndAreBalanced) {
  const auto [numel, world] = GetParam();
  std::int64_t next = 0, smallest = numel, largest = 0;
  for (int r = 0; r < world; ++r) {
    const auto s = shard_range(numel, world, r);
    EXPECT_EQ(s.offset, next) << "rank " << r;
    EXPECT_GE(s.numel, 0);
    next = s.end();
    smallest = std::min(smallest, s.numel);
    largest = std::max(largest, s.numel);
  }
  EXPECT_EQ(next, numel);
  EXPECT_LE(largest - smallest, 1);
}

TEST_P(ShardSweep, PaddingDividesEvenlyAndIsMinimal) {
  const auto [numel, world] = GetParam();
  for (std::int64_t align : {1, 4, 16}) {
    const auto padded = padded_numel(numel, world, align);
    EXPECT_GE(padded, numel);
    EXPECT_EQ(padded % (world * align), 0);
    EXPECT_LT(padded - numel, world * align);
    const auto s = shard_range(padded, world, world - 1);
    EXPECT_EQ(s.numel, padded / world);
  }
}

INSTANTIATE_TEST_SUITE_P(SizesAndWorlds, ShardSweep,
                         ::testing::Combine(::testing::Values(0, 1, 2, 3, 5, 7, 13, 64, 97, 1000, 65537),
                                            ::testing::Range(1, 9)));

TEST(Shard, KnownSplit) {
  // 10 over 4: 3, 3, 2, 2.
  EXPECT_EQ(shard_range(10, 4, 0), (flatshard::ShardRange{0, 3}));
  EXPECT_EQ(shard_range(10, 4, 1), (flatshard::ShardRange{3, 3}));
  EXPECT_EQ(shard_range(10, 4, 2), (flatshard::ShardRange{6, 2}));
  EXPECT_EQ(shard_range(10, 4, 3), (flatshard::ShardRange{8, 2}));
  EXPECT_EQ(padded_numel(10, 4, 4), 16);
}

}  // namespace
