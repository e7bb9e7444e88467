// The flat groups every sharded mode is made of (sharding/flat_param.h), and which unit
// each parameter belongs to (sharding/unit_discovery.h), without any communication.
#include <gtest/gtest.h>

#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include "flatshard/unit.h"
#include "sharding/flat_param.h"
#include "sharding/unit_discovery.h"

namespace {

using flatshard::sharding::FlatParamGroup;

// Three parameters of 3, 5 (shaped 5x1) and 7 elements with known values.
std::vector<std::pair<std::string, at::Tensor>> three_params() {
  return {{"a", at::arange(3, at::kFloat).add_(1).requires_grad_()},
          {"b", at::arange(5, at::kFloat).add_(10).view({5, 1}).clone().requires_grad_()},
          {"c", at::arange(7, at::kFloat).add_(100).requires_grad_()}};
}

at::Tensor concatenated() {
  return at::cat({at::arange(3).add(1), at::arange(5).add(10), at::arange(7).add(100)}).to(at::kFloat);
}

// Shards are equal, a multiple of 16 bytes, and the padding is as small as that allows.
TEST(FlatParamGroup, PaddingSplitsEvenlyInSixteenByteShards) {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (int world : {1, 2, 3, 4, 8}) {
      SCOPED_TRACE(::testing::Message() << c10::toString(dtype) << " world " << world);
      FlatParamGroup g("g", three_params(), world, world - 1, dtype, {});
      const std::int64_t elem = c10::elementSize(dtype);
      EXPECT_EQ(g.numel(), 15);
      EXPECT_EQ(g.padded_numel(), g.shard_numel() * world);
      EXPECT_EQ(g.shard_numel() * elem % 16, 0);
      EXPECT_GE(g.padded_numel(), 15);
      // One 16-byte step less per shard would not hold the parameters.
      EXPECT_LT((g.shard_numel() - 16 / elem) * world, 15);
      EXPECT_EQ(g.world_size(), world);
      EXPECT_EQ(g.full_bytes(), g.padded_numel() * elem);
    }
  }
}

// Each rank's master shard is its slice of the concatenated values, zeros in the padding,
// in fp32 whatever the compute dtype; the parameters start empty.
TEST(FlatParamGroup, MasterIsThisRanksSliceAndParametersStartEmpty) {
  const int world = 4;
  for (int rank = 0; rank < world; ++rank) {
    auto params = three_params();
    auto b = params[1].second;
    FlatParamGroup g("g", params, world, rank, at::kBFloat16, {});
    auto flat = at::zeros({g.padded_numel()});
    flat.narrow(0, 0, 15).copy_(concatenated());
    EXPECT_TRUE(at::equal(g.master(), flat.narrow(0, rank * g.shard_numel(), g.shard_numel()))) << rank;
    EXPECT_EQ(g.master().scalar_type(), at::kFloat);
    EXPECT_EQ(b.numel(), 0) << "the parameter gave up its values";
    EXPECT_FALSE(g.full_allocated());
    ASSERT_EQ(g.slots().size(), 3u);
    EXPECT_EQ(g.slots()[1].offset, 3);
    EXPECT_EQ(g.slots()[2].offset, 8);
    EXPECT_EQ(g.slots()[1].shape, (std::vector<std::int64_t>{5, 1}));
  }
}

