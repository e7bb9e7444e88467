// main() of the multi-rank test binaries. In rank mode exactly one test must run:
// a filter that matched nothing would otherwise pass silently.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "tests/support/multirank.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (!flatshard::testing::in_rank_mode()) return RUN_ALL_TESTS();
  at::set_num_threads(1);  // ranks share the machine's cores
  const int rc = RUN_ALL_TESTS();
  const auto* unit = ::testing::UnitTest::GetInstance();
  if (unit->test_to_run_count() != 1) {
    std::fprintf(stderr, "rank mode ran %d tests instead of 1\n", unit->test_to_run_count());
    return 99;
  }
  return rc;
}
