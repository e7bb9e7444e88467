#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "flatshard/memory.h"

namespace {

TEST(CountingAllocator, CountsLiveAndPeakBytes) {
  flatshard::memory::install_counting_allocator();
  flatshard::memory::install_counting_allocator();  // idempotent
  const auto before = flatshard::memory::allocator_stats();
  ASSERT_TRUE(before.installed);
  constexpr std::int64_t kBytes = 4 << 20;
  {
    auto t = at::empty({kBytes / 4}, at::kFloat);
    const auto during = flatshard::memory::allocator_stats();
    EXPECT_GE(during.current_bytes - before.current_bytes, kBytes);
    EXPECT_GE(during.peak_bytes, during.current_bytes);
    EXPECT_GT(during.allocations, before.allocations);
  }
  const auto after = flatshard::memory::allocator_stats();
  EXPECT_EQ(after.current_bytes, before.current_bytes);
  EXPECT_GE(after.peak_bytes, before.current_bytes + kBytes);
  flatshard::memory::reset_allocator_peak();
  EXPECT_EQ(flatshard::memory::allocator_stats().peak_bytes, after.current_bytes);
}

}  // namespace