// Gathered, the parameters are views of the flat buffer (a write to it is a write to
// them); freed, the buffer's bytes go while its storage object stays for the next gather.
TEST(FlatParamGroup, ViewsOfTheFlatBufferAndFreeingIt) {
  auto params = three_params();
  at::Tensor a = params[0].second, c = params[2].second;
  FlatParamGroup g("g", params, 1, 0, at::kFloat, {});
  g.allocate_full();
  ASSERT_TRUE(g.full_allocated());
  g.copy_master_to_slot();
  g.use_full_views();
  EXPECT_TRUE(at::equal(c, at::arange(7, at::kFloat).add(100)));
  EXPECT_EQ(a.data_ptr<float>(), g.full().data_ptr<float>());
  g.full()[9].fill_(-1);
  EXPECT_EQ(c[1].item<float>(), -1.0f) << "c is a view of the flat buffer at offset 8";
  const auto* storage = g.full().storage().unsafeGetStorageImpl();
  g.use_empty_views();
  g.free_full();
  EXPECT_EQ(c.numel(), 0);
  EXPECT_FALSE(g.full_allocated());
  EXPECT_EQ(g.full().storage().nbytes(), 0u);
  g.allocate_full();
  EXPECT_EQ(g.full().storage().unsafeGetStorageImpl(), storage) << "the same storage, refilled";
  EXPECT_EQ(g.full().storage().nbytes(), static_cast<std::size_t>(g.full_bytes()));
}

// Gradient views: each parameter's .grad() is its slice of the zeroed flat gradient, so
// accumulation lands in place; dropped, they are undefined again.
TEST(FlatParamGroup, GradientViewsAccumulateInTheFlatGradient) {
  auto params = three_params();
  at::Tensor b = params[1].second;
  FlatParamGroup g("g", params, 2, 1, at::kFloat, {});
  g.allocate_full();
  g.use_full_views();
  g.allocate_full_grad();
  EXPECT_EQ(g.full_grad().abs().sum().item<float>(), 0.0f);
  g.use_grad_views();
  ASSERT_TRUE(b.grad().defined());
  b.mutable_grad().add_(2);
  EXPECT_EQ(g.full_grad().narrow(0, 3, 5).sum().item<float>(), 10.0f);
  EXPECT_EQ(g.full_grad().sum().item<float>(), 10.0f) << "nothing outside b's slice";
  g.drop_param_grads();
  EXPECT_FALSE(b.grad().defined());
  g.free_full_grad();
  EXPECT_FALSE(g.full_grad_allocated());
}

// Note [The bf16 copy of an offloaded master]: an offloaded bf16 group sends its bf16 copy
// while the master's version is the one the copy was made at, and the fp32 master (rounded
// on the way) otherwise; a group without offload, in fp32, or told not to, keeps none.
TEST(FlatParamGroup, OffloadedMasterSendsItsBf16CopyOnlyWhileCurrent) {
  FlatParamGroup::Placement offloaded;
  offloaded.offload = true;
  offloaded.bf16_copy = true;
  FlatParamGroup g("g", three_params(), 2, 1, at::kBFloat16, offloaded);
  auto slot = [&] {
    g.allocate_full();
    g.full().zero_();
    g.copy_master_to_slot();
    return g.full_slot().clone();
  };
  const auto rounded = [&] { return g.master().to(at::kBFloat16); };
  EXPECT_EQ(g.bf16_copy_bytes(), 0) << "made at the first step, not before";
  EXPECT_TRUE(at::equal(slot(), rounded()));

  at::Tensor copy = g.bf16_copy_for_step();
  ASSERT_TRUE(copy.defined());
  EXPECT_EQ(g.bf16_copy_bytes(), g.shard_numel() * 2);
  EXPECT_TRUE(at::equal(copy, rounded())) << "made from the master";
  // What the step writes into the copy is what the gathers send: the master is not read.
  copy.fill_(-3);
  g.bf16_copy_written();
  EXPECT_TRUE(g.bf16_copy_current());
  EXPECT_TRUE(at::equal(slot(), at::full({g.shard_numel()}, -3, at::kBFloat16)));
  // A write to the master the copy did not see (an ATen in-place operation) makes it stale.
  {
    at::NoGradGuard no_grad;
    g.master().add_(0.5);
  }
  EXPECT_FALSE(g.bf16_copy_current());
  EXPECT_TRUE(at::equal(slot(), rounded()));
  EXPECT_TRUE(at::equal(g.bf16_copy_for_step(), rounded())) << "the next step converts the master again";
  EXPECT_TRUE(g.bf16_copy_current());

  for (const auto& [dtype, placement] : {std::pair{at::kBFloat16, FlatParamGroup::Placement{}},
                                         std::pair{at::kFloat, offloaded}, std::pair{at::kHalf, offloaded}}) {
    FlatParamGroup none("none", three_params(), 2, 1, dtype, placement);
    EXPECT_FALSE(none.bf16_copy_for_step().defined()) << c10::toString(dtype);
    EXPECT_EQ(none.bf16_copy_bytes(), 0);
  }
  offloaded.bf16_copy = false;
  FlatParamGroup off("off", three_params(), 2, 1, at::kBFloat16, offloaded);
  EXPECT_FALSE(off.bf16_copy_for_step().defined()) << "FullyShardOptions::offload_bf16_copy = false";
}

