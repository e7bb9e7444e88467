#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "flatshard/errors.h"
#include "flatshard/memory.h"
#include "src/memory/pinned_host.h"

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

// Note [Page-locked at its size], with the heap standing in for cudaHostAlloc: a block is
// the tensor's bytes rounded up to a page (not to a power of two), lives as long as any
// tensor on it, and a host that cannot lock it gets an error that says what to do.
namespace {
std::vector<std::size_t> locked_blocks;
int unlocked_blocks = 0;
bool refuse_to_lock = false;
void* fake_lock(std::size_t bytes, const char** error) {
  if (refuse_to_lock) {
    *error = "out of memory";
    return nullptr;
  }
  locked_blocks.push_back(bytes);
  return std::aligned_alloc(flatshard::memory::PinnedHost::kPageBytes, bytes);
}
void fake_unlock(void* p) {
  ++unlocked_blocks;
  std::free(p);
}
}  // namespace

TEST(PinnedHost, BlocksAreTheirBytesRoundedToAPageAndDieWithTheirTensors) {
  using flatshard::memory::PinnedHost;
  auto& host = PinnedHost::instance();
  host.set_functions(nullptr, nullptr);
  try {
    host.empty(16, at::kFloat);
    ADD_FAILURE() << "locked memory without a device library";
  } catch (const flatshard::Error& e) {
    EXPECT_NE(std::string(e.what()).find("flatshard::cuda"), std::string::npos) << e.what();
  }
  host.set_functions(&fake_lock, &fake_unlock);
  for (std::int64_t numel : {std::int64_t{0}, std::int64_t{1}, std::int64_t{1024}, std::int64_t{1025},
                             (std::int64_t{3} << 20) + 5}) {
    SCOPED_TRACE(numel);
    const std::size_t bytes = static_cast<std::size_t>(numel) * 4;
    const std::size_t page = PinnedHost::kPageBytes;
    const std::size_t expected = std::max(page, (bytes + page - 1) / page * page);
    const int unlocked_before = unlocked_blocks;
    auto t = host.empty(numel, at::kFloat);
    ASSERT_EQ(locked_blocks.back(), expected);
    EXPECT_EQ(host.live_bytes(), expected);
    EXPECT_EQ(t.numel(), numel);
    EXPECT_TRUE(t.is_cpu());
    t.fill_(3.0f);
    EXPECT_EQ(t.sum().item<double>(), 3.0 * numel);
    auto view = t.narrow(0, 0, numel / 2);
    t.reset();
    EXPECT_EQ(unlocked_blocks, unlocked_before) << "a view still holds the block";
    view.reset();
    EXPECT_EQ(unlocked_blocks, unlocked_before + 1);
    EXPECT_EQ(host.live_bytes(), 0u);
  }
  // 12 MiB + 20 bytes: a page more, where a power of two would take 16 MiB.
  EXPECT_EQ(locked_blocks.back(), (std::size_t{12} << 20) + PinnedHost::kPageBytes);

  auto kept = host.empty(1024, at::kFloat);
  refuse_to_lock = true;
  try {
    host.empty(1 << 20, at::kFloat);
    ADD_FAILURE() << "a refused lock returned memory";
  } catch (const flatshard::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("out of memory"), std::string::npos) << what;
    EXPECT_NE(what.find("4.0 MiB"), std::string::npos) << what;
    EXPECT_NE(what.find("cpu_offload"), std::string::npos) << what;
  }
  EXPECT_EQ(host.live_bytes(), 4096u) << "the refused block is not counted";
  refuse_to_lock = false;
  kept.reset();
  host.set_functions(nullptr, nullptr);
}