// Note [Reused host buffers]: a freed block serves the next request it fits (up to a
// quarter larger), the pool keeps at most its limit (oldest dropped first), and blocks
// over the limit are not kept.
TEST(BufferPool, ReusesFittingBlocksWithinItsLimit) {
  using flatshard::sharding::BufferPool;
  c10::Allocator* cpu = c10::GetCPUAllocator();
  const std::size_t mib = std::size_t{1} << 20;
  BufferPool pool(10 * mib);
  std::size_t got = 0;
  c10::DataPtr a = pool.take(4 * mib, cpu, &got);
  EXPECT_EQ(got, 4 * mib);
  void* a_ptr = a.get();
  pool.give(std::move(a), 4 * mib);
  EXPECT_EQ(pool.cached_bytes(), 4 * mib);
  c10::DataPtr too_small_for = pool.take(3 * mib, cpu, &got);  // 4 MiB is over a quarter larger
  EXPECT_NE(too_small_for.get(), a_ptr);
  EXPECT_EQ(got, 3 * mib);
  c10::DataPtr fits = pool.take(4 * mib - 4096, cpu, &got);
  EXPECT_EQ(fits.get(), a_ptr) << "the kept block serves a request it fits";
  EXPECT_EQ(got, 4 * mib) << "and is handed out whole, to come back whole";
  EXPECT_EQ(pool.cached_bytes(), 0u);
  c10::DataPtr b = pool.take(5 * mib, cpu, &got);
  void* b_ptr = b.get();
  pool.give(std::move(fits), 4 * mib);
  pool.give(std::move(too_small_for), 3 * mib);
  EXPECT_EQ(pool.cached_bytes(), 7 * mib);
  pool.give(std::move(b), 5 * mib);  // 12 MiB > 10: the oldest (the 4 MiB block) goes
  EXPECT_EQ(pool.cached_bytes(), 8 * mib);
  c10::DataPtr again = pool.take(4 * mib, cpu, &got);
  EXPECT_EQ(again.get(), b_ptr) << "the smallest kept block that fits: 5 MiB (4 MiB was dropped)";
  pool.give(pool.take(11 * mib, cpu, &got), 11 * mib);  // over the limit: not kept
  EXPECT_EQ(pool.cached_bytes(), 3 * mib);
}

// A host group whose gathered buffer comes from a pool gets the same block back after
// freeing it, and a gradient buffer someone else still holds is not taken back.
TEST(BufferPool, GroupsGiveBackWhatNobodyElseHolds) {
  auto pool = std::make_shared<flatshard::sharding::BufferPool>(std::size_t{1} << 30);
  std::vector<std::pair<std::string, at::Tensor>> params = {{"w", at::ones({1 << 18}).requires_grad_()},
                                                            {"b", at::ones({1 << 18}).requires_grad_()}};
  FlatParamGroup g("g", params, 1, 0, at::kFloat, {});
  g.set_pool(pool);
  g.allocate_full();
  void* first = g.full().data_ptr();
  g.free_full();
  EXPECT_EQ(pool->cached_bytes(), static_cast<std::size_t>(g.full_bytes()));
  g.allocate_full();
  EXPECT_EQ(g.full().data_ptr(), first) << "the freed block, reused";
  EXPECT_EQ(pool->cached_bytes(), 0u);
  at::Tensor held = g.pooled_empty(1 << 18, at::kFloat);
  at::Tensor view = held.narrow(0, 0, 16);  // a caller still holds part of it
  g.release(std::move(held));
  EXPECT_EQ(pool->cached_bytes(), 0u) << "a buffer still viewed must not be handed out again";
  EXPECT_TRUE(view.is_contiguous());
  view.fill_(3);  // still valid memory
  at::Tensor alone = g.pooled_empty(1 << 18, at::kFloat);
  g.release(std::move(alone));
  EXPECT_EQ(pool->cached_bytes(), std::size_t{1} << 20);
}

// Note [Buffers a collective touches]: FLATSHARD_POISON_FREED=1 fills a freed buffer
// with 0xFF bytes (NaN) before it goes back, so a view that outlived it reads NaN; off,
// the bytes are left as they were.
TEST(BufferPool, PoisonFreedFillsFreedBuffersWithNaN) {
  auto pool = std::make_shared<flatshard::sharding::BufferPool>(std::size_t{1} << 30);
  std::vector<std::pair<std::string, at::Tensor>> params = {{"w", at::ones({1 << 10}).requires_grad_()}};
  FlatParamGroup g("g", params, 1, 0, at::kFloat, {});
  g.set_pool(pool);
  for (bool poison : {false, true}) {
    if (poison) setenv("FLATSHARD_POISON_FREED", "1", 1);
    g.allocate_full();
    g.full().fill_(2.0f);
    // A stale alias of the bytes, as a use after free would read them (the pool keeps
    // the block, so the memory stays valid to read here).
    const at::Tensor stale = at::from_blob(g.full().data_ptr(), {g.full().numel()}, at::kFloat);
    g.free_full();
    if (poison) {
      EXPECT_TRUE(stale.isnan().all().item<bool>()) << "freed bytes not poisoned";
    } else {
      EXPECT_TRUE(stale.eq(2.0f).all().item<bool>()) << "bytes changed with poisoning off";
    }
    unsetenv("FLATSHARD_POISON_FREED");
  }
}

struct InnerImpl : torch::nn::Module {
  InnerImpl() { w = register_parameter("w", at::zeros({2})); }
  at::Tensor forward(const at::Tensor& x) { return x + w; }
  at::Tensor w;
};
TORCH_MODULE(Inner);

struct OuterImpl : torch::nn::Module {
  OuterImpl() {
    v = register_parameter("v", at::zeros({3}));
    inner = register_module("inner", flatshard::Unit<Inner>());
  }
  at::Tensor forward(const at::Tensor& x) { return inner(x) + v.sum(); }
  at::Tensor v;
  flatshard::Unit<Inner> inner{nullptr};
};
TORCH_MODULE(Outer);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    emb = register_parameter("emb", at::zeros({4}));
    first = register_module("first", flatshard::Unit<Outer>());
    second = register_module("second", flatshard::Unit<torch::nn::Linear>(2, 2));
  }
  at::Tensor emb;
  flatshard::Unit<Outer> first{nullptr};
  flatshard::Unit<torch::nn::Linear> second{nullptr};
};
TORCH_MODULE(Net);

// A parameter belongs to the innermost unit holding it, the root unit (0) otherwise;
// units come in declaration (pre-order) order.
TEST(UnitDiscovery, InnermostUnitOwnsEachParameterInPreOrder) {
  Net net;
  const auto m = flatshard::sharding::discover_units(*net);
  ASSERT_EQ(m.declared.size(), 3u);  // first, first.inner, second
  auto owner = [&](const at::Tensor& t) { return m.owner.at(t.unsafeGetTensorImpl()); };
  EXPECT_EQ(owner(net->emb), 0);
  EXPECT_EQ(owner(net->first->v), 1);
  EXPECT_EQ(owner(net->first->inner->w), 2);
  EXPECT_EQ(owner(net->second->weight), 3);
  EXPECT_EQ(owner(net->second->bias), 3);
  EXPECT_EQ(m.owner.size(), 5u);
}

}  // namespace
