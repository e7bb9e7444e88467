// The step-time model (include/flatshard/step_time.h): shapes against published counts,
// compute and communication against hand-computed costs, overlap, and the command line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "flatshard/step_time.h"
#include "src/plan/compute_stream.h"
#include "tests/support/subprocess.h"

namespace {

using namespace flatshard::plan;
using flatshard::Strategy;

// The models' parameter counts: bench_modes prints 33,612,800 for its GPT; Meta's Llama
// 3.1 8B and 70B configurations have 8,030,261,248 and 70,553,706,496.
TEST(StepTime, ShapesCountTheParametersTheModelsHave) {
  EXPECT_EQ(gpt(8, 512, 8, 8192, 32).params(), 33'612'800);
  EXPECT_EQ(llama3_8b().params(), 8'030'261'248);
  EXPECT_EQ(llama3_70b().params(), 70'553'706'496);
  const auto shape = llama3_8b().model_shape();
  EXPECT_EQ(shape.total(), llama3_8b().params());
  EXPECT_EQ(shape.unit_numels.size(), 32u);
  EXPECT_THROW(named_model("llama2-7b"), std::invalid_argument);
}

Cluster one_device(double flops) {
  Cluster c = h100_cluster(1, 1);
  c.flops = flops;
  return c;
}

// On one device nothing communicates: the step is forward, backward (twice the forward)
// and the optimizer, and the forward is the FLOP count over the throughput.
TEST(StepTime, OneDeviceIsItsComputeAndItsOptimizerStep) {
  const auto m = gpt(8, 512, 8, 8192, 1024);
  TimeOptions o;
  o.sequences = 4;
  o.sequence_length = 1024;
  const Cluster c = one_device(100e12);
  for (Strategy s :
       {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard, Strategy::ShardOptimizerState}) {
    o.strategy = s;
    const StepTime t = predict_time(m, c, o);
    const double tokens = 4.0 * 1024;
    EXPECT_NEAR(t.forward_s, m.forward_flops_per_token(1024) * tokens / c.flops, 1e-3 * t.forward_s);
    EXPECT_NEAR(t.backward_s, 2 * t.forward_s, 1e-9);
    EXPECT_NEAR(t.optimizer_s, static_cast<double>(m.params()) * 28 / c.memory_bandwidth, 1e-12);
    EXPECT_NEAR(t.step_s, t.forward_s + t.backward_s + t.optimizer_s, 1e-12);
    EXPECT_EQ(t.communication_s, 0);
    EXPECT_EQ(t.limit, "compute");
    EXPECT_NEAR(t.tokens_per_s, tokens / t.step_s, 1e-6);
  }
  o.strategy = Strategy::FullShard;
  const double forward = predict_time(m, c, o).forward_s;
  const double head =
      2.0 * 8192 * 512 * 4 * 1024 / c.flops;  // the head's forward: not a unit, not recomputed
  o.recompute = Recompute::Full;              // each unit's forward again in backward
  EXPECT_NEAR(predict_time(m, c, o).backward_s, 3 * forward - head, 1e-9);
}

// A cluster of nodes x per_node devices on which only communication takes time: one
// latency-free link and one link of 1 GB/s with 10 us per ring step (`slow_intra`: which).
Cluster only_links(int nodes, int per_node, bool slow_intra) {
  Cluster c = h100_cluster(nodes, per_node);
  c.flops = 1e30;
  c.memory_bandwidth = 1e30;
  c.intra = slow_intra ? Link{1e9, 1e-5} : Link{1e30, 0};
  c.inter = slow_intra ? Link{1e30, 0} : Link{1e9, 1e-5};
  return c;
}

// With compute free, the step is the collectives, one after another on the link, each at
// nccl-tests' cost: (n-1)/n of the bytes over the bus bandwidth, plus a latency per step.
TEST(StepTime, WithoutComputeTheStepIsEveryCollectiveAtItsRingCost) {
  const auto m = gpt(4, 256, 4, 1024, 64);
  const Cluster c = only_links(1, 4, true);
  TimeOptions o;
  o.param_bytes = 2;
  o.reduce_bytes = 4;
  const double layer = static_cast<double>(m.layer_params()), root = static_cast<double>(m.root_params());
  const auto ring = [&](double bytes) { return bytes * 3 / 4 / 1e9 + 3 * 1e-5; };
  o.strategy = Strategy::FullShard;
  const double gathers = ring(root * 2) + 2 * m.layers * ring(layer * 2);
  const double reductions = m.layers * ring(layer * 4) + ring(root * 4);
  StepTime t = predict_time(m, c, o);
  EXPECT_NEAR(t.step_s, gathers + reductions, 1e-9);
  EXPECT_NEAR(t.communication_s, gathers + reductions, 1e-9);
  EXPECT_NEAR(t.exposed_share(), 1.0, 1e-6);
  o.strategy = Strategy::ShardGradOp;  // no gathers in backward
  t = predict_time(m, c, o);
  EXPECT_NEAR(t.step_s, gathers - m.layers * ring(layer * 2) + reductions, 1e-9);
  o.strategy = Strategy::NoShard;  // one bucket (the model is under 25 MiB), all-reduced
  const auto all_reduce = [&](double bytes) { return 2 * bytes * 3 / 4 / 1e9 + 6 * 1e-5; };
  EXPECT_NEAR(predict_time(m, c, o).step_s, all_reduce((root + m.layers * layer) * 4), 1e-9);
  o.strategy = Strategy::ShardOptimizerState;  // reduce-scatter, then the gathers behind the step
  EXPECT_NEAR(predict_time(m, c, o).step_s,
              ring((root + m.layers * layer) * 4) + ring((root + m.layers * layer) * 2), 1e-9);
}

// A link's all-reduce at its own bus bandwidth (Link::all_reduce_bus_bandwidth: the CPU
// rings' in-place all-reduce) prices the all-reduces and nothing else, on the link it is
// given for; beside compute, in the same ratio to the link's figure there.
TEST(StepTime, AnAllReducesOwnBandwidthPricesOnlyTheAllReduces) {
  const auto m = gpt(4, 256, 4, 1024, 64);
  Cluster c = only_links(1, 4, true);  // 1 GB/s, 10 us a step
  c.intra.all_reduce_bus_bandwidth = 2.5e9;
  TimeOptions o;
  o.param_bytes = o.reduce_bytes = 4;
  o.first_bucket_bytes = o.bucket_bytes;  // the head joins the layers' bucket
  const double params = static_cast<double>(m.params());
  const auto ring = [&](double bytes, double bus) { return bytes * 3 / 4 / bus + 3 * 1e-5; };
  o.strategy = Strategy::NoShard;  // one bucket, all-reduced
  EXPECT_NEAR(predict_time(m, c, o).communication_s, 2 * ring(params * 4, 2.5e9), 1e-12);
  o.hook = parse_hook_model("bf16");  // a hook's all-reduce too
  EXPECT_NEAR(predict_time(m, c, o).communication_s, 2 * ring(params * 2, 2.5e9), 1e-12);
  o.hook = HookModel{};
  o.strategy = Strategy::ShardOptimizerState;  // a reduce-scatter and the gathers: no all-reduce
  EXPECT_NEAR(predict_time(m, c, o).communication_s, 2 * ring(params * 4, 1e9), 1e-12);
  for (Strategy s : {Strategy::FullShard, Strategy::ShardGradOp}) {
    o.strategy = s;
    Cluster plain = c;
    plain.intra.all_reduce_bus_bandwidth = 0;
    EXPECT_EQ(predict_time(m, c, o).step_s, predict_time(m, plain, o).step_s) << static_cast<int>(s);
  }
  // Hybrid over two nodes of two: the reduce-scatter within the node, the all-reduce across
  // at the links across nodes' own figure (given there, not on the node's links).
  Cluster two = only_links(2, 2, false);  // across nodes 1 GB/s, 10 us a step
  two.intra.all_reduce_bus_bandwidth = 1e30;
  o.strategy = Strategy::HybridShard;
  const double plain_hybrid = predict_time(m, two, o).communication_s;
  two.inter.all_reduce_bus_bandwidth = 4e9;
  const double across = 2 * (params * 4 / 2) / 2;  // a shard's bytes, moved (n-1)/n twice at 2 ranks
  EXPECT_NEAR(plain_hybrid - predict_time(m, two, o).communication_s, across / 1e9 - across / 4e9, 1e-12);
  // Beside compute: the link there, in the all-reduce's ratio (2.5 times) to the free link;
  // so DDP, all-reduces only, steps as on links 2.5 times faster everywhere.
  Cluster busy = only_links(1, 2, true);
  busy.flops = 1e9;
  busy.intra_beside_compute = Link{0.5e9, 1e-5};
  o.strategy = Strategy::NoShard;
  o.sequences = 4;
  o.sequence_length = 64;
  o.bucket_bytes = 4 * m.layer_params();  // a bucket a layer, reduced beside backward
  Cluster free = busy;
  free.intra_beside_compute = Link{};
  ASSERT_GT(predict_time(m, busy, o).communication_s, predict_time(m, free, o).communication_s)
      << "the buckets run beside compute";
  Cluster fast = busy;
  fast.intra.bus_bandwidth = 2.5e9;
  fast.intra_beside_compute.bus_bandwidth = 1.25e9;
  busy.intra.all_reduce_bus_bandwidth = 2.5e9;
  EXPECT_NEAR(predict_time(m, busy, o).communication_s, predict_time(m, fast, o).communication_s, 1e-12);
  EXPECT_NEAR(predict_time(m, busy, o).step_s, predict_time(m, fast, o).step_s, 1e-12);
  c.intra.all_reduce_bus_bandwidth = -1;
  EXPECT_THROW(predict_time(m, c, o), std::invalid_argument);
}

// Communication shorter than each unit's compute hides behind it: only the first gather and
// the last reductions show; a link too slow to hide it makes the gathers the limit.
TEST(StepTime, CommunicationHidesBehindComputeUntilTheLinkIsTooSlow) {
  const auto m = llama3_8b();
  TimeOptions o;
  o.sequences = 2;
  o.sequence_length = 8192;
  o.recompute = Recompute::Selective;
  const StepTime node = predict_time(m, h100_cluster(1, 8), o);
  EXPECT_LT(node.exposed_share(), 0.05);
  EXPECT_EQ(node.limit, "compute");
  Cluster slow = h100_cluster(1, 8);
  slow.intra.bus_bandwidth = 5e9;
  const StepTime starved = predict_time(m, slow, o);
  EXPECT_GT(starved.exposed_share(), 0.5);
  EXPECT_EQ(starved.limit, "gathers");
  EXPECT_LT(starved.tokens_per_s, node.tokens_per_s / 2);
}

// Prefetch: unit k+1's gather runs beside unit k's forward. With each unit's gather exactly
// as long as its forward, prefetch 1 leaves only the first gather exposed and prefetch 0
// every one: the steps differ by all the gathers but one.
TEST(StepTime, PrefetchHidesEachGatherBehindThePreviousUnit) {
  const auto m = gpt(6, 256, 4, 1024, 64);
  Cluster c = h100_cluster(1, 2);
  c.memory_bandwidth = 1e30;
  c.intra = {1e9, 0};
  TimeOptions o;
  o.strategy = Strategy::ShardGradOp;  // backward needs no gathers: the forward makes the difference
  o.sequences = 1;
  o.sequence_length = 64;
  o.param_bytes = 2;
  const double layer = static_cast<double>(m.layer_params());
  const double gather = layer * 2 / 2 / 1e9;                     // half the unit's bf16 bytes cross the link
  c.flops = (2 * layer * 64 + 4.0 * 4 * 64 * 64 * 64) / gather;  // a unit's forward takes as long
  o.prefetch = 0;
  const double none = predict_time(m, c, o).step_s;
  o.prefetch = 1;
  const double one = predict_time(m, c, o).step_s;
  EXPECT_NEAR(none - one, (m.layers - 1) * gather, 1e-9 * none);
  o.prefetch = 2;  // the link is the limit already
  EXPECT_NEAR(predict_time(m, c, o).step_s, one, 1e-9 * one);
}

// Note [Collectives on the compute's cores]: a collective that takes the whole device
// (share 1) stops compute while it moves bytes, so with one link of no latency the step is
// every second of compute plus every second of the link, in every strategy, however well
// the schedule overlapped them; a quarter and three quarters of it give steps in between,
// in order.
TEST(StepTime, CollectivesThatTakeTheComputesCoresAddToTheStep) {
  const auto m = gpt(6, 256, 4, 1024, 64);
  Cluster c = h100_cluster(1, 4);
  c.flops = 1e11;  // each unit's compute longer than its collectives
  c.memory_bandwidth = 1e11;
  c.intra = {1e9, 0};
  TimeOptions o;
  o.sequences = 2;
  o.sequence_length = 64;
  o.bucket_bytes = m.layer_params() * 4;  // DDP and ZeRO-1 reduce one layer at a time, beside backward
  for (Strategy s :
       {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard, Strategy::ShardOptimizerState}) {
    o.strategy = s;
    c.collective_compute_share = 0;
    const StepTime free = predict_time(m, c, o);
    EXPECT_EQ(free.contended_s, 0);
    const double compute = free.forward_s + free.backward_s + free.optimizer_s + free.engine_s;
    EXPECT_LT(free.step_s, 0.9 * (compute + free.communication_s)) << "nothing overlapped: nothing to lose";
    c.collective_compute_share = 1;
    const StepTime whole = predict_time(m, c, o);
    EXPECT_NEAR(whole.step_s, compute + whole.communication_s, 1e-9 * whole.step_s);
    EXPECT_NEAR(whole.communication_s, free.communication_s, 1e-12);
    EXPECT_GT(whole.contended_s, 0);
    EXPECT_EQ(whole.limit, "contention");
    c.collective_compute_share = 0.25;
    const StepTime quarter = predict_time(m, c, o);
    c.collective_compute_share = 0.75;
    const StepTime most = predict_time(m, c, o);
    EXPECT_GT(quarter.step_s, free.step_s);
    EXPECT_LT(quarter.step_s, most.step_s);
    EXPECT_LT(most.step_s, whole.step_s);
    EXPECT_GT(quarter.contended_s, 0);
    EXPECT_LT(quarter.contended_s, most.contended_s);
    EXPECT_LT(most.contended_s, whole.contended_s);
  }
}

// A ring step's latency is the communicator waiting for its peer, not copying: a link that
// is all latency takes nothing from compute at share 1, and on a link of bytes and latency
// the share applies to the bytes' part only.
TEST(StepTime, ALinksLatencyTakesNothingFromCompute) {
  const auto m = gpt(6, 256, 4, 1024, 64);
  Cluster c = h100_cluster(1, 4);
  c.flops = 1e11;
  c.memory_bandwidth = 1e11;
  TimeOptions o;
  o.sequences = 2;
  o.sequence_length = 64;
  o.bucket_bytes = m.layer_params() * 4;
  for (Strategy s :
       {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard, Strategy::ShardOptimizerState}) {
    o.strategy = s;
    c.intra = {1e30, 1e-4};  // every collective 3 (all-reduce 6) ring steps of latency, no bytes' time
    c.collective_compute_share = 0;
    const StepTime free = predict_time(m, c, o);
    c.collective_compute_share = 1;
    const StepTime waiting = predict_time(m, c, o);
    EXPECT_GT(free.communication_s, 0);
    EXPECT_NEAR(waiting.step_s, free.step_s, 1e-12);
    EXPECT_NEAR(waiting.contended_s, 0, 1e-12);
    // Bytes and latency: compute loses time, but less than the collectives last (the
    // walk itself is checked exactly in ComputeStreamWalksTheSpansAtTheirShares).
    c.intra = {1e9, 1e-4};
    const StepTime both = predict_time(m, c, o);
    c.intra = {1e9, 0};
    const StepTime bytes = predict_time(m, c, o);
    EXPECT_GT(both.contended_s, 0);
    EXPECT_LE(both.contended_s, bytes.communication_s + 1e-12);
  }
}

// Note [Collectives beside compute]: the link's figures beside compute apply to the
// collectives that start while their rank still has compute to run. The free link's own
// figures change nothing, and neither do faster ones (a reading under the free link's is
// noise). A slower link beside compute lengthens full shard's and shard-grad-op's steps
// (gathers ahead of their unit, reductions beside backward) and DDP's and ZeRO-1's with a
// bucket per layer, and leaves both with one bucket as they were: the one reduction runs
// after backward, and ZeRO-1's one gather after its one step, the cores free. The compute a
// collective takes stays its bytes' work at the free link's rate, however long it runs.
TEST(StepTime, ALinkBesideComputeSlowsOnlyTheCollectivesThatOverlapCompute) {
  const auto m = gpt(6, 256, 4, 1024, 64);
  Cluster c = h100_cluster(1, 4);
  c.flops = 1e11;
  c.memory_bandwidth = 1e11;
  c.intra = {1e9, 1e-5};
  c.collective_compute_share = 1;
  TimeOptions o;
  o.sequences = 2;
  o.sequence_length = 64;
  for (Strategy s :
       {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard, Strategy::ShardOptimizerState}) {
    o.strategy = s;
    const bool buckets = s == Strategy::NoShard || s == Strategy::ShardOptimizerState;
    for (std::int64_t bucket : {m.layer_params() * 4, std::int64_t{1} << 30}) {
      if (!buckets && bucket > m.layer_params() * 4) continue;  // no buckets: once is enough
      o.bucket_bytes = bucket;
      const std::string what = fmt::format("{}, buckets of {} bytes", to_string(s), bucket);
      c.intra_beside_compute = {};
      const StepTime free = predict_time(m, c, o);
      for (Link unchanged : {c.intra, Link{10 * c.intra.bus_bandwidth, 0}}) {
        c.intra_beside_compute = unchanged;
        const StepTime same = predict_time(m, c, o);
        EXPECT_DOUBLE_EQ(same.step_s, free.step_s) << what;
        EXPECT_DOUBLE_EQ(same.exposed_s, free.exposed_s) << what;
        EXPECT_DOUBLE_EQ(same.contended_s, free.contended_s) << what;
      }
      c.intra_beside_compute = {0.05e9, 1e-3};
      const StepTime slow = predict_time(m, c, o);
      if (buckets && bucket > m.params() * 4) {
        EXPECT_DOUBLE_EQ(slow.step_s, free.step_s) << what << ": one bucket, reduced after backward";
        EXPECT_DOUBLE_EQ(slow.communication_s, free.communication_s) << what;
        continue;
      }
      EXPECT_GT(slow.communication_s, 2 * free.communication_s) << what;
      EXPECT_GT(slow.step_s, free.step_s) << what;
      EXPECT_GT(slow.exposed_s, free.exposed_s) << what;
      // The compute lost is bounded by the bytes' work at the free link's rate.
      EXPECT_LE(slow.contended_s, free.communication_s + 1e-12) << what;
      EXPECT_GT(slow.contended_s, 0) << what;
    }
  }
  for (Link bad : {Link{-1, 0}, Link{1e9, -1e-6}}) {
    c.intra_beside_compute = bad;
    EXPECT_THROW(predict_time(m, c, o), std::invalid_argument);
  }
}

// Note [One reduce-scatter in flight]: compute waits for the last unit's reduction (under
// hybrid sharding its reduce-scatter and its all-reduce across nodes) before it issues the
// next. With compute free and both links alike, each unit's reduce-scatter (x) and
// all-reduce (x) then run one after the other, 2x a unit: a step of at least the forward's
// gathers and 2x per unit, where reductions queued on their links without the wait would
// overlap one unit's all-reduce with the next unit's reduce-scatter (about x a unit: 22 ms
// here against 28).
TEST(StepTime, OneReductionInFlightMakesComputeWaitForTheLastOne) {
  const auto m = gpt(6, 256, 4, 1024, 64);
  Cluster c = h100_cluster(2, 2);
  c.flops = 1e18;  // compute takes nothing
  c.memory_bandwidth = 1e18;
  c.intra = c.inter = {1e9, 0};
  TimeOptions o;
  o.strategy = Strategy::HybridShard;
  o.shard_group_size = 2;
  o.sequences = 1;
  o.sequence_length = 64;
  const double x = static_cast<double>(m.layer_params()) * o.reduce_bytes / 2 / 1e9;  // either collective
  const double gathers =  // the root and every unit, each rank's half of the bytes over the node's link
      static_cast<double>(m.root_params() + m.layers * m.layer_params()) * o.param_bytes / 2 / 1e9;
  const StepTime t = predict_time(m, c, o);
  EXPECT_GE(t.step_s, gathers + 2 * m.layers * x);
  EXPECT_EQ(t.limit, "reductions");
}

// Note [Queued bucket reductions]: DDP's fp32 buckets queue; with bf16 parameters (and
// under ZeRO-1 or offload) compute waits for the last bucket's reduction before it issues
// the next. A head bucket whose all-reduce (r) outlasts a layer's backward (b), then layers
// whose buckets reduce in less: queued, compute never waits and the link keeps up; one in
// flight, compute waits r - b before issuing the first layer's bucket, and every later
// step of backward follows that much later. The two differ in nothing else.
TEST(StepTime, BucketsInFlightOneAtATimeDelayBackwardByTheHeadsReduction) {
  const auto m = gpt(4, 256, 4, 65536, 64);  // a large head: its bucket first, alone
  Cluster c = h100_cluster(1, 2);
  c.flops = 1e11;
  c.memory_bandwidth = 1e12;
  TimeOptions o;
  o.strategy = Strategy::NoShard;
  o.sequences = 1;
  o.sequence_length = 64;
  o.reduce_bytes = 4;
  o.bucket_bytes = m.layer_params() * 4;  // a bucket per layer
  const double tokens = 64;
  const double b =
      2 * (2.0 * m.layer_params() * tokens + 4.0 * m.heads * m.head_dim() * 64 * tokens) / c.flops;
  const double head_bytes = (static_cast<double>(m.vocab * m.dim) + 2.0 * m.dim) * 4;
  c.intra = {head_bytes / (2 * b), 0};  // the head's all-reduce (over 2 ranks, its bytes once) takes 2b
  const double r = head_bytes / c.intra.bus_bandwidth;
  ASSERT_GT(m.layer_params() * 4 / c.intra.bus_bandwidth, 0);
  ASSERT_LT(m.layer_params() * 4 / c.intra.bus_bandwidth, b / 2)
      << "a layer's bucket reduces well within a layer's backward, so the queue catches up";
  o.param_bytes = 4;
  const StepTime queued = predict_time(m, c, o);
  o.param_bytes = 2;
  o.bucket_bytes = m.layer_params() * 2;  // the engine counts a bucket in the compute dtype's bytes
  const StepTime one = predict_time(m, c, o);
  EXPECT_NEAR(one.step_s - queued.step_s, r - b, 1e-9);
  EXPECT_NEAR(one.exposed_s - queued.exposed_s, r - b, 1e-9);
}

// The compute stream by hand: two lanes moving bytes over [1, 3) and [2, 4) at share 0.5
// slow compute to half where one runs and stop it where both do (their shares add); 3 s
// of compute from 0 run 1 s at the full rate, 0.5 in [1, 2), none in [2, 3), 0.5 in [3, 4)
// and the last second after: they end at 5. A span half latency at share 1 halves the rate.
TEST(StepTime, ComputeStreamWalksTheSpansAtTheirShares) {
  using namespace flatshard::plan::sim;
  Lane a, b;
  a.run(1, Cost{2, 0});
  b.run(2, Cost{2, 0});
  ComputeStream both{0.5, {&a, &b}};
  EXPECT_DOUBLE_EQ(both.run(0, 3), 5);
  EXPECT_DOUBLE_EQ(both.contended, 2);
  EXPECT_DOUBLE_EQ(both.run(4, 1), 5);       // after the spans: the full rate
  EXPECT_DOUBLE_EQ(both.run(1.5, 0.25), 2);  // from inside a span: 0.5 s at half the rate
  ComputeStream whole{1, {&a, &b}};
  EXPECT_DOUBLE_EQ(whole.run(0, 2), 5);  // stopped through [1, 4)
  Lane half;
  half.run(0, Cost{4, 2});  // 4 s, 2 of them latency: moving bytes half the time
  ComputeStream latency{1, {&half}};
  EXPECT_DOUBLE_EQ(latency.run(0, 1), 2);
  EXPECT_DOUBLE_EQ(latency.run(1, 3), 5.5);  // 1.5 done by 4, the last 1.5 after
}

// The limit names contention where compute loses at least 5% of the step to collectives
// beside it and more than it waits for them; the same schedule without the share reads
// compute; a link too slow to hide reads by its waits, whatever the share.
TEST(StepTime, TheLimitIsContentionWhereCollectivesSlowComputeMoreThanItWaits) {
  const auto m = gpt(6, 256, 4, 1024, 64);
  Cluster c = h100_cluster(1, 4);
  c.flops = 2e10;  // compute long enough for the collectives to hide behind it
  c.memory_bandwidth = 1e11;
  c.intra = {1e9, 0};
  TimeOptions o;
  o.sequences = 2;
  o.sequence_length = 64;
  o.strategy = Strategy::FullShard;
  c.collective_compute_share = 0;
  const StepTime free = predict_time(m, c, o);
  ASSERT_LT(free.exposed_share(), 0.05);
  EXPECT_EQ(free.limit, "compute");
  c.collective_compute_share = 1;
  const StepTime slowed = predict_time(m, c, o);
  EXPECT_GT(slowed.contended_s, std::max(0.05 * slowed.step_s, slowed.exposed_s));
  EXPECT_EQ(slowed.limit, "contention");
  c.collective_compute_share = 0.01;  // under 5% of the step lost
  const StepTime barely = predict_time(m, c, o);
  EXPECT_GT(barely.contended_s, 0);
  EXPECT_EQ(barely.limit, "compute");
  c.intra = {1e7, 0};  // a link a hundred times slower: compute waits far longer than it is slowed
  c.collective_compute_share = 0.25;
  const StepTime starved = predict_time(m, c, o);
  EXPECT_GT(starved.exposed_s, starved.contended_s);
  EXPECT_EQ(starved.limit, "reductions");  // compute waits for each unit's reduction in backward
}

// Note [The sharded path's own work]: with free links, the sharded strategies' step grows by
// their own work over the shard group (a hybrid rank's group is its node); DDP's and
// ZeRO-1's do not.
TEST(StepTime, TheShardedPathsOwnWorkIsSpreadOverTheShardGroup) {
  const auto m = gpt(6, 256, 4, 1024, 64);
  Cluster c = h100_cluster(2, 4);
  c.flops = 1e11;
  c.intra = c.inter = {1e30, 0};
  TimeOptions o;
  o.sequences = 2;
  o.sequence_length = 64;
  for (Strategy s : {Strategy::FullShard, Strategy::ShardGradOp, Strategy::HybridShard, Strategy::NoShard,
                     Strategy::ShardOptimizerState}) {
    o.strategy = s;
    o.sharding_work_s = 0;
    const double before = predict_time(m, c, o).step_s;
    o.sharding_work_s = 0.4;
    const double after = predict_time(m, c, o).step_s;
    const double group = s == Strategy::HybridShard ? 4 : 8;
    const bool sharded = s != Strategy::NoShard && s != Strategy::ShardOptimizerState;
    EXPECT_NEAR(after - before, sharded ? 0.4 / group : 0.0, 1e-9) << static_cast<int>(s);
    if (sharded) EXPECT_NEAR(predict_time(m, c, o).engine_s, 0.4 / group, 1e-12);
  }
  o.sharding_work_s = -1;
  EXPECT_THROW(predict_time(m, c, o), std::invalid_argument);
}

// Note [ZeRO-1's bucket gradients]: with free links, ZeRO-1's step over 4 ranks is its
// compute, four passes over every parameter's gradient in the compute dtype and its share of
// the optimizer step, at the memory's bandwidth; DDP's is its compute and the whole step.
TEST(StepTime, ZeroOnesBucketGradientsCostFourPassesAtTheMemorysBandwidth) {
  const auto m = gpt(6, 256, 4, 1024, 64);
  Cluster c = h100_cluster(1, 4);
  c.flops = 1e11;
  c.memory_bandwidth = 1e9;
  c.intra = {1e30, 0};
  TimeOptions o;
  o.sequences = 2;
  o.sequence_length = 64;
  o.param_bytes = 2;
  const double params = static_cast<double>(m.params());
  o.strategy = Strategy::NoShard;
  StepTime t = predict_time(m, c, o);
  EXPECT_NEAR(t.step_s, t.forward_s + t.backward_s + params * 28 / 1e9, 1e-9);
  o.strategy = Strategy::ShardOptimizerState;
  t = predict_time(m, c, o);
  EXPECT_NEAR(t.engine_s, params * 4 * 2 / 1e9, 1e-12);
  EXPECT_NEAR(t.step_s, t.forward_s + t.backward_s + t.engine_s + params / 4 * 28 / 1e9, 1e-9);
  c.per_node = 1;  // one rank: DDP's path
  t = predict_time(m, c, o);
  EXPECT_NEAR(t.step_s, t.forward_s + t.backward_s + params * 28 / 1e9, 1e-9);
}

// DDP with buckets smaller than the model: one all-reduce per bucket, in backward's order
// (the head, over DDP's 1 MiB first bucket, alone first: Note [The first bucket]; then a
// bucket a layer, the embeddings closing the last), each paying its own latency; ZeRO-1
// reduce-scatters the same buckets and gathers each behind the step. Six buckets: the
// step is every byte at the ring's cost plus six collectives' latency (one bucket would
// pay it once).
TEST(StepTime, BucketsAreReducedOneByOneEachPayingItsLatency) {
  const auto m = gpt(4, 256, 4, 1024, 64);
  const Cluster c = only_links(1, 4, true);
  TimeOptions o;
  o.reduce_bytes = 4;
  o.param_bytes = 4;
  o.bucket_bytes = m.layer_params() * 4;  // one layer per bucket
  const double bytes = static_cast<double>(m.params()) * 4;
  o.strategy = Strategy::NoShard;
  EXPECT_NEAR(predict_time(m, c, o).step_s, 2 * bytes * 3 / 4 / 1e9 + 6 * 6 * 1e-5, 1e-9);
  o.strategy = Strategy::ShardOptimizerState;
  EXPECT_NEAR(predict_time(m, c, o).step_s, 2 * (bytes * 3 / 4 / 1e9 + 6 * 3 * 1e-5), 1e-9);
  o.bucket_bytes = std::int64_t{1} << 40;  // the head's bucket, then one for the rest
  o.strategy = Strategy::NoShard;
  EXPECT_NEAR(predict_time(m, c, o).step_s, 2 * bytes * 3 / 4 / 1e9 + 2 * 6 * 1e-5, 1e-9);
  o.first_bucket_bytes = o.bucket_bytes;  // one bucket
  EXPECT_NEAR(predict_time(m, c, o).step_s, 2 * bytes * 3 / 4 / 1e9 + 6 * 1e-5, 1e-9);
  // Buckets hold the compute dtype's bytes, as the engine counts them: in bf16 (the head,
  // 0.5 MiB, under the first bucket's 1 MiB) a cap of two layers' fp32 bytes is four
  // layers' bf16 ones: the head and the layers in one bucket, the embeddings in a second.
  // Counted in the reduction's fp32 it would be the head with two layers, two layers, then
  // the embeddings.
  o.param_bytes = 2;
  o.first_bucket_bytes = std::int64_t{1} << 20;
  o.bucket_bytes = 2 * m.layer_params() * 4;
  EXPECT_NEAR(predict_time(m, c, o).step_s, 2 * bytes * 3 / 4 / 1e9 + 2 * 6 * 1e-5, 1e-9);
  o.first_bucket_bytes = 0;
  EXPECT_THROW(predict_time(m, c, o), std::invalid_argument);
}

// Hybrid sharding on 2 nodes of 2 devices, in groups of 2: gathers and reduce-scatters run
// over the node's link among 2 ranks, and each unit's reduced shard (half its gradient) is
// all-reduced across the 2 replicas on the link between nodes. With one link free the step
// is the other link's collectives, one after another, at their ring costs.
TEST(StepTime, HybridShardingRunsEachLevelOnItsOwnLink) {
  const auto m = gpt(4, 256, 4, 1024, 64);
  TimeOptions o;
  o.strategy = Strategy::HybridShard;
  o.shard_group_size = 2;
  o.param_bytes = 2;
  o.reduce_bytes = 4;
  const double layer = static_cast<double>(m.layer_params()), root = static_cast<double>(m.root_params());
  const double params = static_cast<double>(m.params());
  // Only the link across nodes costs: every unit's all-reduce of elements * 4 / 2 bytes
  // over 2 replicas moves those bytes once and takes 2 latencies.
  StepTime t = predict_time(m, only_links(2, 2, false), o);
  EXPECT_NEAR(t.step_s, params * 4 / 2 / 1e9 + (m.layers + 1) * 2 * 1e-5, 1e-9);
  EXPECT_EQ(t.limit, "reductions");
  // Only the node's link costs: full shard's collectives among 2 ranks (half the bytes
  // cross, one latency each), not among 4.
  const auto ring = [&](double bytes) { return bytes / 2 / 1e9 + 1e-5; };
  const double collectives =
      ring(root * 2) + 2 * m.layers * ring(layer * 2) + m.layers * ring(layer * 4) + ring(root * 4);
  t = predict_time(m, only_links(2, 2, true), o);
  EXPECT_NEAR(t.step_s, collectives, 1e-9);
  EXPECT_NEAR(t.communication_s, collectives, 1e-9);
}

// Note [Rings across nodes]: a ring over ranks of several nodes sends across nodes on as
// many NICs as it has ranks on each node, up to the node's own link; a ring with one rank
// per node (hybrid's replicas of node-sized groups) on one. Groups that would straddle
// nodes are refused.
TEST(StepTime, RingsAcrossNodesSendOnEveryNicOfTheNode) {
  const auto m = gpt(4, 256, 4, 1024, 64);
  TimeOptions o;
  o.strategy = Strategy::FullShard;
  o.param_bytes = 2;
  o.reduce_bytes = 4;
  const double layer = static_cast<double>(m.layer_params()), root = static_cast<double>(m.root_params());
  // Only the links across nodes cost (1 GB/s and 10 us a step per device): full shard over
  // 2 nodes of 2 runs its rings over 4 ranks at 2 GB/s, 10 us a step.
  const auto ring = [&](double bytes, double bandwidth, int ranks) {
    return bytes * (ranks - 1) / ranks / bandwidth + (ranks - 1) * 1e-5;
  };
  const double full = ring(root * 2, 2e9, 4) + 2 * m.layers * ring(layer * 2, 2e9, 4) +
                      m.layers * ring(layer * 4, 2e9, 4) + ring(root * 4, 2e9, 4);
  EXPECT_NEAR(predict_time(m, only_links(2, 2, false), o).step_s, full, 1e-9);
  // Over 4 nodes of 4 in groups of 2, the replicas (8 ranks, 2 on each node) also run at
  // 2 GB/s; in groups of 4, one rank on each node, at 1 GB/s.
  o.strategy = Strategy::HybridShard;
  const double params = static_cast<double>(m.params());
  for (int group : {2, 4}) {
    o.shard_group_size = group;
    const int replicas = 16 / group;
    const double bandwidth = group == 2 ? 2e9 : 1e9;
    const double all_reduce = 2 * params * 4 / group * (replicas - 1) / replicas / bandwidth +
                              (m.layers + 1) * 2 * (replicas - 1) * 1e-5;
    EXPECT_NEAR(predict_time(m, only_links(4, 4, false), o).step_s, all_reduce, 1e-9)
        << "groups of " << group;
  }
  // An all-reduce's own bus bandwidth on the node's link bounds the world's ring too.
  o.strategy = Strategy::NoShard;
  o.shard_group_size = 0;
  Cluster nodes = only_links(2, 2, false);
  const double plain = predict_time(m, nodes, o).step_s;
  nodes.intra.all_reduce_bus_bandwidth = 0.5e9;
  EXPECT_GT(predict_time(m, nodes, o).step_s, 3 * plain) << "the ring at 0.5 GB/s, not 2";
  // Decentralized training's exchange is no ring: across nodes a rank at a node's edge sends
  // one neighbour's 4 bytes a parameter on its NIC (1 GB/s) and the other's within the
  // node, side by side; with one rank a node, both on its NIC.
  o.decentralized_every = 1;
  EXPECT_NEAR(predict_time(m, only_links(2, 2, false), o).step_s, 4 * params / 1e9 + 1e-5, 1e-9);
  EXPECT_NEAR(predict_time(m, only_links(3, 1, false), o).step_s, 2 * 4 * params / 1e9 + 2 * 1e-5, 1e-9);
  o.decentralized_every = 0;
  o.strategy = Strategy::HybridShard;
  // Groups of 3 or 6 over nodes of 4 would straddle them; within one node any divisor goes.
  o.shard_group_size = 6;
  Cluster c = only_links(3, 4, false);
  EXPECT_FALSE(groups_fit_nodes(c, 6));
  EXPECT_THROW(predict_time(m, c, o), std::invalid_argument);
  EXPECT_TRUE(groups_fit_nodes(c, 2));
  EXPECT_TRUE(groups_fit_nodes(c, 8));
  EXPECT_TRUE(groups_fit_nodes(only_links(1, 6, false), 3));
}

// Offloaded, the host steps the masters at its memory's bandwidth (AdamW: 28 bytes per
// parameter, 2 more writing the bf16 copy), and the shards cross the host link: with
// everything else free the step is that step; with the host free, each copy one after
// another on its direction's queue (shard-grad-op at world 1: every unit's bf16 shard to
// the device in forward, then every fp32 gradient back, 6 bytes per parameter in all).
TEST(StepTime, OffloadIsTheHostStepAndTheCopiesEachWay) {
  const auto m = gpt(4, 256, 4, 1024, 64);
  const double params = static_cast<double>(m.params());
  Cluster c = only_links(1, 1, true);
  TimeOptions o;
  o.offload = true;
  o.param_bytes = 2;
  c.pcie = {1e30, 0};
  c.host_bandwidth = 1e9;
  for (Strategy s : {Strategy::FullShard, Strategy::NoShard, Strategy::ShardOptimizerState}) {
    o.strategy = s;
    o.offload_bf16_copy = true;
    StepTime t = predict_time(m, c, o);
    EXPECT_NEAR(t.step_s, params * 30 / 1e9, 1e-9);
    EXPECT_NEAR(t.optimizer_s, params * 30 / 1e9, 1e-9);
    EXPECT_EQ(t.limit, "host step");
    o.offload_bf16_copy = false;  // the fp32 masters cross: no copy to write
    EXPECT_NEAR(predict_time(m, c, o).step_s, params * 28 / 1e9, 1e-9);
  }
  c.pcie = {1e9, 0};
  c.host_bandwidth = 1e30;
  o.offload_bf16_copy = true;
  o.strategy = Strategy::ShardGradOp;
  StepTime t = predict_time(m, c, o);
  EXPECT_NEAR(t.step_s, params * 6 / 1e9, 1e-9);
  EXPECT_NEAR(t.copies_s, params * 6 / 1e9, 1e-9);
  EXPECT_EQ(t.limit, "host copies");
  o.strategy = Strategy::NoShard;  // one bucket: its fp32 average to the host, its bf16 copy back
  o.bucket_bytes = std::int64_t{1} << 40;
  EXPECT_NEAR(predict_time(m, c, o).step_s, params * 6 / 1e9, 1e-9);
  c.host_bandwidth = 0;
  EXPECT_THROW(predict_time(m, c, o), std::invalid_argument);
}

// At 4 ranks each copies and steps its own share: a quarter of every unit under the sharded
// strategies and ZeRO-1, the whole model under DDP.
TEST(StepTime, OffloadedRanksCopyAndStepTheirShare) {
  const auto m = gpt(4, 256, 4, 1024, 64);
  const double params = static_cast<double>(m.params());
  Cluster c = only_links(1, 4, true);
  c.intra = {1e30, 0};
  TimeOptions o;
  o.offload = true;
  o.param_bytes = 2;
  c.pcie = {1e30, 0};
  c.host_bandwidth = 1e9;
  for (Strategy s : {Strategy::FullShard, Strategy::ShardGradOp, Strategy::ShardOptimizerState}) {
    o.strategy = s;
    EXPECT_NEAR(predict_time(m, c, o).step_s, params / 4 * 30 / 1e9, 1e-9);
  }
  o.strategy = Strategy::NoShard;
  EXPECT_NEAR(predict_time(m, c, o).step_s, params * 30 / 1e9, 1e-9);
  c.pcie = {1e9, 0};
  c.host_bandwidth = 1e30;
  o.strategy = Strategy::ShardGradOp;
  EXPECT_NEAR(predict_time(m, c, o).step_s, params / 4 * 6 / 1e9, 1e-9);
}

// Stepping in backward, each unit's host step runs beside the backward of the units after
// it: with a host step no longer than a layer's backward, only the last layer's and the
// root's (whose gradients land as backward ends) are left after it; stepping after
// backward adds every unit's.
TEST(StepTime, SteppingInBackwardHidesTheHostStepBehindBackward) {
  const auto m = gpt(4, 256, 4, 1024, 64);
  Cluster c = one_device(1e12);
  c.pcie = {1e30, 0};
  TimeOptions o;
  o.offload = true;
  o.strategy = Strategy::FullShard;
  o.sequences = 1;
  o.sequence_length = 64;
  const StepTime plain = predict_time(m, c, o);
  const double layer_bwd = plain.backward_s / m.layers;  // about: the head's share is small
  c.host_bandwidth = static_cast<double>(m.layer_params()) * 30 / (0.5 * layer_bwd);
  const StepTime after = predict_time(m, c, o);
  o.step_in_backward = true;
  const StepTime during = predict_time(m, c, o);
  const double compute = after.forward_s + after.backward_s;
  EXPECT_NEAR(after.step_s, compute + static_cast<double>(m.params()) * 30 / c.host_bandwidth, 1e-12);
  EXPECT_NEAR(during.step_s,
              compute + static_cast<double>(m.layer_params() + m.root_params()) * 30 / c.host_bandwidth,
              1e-12);
  EXPECT_NEAR(during.optimizer_s, after.optimizer_s, 1e-12);
  EXPECT_NEAR(during.exposed_s, 0, 1e-12) << "the host's step is not time spent waiting for communication";
}

// MFU counts the model's FLOPs (three forwards' worth), not the recomputed ones: on one
// device with a free optimizer it is the sustained over the peak throughput, and
// recomputation lowers it.
TEST(StepTime, MfuIsTheModelsFlopsOverThePeak) {
  const auto m = gpt(8, 512, 8, 8192, 1024);
  Cluster c = one_device(400e12);
  c.peak_flops = 1000e12;
  c.memory_bandwidth = 1e30;
  TimeOptions o;
  o.sequences = 4;
  o.sequence_length = 1024;
  const StepTime t = predict_time(m, c, o);
  EXPECT_NEAR(t.mfu, 0.4, 1e-3);
  o.recompute = Recompute::Full;
  const StepTime r = predict_time(m, c, o);
  EXPECT_NEAR(r.mfu, t.mfu * t.step_s / r.step_s, 1e-12);
  EXPECT_LT(r.mfu, 0.35);
}

// Note [Rings across nodes]: a ring over the world runs on every NIC of a node at once, so
// across nodes full shard's gathers and reductions move as many bytes per node as hybrid
// sharding's all-reduce of fp32 shards, and at 16 nodes they are even within a few percent.
// Where the world's rings grow long (1,024 GPUs) their ring steps' latency takes over, and
// hybrid sharding, whose gathers and reduce-scatters stay within a node, wins by far.
TEST(StepTime, HybridShardingWinsWhereRingsAcrossNodesGrowLong) {
  TimeOptions o;
  o.sequences = 16;
  o.sequence_length = 1024;
  const auto tokens = [&](int nodes, Strategy s) {
    o.strategy = s;
    o.shard_group_size = s == Strategy::HybridShard ? 8 : 0;
    return predict_time(gpt_1b(), h100_cluster(nodes, 8), o).tokens_per_s;
  };
  EXPECT_NEAR(tokens(16, Strategy::HybridShard) / tokens(16, Strategy::FullShard), 1.0, 0.1);
  EXPECT_GT(tokens(128, Strategy::HybridShard), 1.5 * tokens(128, Strategy::FullShard));
  o.strategy = Strategy::HybridShard;
  o.shard_group_size = 3;  // does not divide 128
  EXPECT_THROW(predict_time(llama3_8b(), h100_cluster(16, 8), o), std::invalid_argument);
}

// Activations from the shapes: the loss's logits and each layer's share, halved by selective
// recomputation, down to a layer's input per layer under full recomputation.
TEST(StepTime, ActivationEstimatesFollowTheShapesAndTheRecomputation) {
  const auto m = llama3_8b();
  TimeOptions o;
  o.sequences = 1;
  o.sequence_length = 1000;
  const double logits = 10.0 * 128256 * 1000;
  const double layer = (18.0 * 4096 + 8.0 * 14336) * 1000;
  EXPECT_NEAR(static_cast<double>(estimate_activation_bytes(m, o)), 32 * layer + logits, 2);
  o.recompute = Recompute::Selective;
  EXPECT_NEAR(static_cast<double>(estimate_activation_bytes(m, o)), 16 * layer + logits, 2);
  o.recompute = Recompute::Full;
  EXPECT_NEAR(static_cast<double>(estimate_activation_bytes(m, o)), 32 * 2.0 * 4096 * 1000 + layer + logits,
              2);
  // In fp32 every activation doubles; the logits are 4-byte, beside the same fp32
  // log-probabilities and gradient.
  o.recompute = Recompute::None;
  o.param_bytes = 4;
  EXPECT_NEAR(static_cast<double>(estimate_activation_bytes(m, o)), 32 * layer * 2 + 12.0 * 128256 * 1000, 2);
}

// plan_cluster gives every strategy (hybrid in groups of a node up to half the world) its
// step and its memory; fastest_that_fits takes the most tokens/s among those within the
// device's memory, and none when nothing fits.
TEST(StepTime, PlanClusterGivesEveryStrategyItsTimeAndMemory) {
  const auto m = llama3_8b();
  const Cluster c = h100_cluster(4, 8);
  TimeOptions base;
  base.sequences = 2;
  base.sequence_length = 8192;
  base.recompute = Recompute::Selective;
  const auto rows = plan_cluster(m, c, base, std::int64_t{96} << 30);
  std::vector<std::string> names;
  for (const auto& r : rows) names.push_back(r.name);
  EXPECT_EQ(names, (std::vector<std::string>{"full shard", "shard-grad-op", "hybrid (groups of 8)",
                                             "hybrid (groups of 16)", "ZeRO-1", "DDP"}));
  const StrategyPlan* best = nullptr;
  for (const auto& r : rows) {
    EXPECT_NEAR(r.time.step_s, predict_time(m, c, r.options).step_s, 1e-12) << r.name;
    EXPECT_EQ(r.fits, r.memory.peak <= (std::int64_t{96} << 30)) << r.name;
    if (r.fits && (!best || r.time.tokens_per_s > best->time.tokens_per_s)) best = &r;
  }
  EXPECT_EQ(rows[2].options.shard_group_size, 8);
  EXPECT_FALSE(rows.back().fits) << "8B under DDP holds 16 bytes per parameter on every device";
  ASSERT_NE(best, nullptr);
  EXPECT_EQ(fastest_that_fits(rows), best);
  EXPECT_EQ(fastest_that_fits(plan_cluster(m, c, base, std::int64_t{1} << 30)), nullptr);
  // A group the options name (flatshard-plan --group) is listed too, once, in its order; one
  // that does not divide the world is not.
  for (const auto& [group, expected] : std::vector<std::pair<int, std::vector<int>>>{
           {1, {1, 8, 16}}, {4, {4, 8, 16}}, {8, {8, 16}}, {12, {8, 16}}, {32, {8, 16}}}) {
    TimeOptions named = base;
    named.shard_group_size = group;
    std::vector<int> listed;
    for (const auto& r : plan_cluster(m, c, named, std::int64_t{96} << 30)) {
      if (r.options.strategy != Strategy::HybridShard) continue;
      listed.push_back(r.options.shard_group_size);
      EXPECT_EQ(r.name, fmt::format("hybrid (groups of {})", r.options.shard_group_size));
      EXPECT_NEAR(r.time.step_s, predict_time(m, c, r.options).step_s, 1e-12) << r.name;
    }
    EXPECT_EQ(listed, expected) << "--group " << group;
  }
}

// Each hook's bytes, from its code (src/comm/hooks.cpp), on a GPT small enough to count by
// hand: gpt(2, 64, 4, 512, 16), one bucket, 4 ranks, compute free. int8 and top-k run two
// all-gathers each (codes and scales; values and indices), each paying its latency. PowerSGD at
// rank 4 compresses every matrix: per layer P holds 4 x (192 + 64 + 256 + 64) values and Q
// 4 x (64 + 64 + 64 + 256), its 640 vector values go whole; the root's wte (512 x 64), wpe
// (16 x 64) and head (512 x 64) add 4 x (512 + 16 + 512) to P and 4 x 3 x 64 to Q, ln_f
// 128 whole.
TEST(StepTime, HooksSendWhatTheirAlgorithmSends) {
  const auto m = gpt(2, 64, 4, 512, 16);
  const Cluster c = only_links(1, 4, true);
  TimeOptions o;
  o.strategy = Strategy::NoShard;
  o.param_bytes = o.reduce_bytes = 4;
  o.bucket_bytes = std::int64_t{1} << 40;
  const double n = static_cast<double>(m.params());
  const auto all_reduce = [](double bytes) { return 2 * bytes * 3 / 4 / 1e9 + 6 * 1e-5; };
  const auto all_gather = [](double bytes) { return bytes * 3 / 4 / 1e9 + 3 * 1e-5; };
  const auto step = [&](const std::string& hook) {
    o.hook = parse_hook_model(hook);
    return predict_time(m, c, o).communication_s;
  };
  EXPECT_NEAR(step("none"), all_reduce(4 * n), 1e-12);
  EXPECT_NEAR(step("all_reduce"), all_reduce(4 * n), 1e-12);
  EXPECT_NEAR(step("bf16"), all_reduce(2 * n), 1e-12);
  EXPECT_NEAR(step("int8:64"), all_gather(4 * n) + all_gather(4 * 4 * std::ceil(n / 64)), 1e-12);
  EXPECT_NEAR(step("top_k:0.01"), 2 * all_gather(4 * 4 * std::ceil(0.01 * n)), 1e-12);
  EXPECT_NEAR(step("random_k:0.01"), all_reduce(4 * std::ceil(0.01 * n)), 1e-12);
  const double p = 2 * 4 * (192 + 64 + 256 + 64) + 4 * (512 + 16 + 512);
  const double q = 2 * 4 * (64 + 64 + 64 + 256) + 4 * 3 * 64;
  const double whole = 2 * 640 + 128;
  EXPECT_NEAR(step("power_sgd:4:10"), all_reduce(4 * (p + whole)) + all_reduce(4 * q), 1e-12);
  // Under ZeRO-1 a hook's all-reduce replaces the reduce-scatter; the step's gathers stay.
  o.strategy = Strategy::ShardOptimizerState;
  EXPECT_NEAR(step("bf16"), all_reduce(2 * n) + all_gather(4 * n), 1e-12);
  EXPECT_NEAR(step("none"), all_gather(4 * n) + all_gather(4 * n), 1e-12);
  for (const char* bad : {"bf8", "top_k", "top_k:2", "int8:x", "int8:inf", "power_sgd:0", "power_sgd:1e10",
                          "power_sgd:4:x", "bf16:1"})
    EXPECT_THROW(parse_hook_model(bad), std::invalid_argument) << bad;
}

// A hook's compression and decompression are passes over the bucket on compute's path, as
// its code moves the bytes (Note [Communication algorithms in the step-time model]): with
// the link free, bf16 divides and casts (14 bytes a value) and casts back (6); top-k adds
// error feedback (12), selects in two passes (8), zero fills, divides and copies the sum
// (20) and widens and adds each value received from each rank (32); random-k adds error
// feedback (12), draws and selects (32 a value sent), zero fills (4) and scatters (16).
TEST(StepTime, HookWorkIsPassesOverTheBucketAtTheMemorysBandwidth) {
  const auto m = gpt(2, 64, 4, 512, 16);
  Cluster c = only_links(1, 4, false);  // the node's link free
  c.memory_bandwidth = 1e9;
  TimeOptions o;
  o.strategy = Strategy::NoShard;
  o.param_bytes = o.reduce_bytes = 4;
  o.bucket_bytes = std::int64_t{1} << 40;
  const double n = static_cast<double>(m.params());
  const StepTime plain = predict_time(m, c, o);
  o.hook = parse_hook_model("bf16");
  StepTime t = predict_time(m, c, o);
  EXPECT_NEAR(t.step_s - plain.step_s, 20 * n / 1e9, 1e-12);
  EXPECT_NEAR(t.engine_s, 20 * n / 1e9, 1e-12);
  const double k = std::ceil(0.01 * n);
  o.hook = parse_hook_model("top_k:0.01");
  EXPECT_NEAR(predict_time(m, c, o).step_s - plain.step_s, (40 * n + 32 * 4 * k) / 1e9, 1e-12);
  o.hook = parse_hook_model("random_k:0.01");
  EXPECT_NEAR(predict_time(m, c, o).step_s - plain.step_s, (16 * n + 48 * k) / 1e9, 1e-12);
  // Measured (TimeOptions::hook_work_s: the whole model on one rank alone) it replaces the
  // passes: bf16's work does not grow with the ranks; top-k's finish does (32 per value
  // received from each of 4 ranks, where one rank alone receives its own).
  o.hook = parse_hook_model("bf16");
  o.hook_work_s = 0.25;
  EXPECT_NEAR(predict_time(m, c, o).step_s - plain.step_s, 0.25, 1e-12);
  o.hook = parse_hook_model("top_k:0.01");
  EXPECT_NEAR(predict_time(m, c, o).step_s - plain.step_s, 0.25 * (40 * n + 32 * 4 * k) / (40 * n + 32 * k),
              1e-12);
  // One rank alone reduces nothing, hook or not.
  o.hook_work_s = 0;
  EXPECT_NEAR(predict_time(m, only_links(1, 1, false), o).engine_s, 0, 1e-15);
}

// Staleness: a bucket reduced while the next steps compute. On a link whose all-reduce
// takes less than a step's compute, the step is its compute and the two copies of each
// bucket (into the copy that is reduced, and the average of s steps before back: a read
// and a write each), with nothing exposed; without staleness the whole all-reduce shows.
// On a link slower than the compute the step is the link's time: nothing waits for its own
// reduction, but the reductions cannot run faster than the link.
TEST(StepTime, StalenessHidesTheReductionWhereTheLinkKeepsUpWithCompute) {
  const auto m = gpt(2, 64, 4, 512, 16);
  Cluster c = only_links(1, 4, true);
  const double n = static_cast<double>(m.params());
  TimeOptions o;
  o.strategy = Strategy::NoShard;
  o.param_bytes = o.reduce_bytes = 4;
  o.bucket_bytes = std::int64_t{1} << 40;
  o.sequences = 4;
  o.sequence_length = 16;
  c.flops = 1e9;
  c.memory_bandwidth = 1e12;
  const double link = 2 * 4 * n * 3 / 4 / 1e9 + 6 * 1e-5;
  const StepTime sync = predict_time(m, c, o);
  const double compute = sync.forward_s + sync.backward_s + sync.optimizer_s;
  ASSERT_LT(link, compute) << "the test's link keeps up with compute";
  EXPECT_NEAR(sync.step_s, compute + link, 1e-9);
  EXPECT_NEAR(sync.exposed_s, link, 1e-9);
  const double copies = 2 * 8 * n / 1e12;
  for (int s : {1, 3, 8}) {
    o.staleness = s;
    const StepTime late = predict_time(m, c, o);
    EXPECT_NEAR(late.step_s, compute + copies, 1e-9) << s;
    EXPECT_NEAR(late.exposed_s, 0, 1e-12) << s;
    EXPECT_NEAR(late.communication_s, link, 1e-12) << s;
  }
  o.staleness = 9;  // FullyShardOptions::kMaxStaleness is 8
  EXPECT_THROW(predict_time(m, c, o), std::invalid_argument);
  // One bucket per layer, each held until the last is finished (bf16 parameters: one in
  // flight): the buckets finished are those of the step before, long done.
  o.param_bytes = 2;
  o.bucket_bytes = m.layer_params() * 4;
  o.staleness = 0;
  const StepTime layered = predict_time(m, c, o);
  EXPECT_GT(layered.exposed_s, 0) << "without staleness the last bucket's all-reduce shows";
  o.staleness = 1;
  const StepTime hidden = predict_time(m, c, o);
  EXPECT_NEAR(hidden.exposed_s, 0, 1e-12);
  EXPECT_NEAR(hidden.step_s, layered.forward_s + layered.backward_s + layered.optimizer_s + copies, 1e-9);
  EXPECT_NEAR(hidden.communication_s, layered.communication_s, 1e-12);
  o.param_bytes = 4;
  o.bucket_bytes = std::int64_t{1} << 40;
  c.intra.bus_bandwidth = 6 * n / (4 * compute);  // each all-reduce's bytes take four times the compute
  const double slow = 4 * compute + 6 * 1e-5;
  o.staleness = 1;
  const StepTime bound = predict_time(m, c, o);
  EXPECT_NEAR(bound.step_s, slow, 1e-6 * slow);
  EXPECT_NEAR(bound.exposed_s, slow - compute - copies, 1e-6 * slow);
}

// Decentralized training: no gradient averaged; every k-th step each rank sends its fp32
// parameters to its two ring neighbours (one send at 2 ranks) from the step's start, and
// averages the three copies (32 bytes per parameter) before the optimizer. With compute
// free the step is those sends; every second step halves it. With compute the exchange runs
// beside forward and backward: the step is the longer of the two, then the average and
// the optimizer.
TEST(StepTime, DecentralizedTrainingSendsTheParametersToEachNeighbour) {
  const auto m = gpt(2, 64, 4, 512, 16);
  const double params = static_cast<double>(m.params()), bytes = 4.0 * params;
  TimeOptions o;
  o.strategy = Strategy::NoShard;
  o.param_bytes = 2;
  for (int n : {2, 4}) {
    const Cluster c = only_links(1, n, true);
    const double sends = n == 2 ? 1 : 2;
    o.decentralized_every = 1;
    StepTime t = predict_time(m, c, o);
    EXPECT_NEAR(t.step_s, sends * (bytes / 1e9 + 1e-5), 1e-12) << n;
    EXPECT_NEAR(t.exposed_share(), 1, 1e-9) << n;
    o.decentralized_every = 2;
    t = predict_time(m, c, o);
    EXPECT_NEAR(t.step_s, sends * (bytes / 1e9 + 1e-5) / 2, 1e-12) << n;
  }
  Cluster c = only_links(1, 4, true);
  c.flops = 1e9;
  c.memory_bandwidth = 1e11;
  o.sequences = 4;
  o.sequence_length = 16;
  o.decentralized_every = 1;
  for (double bus : {1e9, 1e7}) {  // the exchange shorter than forward and backward, then longer
    c.intra.bus_bandwidth = bus;
    const StepTime t = predict_time(m, c, o);
    const double exchange = 2 * (bytes / bus + 1e-5), compute = t.forward_s + t.backward_s;
    EXPECT_NEAR(t.step_s, std::max(exchange, compute) + 32 * params / 1e11 + t.optimizer_s, 1e-9) << bus;
    EXPECT_NEAR(t.exposed_s, std::max(0.0, exchange - compute), 1e-9) << bus;
    EXPECT_NEAR(t.engine_s, 32 * params / 1e11, 1e-12) << bus;
  }
  // The refusals of the engine (docs/communication.md, What combines).
  o.staleness = 1;
  EXPECT_THROW(predict_time(m, only_links(1, 4, true), o), std::invalid_argument);
  o.staleness = 0;
  o.offload = true;
  EXPECT_THROW(predict_time(m, only_links(1, 4, true), o), std::invalid_argument);
  o.offload = false;
  o.hook = parse_hook_model("bf16");
  EXPECT_THROW(predict_time(m, only_links(1, 4, true), o), std::invalid_argument);
  o.hook = {};
  o.strategy = Strategy::ShardOptimizerState;
  EXPECT_THROW(predict_time(m, only_links(1, 4, true), o), std::invalid_argument);
  o.decentralized_every = 0;
  o.strategy = Strategy::FullShard;
  o.staleness = 1;
  EXPECT_THROW(predict_time(m, only_links(1, 4, true), o), std::invalid_argument);
  o.staleness = 0;
  o.hook = parse_hook_model("bf16");
  EXPECT_THROW(predict_time(m, only_links(1, 4, true), o), std::invalid_argument);
  o.strategy = Strategy::HybridShard;
  o.shard_group_size = 4;  // one group: nothing across groups for the hook
  EXPECT_THROW(predict_time(m, only_links(1, 4, true), o), std::invalid_argument);
}

// Under HybridShard the engine hands each unit's shard to the hook when it finishes the
// unit's reduce-scatter, and finishes the hook at the unit after (Note [Hooks across shard
// groups]): with compute free and the link within groups free, every unit's rounds show in
// the step, bf16's all-reduce of
// each shard at 2 bytes a value across 2 replicas. PowerSGD compresses only the matrices
// wholly inside a shard: halving a GPT layer (ln1, qkv, proj, ln2, fc, out) between the 2
// ranks of a group cuts fc, and each half sends its piece of it whole.
TEST(StepTime, HybridRunsEachUnitsHookOnItsShardBesideTheNextUnitsBackward) {
  const auto m = gpt(2, 64, 4, 512, 16);
  const Cluster c = only_links(2, 2, false);  // across nodes 1 GB/s, 10 us a step
  TimeOptions o;
  o.strategy = Strategy::HybridShard;
  o.param_bytes = o.reduce_bytes = 4;
  const double layer = static_cast<double>(m.layer_params()), root = static_cast<double>(m.root_params());
  const auto all_reduce = [](double bytes) { return 2 * bytes / 2 / 1e9 + 2 * 1e-5; };
  o.hook = parse_hook_model("bf16");
  StepTime t = predict_time(m, c, o);
  const double rounds = 2 * all_reduce(2 * layer / 2) + all_reduce(2 * root / 2);
  EXPECT_NEAR(t.communication_s, rounds, 1e-12);
  EXPECT_NEAR(t.exposed_s, rounds, 1e-12);
  EXPECT_NEAR(t.step_s, rounds, 1e-12);
  // A layer's halves (49,792 values): [ln1 128, qkv 12,288, proj 4,096 + 64, ln2 128, fc
  // 8,192 of its 16,384 | the rest of fc, its bias 256, out 16,384, its bias 64]. The first
  // compresses qkv and proj (P 4 x (192 + 64), Q 4 x (64 + 64)) and sends 8,512 whole; the
  // second compresses out (P 4 x 64, Q 4 x 256) and sends 8,512 whole: the first sends more.
  // The root's halves: [wte, 576 of wpe | the rest of wpe, ln_f, head], each a 512 x 64
  // matrix (P 4 x 512, Q 4 x 64) and 576 whole.
  o.hook = parse_hook_model("power_sgd:4");
  t = predict_time(m, c, o);
  const double layers = 2 * (all_reduce(4 * (1024 + 8512)) + all_reduce(4 * 512));
  EXPECT_NEAR(t.communication_s, layers + all_reduce(4 * (2048 + 576)) + all_reduce(4 * 256), 1e-12);
  EXPECT_NEAR(t.step_s, t.communication_s, 1e-12);
  // With compute, a unit's hook runs beside the next unit's backward: on 4 layers, the
  // hooks of layers 3 and 2 hide behind layers 1 and 0; layer 1's starts when backward's
  // compute is done, layer 0's with the root's reduction, and the root's runs at once.
  const auto deep = gpt(4, 64, 4, 512, 16);
  Cluster busy = c;
  busy.flops = 1e9;
  o.sequences = 4;
  o.sequence_length = 16;
  o.hook = parse_hook_model("bf16");
  t = predict_time(deep, busy, o);
  const double unit = all_reduce(2 * static_cast<double>(deep.layer_params()) / 2);
  const double root_round = all_reduce(2 * static_cast<double>(deep.root_params()) / 2);
  ASSERT_LT(unit, t.backward_s / 4) << "a unit's rounds fit in a unit's backward";
  EXPECT_NEAR(t.communication_s, 4 * unit + root_round, 1e-12);
  EXPECT_NEAR(t.exposed_s, 2 * unit + root_round, 1e-9);
}

// Note [Ranks drifting apart]: a round a rank issues and waits for at once (a hook's second
// round, PowerSGD's Q; backward's last round) starts when the last rank issues it,
// peer_lag_s * sqrt(T / peer_lag_interval_s) after the mean rank, T the work since the
// ranks last met; the rounds issued ahead of their waits do not move.
TEST(StepTime, RanksDriftingApartDelayTheRoundsWaitedForAtOnce) {
  const auto m = gpt(4, 64, 4, 512, 16);
  Cluster c = only_links(1, 2, true);  // 1 GB/s, 10 us a step
  c.flops = 1e9;
  TimeOptions o;
  o.sequences = 4;
  o.sequence_length = 16;
  o.param_bytes = o.reduce_bytes = 4;
  o.bucket_bytes = std::int64_t{1} << 40;  // DDP's gradients in one bucket
  const auto lagged = [&](TimeOptions with, double lag, double interval) {
    with.peer_lag_s = lag;
    with.peer_lag_interval_s = interval;
    return predict_time(m, c, with);
  };
  // One lag (1 ms after 10 ms of work) after T, the step's forward and backward: between
  // half the step before the optimizer's and all of it; under DDP, whose ranks last met at
  // the step before's last round, T also holds the optimizer's step: between half the step
  // before the optimizer's and the whole step. Returns the step's growth.
  const auto expect_one_lag = [](const StepTime& base, const StepTime& drifting,
                                 bool spans_the_step = false) {
    const double grown = drifting.step_s - base.step_s;
    const double before = base.step_s - base.optimizer_s;
    EXPECT_GT(grown, 1e-3 * std::sqrt(0.5 * before / 0.01));
    EXPECT_LT(grown, 1e-3 * std::sqrt((spans_the_step ? base.step_s : before) / 0.01));
    return grown;
  };
  // Every strategy, with and without a one-round hook: the last round of backward starts
  // when the last rank issues it, after the step's forward and backward (T, between half the
  // step before the optimizer's and all of it): the step and its exposed communication grow
  // by the lag after T, once.
  for (Strategy s : {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard,
                     Strategy::ShardOptimizerState, Strategy::HybridShard}) {
    for (const char* hook : {"none", "bf16"}) {
      TimeOptions x = o;
      x.strategy = s;
      x.shard_group_size = 1;
      if (std::string(hook) != "none" && s != Strategy::NoShard && s != Strategy::ShardOptimizerState &&
          s != Strategy::HybridShard)
        continue;
      x.hook = parse_hook_model(hook);
      SCOPED_TRACE(::testing::Message() << static_cast<int>(s) << " " << hook);
      const StepTime base = predict_time(m, c, x);
      const StepTime drifting = lagged(x, 1e-3, 0.01);
      const double grown = expect_one_lag(base, drifting, s == Strategy::NoShard);
      EXPECT_NEAR(drifting.exposed_s - base.exposed_s, grown, 1e-12);
    }
  }
  // DDP's ranks do not meet between backward's last round and the next one: with an
  // optimizer's step three times the rest of the step (a slow memory), the lag counts it
  // (T past the step before the optimizer's), where ZeRO-1's ranks meet at its gathers.
  {
    Cluster slow = c;
    slow.memory_bandwidth = 1e9;
    TimeOptions x = o;
    x.strategy = Strategy::NoShard;
    const StepTime probe = predict_time(m, slow, x);
    slow.memory_bandwidth *= probe.optimizer_s / (3 * (probe.step_s - probe.optimizer_s));
    const StepTime base = predict_time(m, slow, x);
    ASSERT_GT(base.optimizer_s, 2.5 * (base.step_s - base.optimizer_s));
    x.peer_lag_s = 1e-3;
    x.peer_lag_interval_s = 0.01;
    const double grown = expect_one_lag(base, predict_time(m, slow, x), true);
    EXPECT_GT(grown, 1e-3 * std::sqrt(base.optimizer_s / 0.01));
    TimeOptions z = x;
    z.strategy = Strategy::ShardOptimizerState;
    z.peer_lag_s = 0;
    const StepTime zero1 = predict_time(m, slow, z);
    z.peer_lag_s = 1e-3;
    expect_one_lag(zero1, predict_time(m, slow, z));
  }
  // Under staleness the end of backward waits for rounds issued steps before: no meeting,
  // nothing added. One rank meets no one.
  TimeOptions stale = o;
  stale.strategy = Strategy::NoShard;
  stale.staleness = 1;
  EXPECT_EQ(lagged(stale, 1e-3, 0.01).step_s, predict_time(m, c, stale).step_s);
  TimeOptions exchanging = o;  // decentralized training waits only for its exchange
  exchanging.strategy = Strategy::NoShard;
  exchanging.decentralized_every = 2;
  EXPECT_EQ(lagged(exchanging, 1e-3, 0.01).step_s, predict_time(m, c, exchanging).step_s);
  // Many buckets, one in flight (bf16 parameters) and a head over the first bucket's 1 MiB,
  // its own bucket: the waits for the buckets mid-backward are not meetings and get no lag,
  // so the step grows by the last bucket's lag alone.
  {
    const auto wide = gpt(4, 64, 4, 8192, 16);  // the head: 8,192 x 64 in bf16, 1 MiB
    TimeOptions x = o;
    x.strategy = Strategy::NoShard;
    x.param_bytes = 2;
    x.bucket_bytes = wide.layer_params() * 2;  // a bucket a layer
    const StepTime base = predict_time(wide, c, x);
    x.peer_lag_s = 1e-3;
    x.peer_lag_interval_s = 0.01;
    expect_one_lag(base, predict_time(wide, c, x));
  }
  {
    Cluster one = only_links(1, 1, true);
    one.flops = 1e9;
    TimeOptions x = o;
    x.strategy = Strategy::NoShard;
    x.peer_lag_s = 1e-3;
    x.peer_lag_interval_s = 0.01;
    TimeOptions y = x;
    y.peer_lag_s = 0;
    EXPECT_EQ(predict_time(m, one, x).step_s, predict_time(m, one, y).step_s);
  }
  // DDP with PowerSGD: the last bucket's first round (P) at the end of backward, after the
  // step's forward and backward, then its second round (Q) after the orthogonalization
  // since the ranks met at P. The step and its exposed communication grow by the two lags,
  // in proportion to peer_lag_s and to the inverse square root of the interval it is given at.
  TimeOptions ddp = o;
  ddp.strategy = Strategy::NoShard;
  ddp.hook = parse_hook_model("power_sgd:4");
  const StepTime base = predict_time(m, c, ddp);
  const double lag = lagged(ddp, 1e-3, 0.01).step_s - base.step_s;
  EXPECT_GT(lag, 1e-4);
  EXPECT_NEAR(lagged(ddp, 1e-3, 0.01).exposed_s - base.exposed_s, lag, 1e-12);
  EXPECT_NEAR(lagged(ddp, 2e-3, 0.01).step_s - base.step_s, 2 * lag, 1e-12);
  EXPECT_NEAR(lagged(ddp, 1e-3, 0.04).step_s - base.step_s, lag / 2, 1e-12);
  // Two spans that add up to at most the step before the optimizer's, the first at least
  // half of it: more than one lag after that half, at most sqrt(2) lags after all of it
  // (Cauchy-Schwarz).
  const double before = base.step_s - base.optimizer_s;
  EXPECT_GT(lag, 1e-3 * std::sqrt(0.5 * before / 0.01));
  EXPECT_LT(lag, 1e-3 * std::sqrt(2 * before / 0.01));
  {  // without the hook only P's lag: the Q round's own is the difference
    TimeOptions plain = ddp;
    plain.hook = parse_hook_model("none");
    const double p_lag = lagged(plain, 1e-3, 0.01).step_s - predict_time(m, c, plain).step_s;
    EXPECT_GT(lag, p_lag);
  }
  // Hybrid in groups of 1 with PowerSGD: a second round per unit (four layers and the
  // root), each after the work since the one before, and the root's first round at the end
  // of backward: six lags of shorter spans, more in all than DDP's two.
  TimeOptions hybrid = o;
  hybrid.strategy = Strategy::HybridShard;
  hybrid.shard_group_size = 1;
  hybrid.hook = parse_hook_model("power_sgd:4");
  const StepTime drifting = lagged(hybrid, 1e-3, 0.01);
  const double lags = drifting.step_s - predict_time(m, c, hybrid).step_s;
  EXPECT_GT(lags, 1.3 * lag);
  // Six spans that add up to at most the step: their lags add up to at most 1e-3 *
  // sqrt(6 * step / 0.01) (Cauchy-Schwarz). A lag counted from the step's start at every
  // round, not from the round before, would exceed it.
  EXPECT_LT(lags, 1e-3 * std::sqrt(6 * drifting.step_s / 0.01));
  EXPECT_THROW(lagged(ddp, -1e-3, 0.01), std::invalid_argument);
  EXPECT_THROW(lagged(ddp, 1e-3, 0), std::invalid_argument);
}

std::string plan_path() { return FLATSHARD_PLAN_PATH; }

// flatshard-plan --cluster prints each strategy's prediction (the library's, row by row) and
// names the fastest that fits; bad arguments are refused by name.
TEST(StepTime, ClusterCommandPrintsEveryStrategyAndTheFastestThatFits) {
  const auto r = flatshard::testing::run_command({plan_path(), "--cluster", "2x8", "--model", "llama3-8b",
                                                  "--seq", "8192", "--batch", "2", "--recompute", "selective",
                                                  "--device-gib", "96"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  TimeOptions o;
  o.sequences = 2;
  o.sequence_length = 8192;
  o.recompute = Recompute::Selective;
  const StepTime full = predict_time(llama3_8b(), h100_cluster(2, 8), o);
  EXPECT_NE(r.output.find(fmt::format("full shard {:>24.0f}", full.tokens_per_s)), std::string::npos)
      << r.output;
  for (const char* row : {"shard-grad-op", "hybrid (groups of 8)", "ZeRO-1", "DDP"})
    EXPECT_NE(r.output.find(row), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fastest that fits 96.0 GiB: "), std::string::npos) << r.output;
  // Offloaded: the library's prediction with the host's step, named as what limits it.
  const auto off =
      flatshard::testing::run_command({plan_path(), "--cluster", "1x1", "--model", "gpt-1b", "--seq", "1024",
                                       "--batch", "4", "--offload", "1", "--host-gbs", "40"});
  ASSERT_EQ(off.exit_code, 0) << off.output;
  TimeOptions oo;
  oo.sequences = 4;
  oo.sequence_length = 1024;
  oo.offload = true;
  Cluster host = h100_cluster(1, 1);
  host.host_bandwidth = 40e9;
  const StepTime offloaded = predict_time(gpt_1b(), host, oo);
  EXPECT_NE(off.output.find(fmt::format("full shard {:>24.0f}", offloaded.tokens_per_s)), std::string::npos)
      << off.output;
  EXPECT_NE(off.output.find("offloaded (bf16 copies sent)"), std::string::npos) << off.output;
  EXPECT_NE(off.output.find("host step"), std::string::npos) << off.output;
  // With collectives on the compute's cores: the lost share beside the exposed one, and the
  // limit it sets (the library's figures for the CPU cell of docs/scaling.md's first row).
  const std::vector<std::string> cpu_args{plan_path(),
                                          "--cluster",
                                          "1x2",
                                          "--gpt",
                                          "8,512,8,8192,32",
                                          "--seq",
                                          "32",
                                          "--batch",
                                          "4",
                                          "--dtype",
                                          "fp32",
                                          "--reduce",
                                          "fp32",
                                          "--tflops",
                                          "0.0787",
                                          "--memory-gbs",
                                          "21",
                                          "--intra",
                                          "1.64",
                                          "--intra-us",
                                          "125",
                                          "--collective-share",
                                          "1",
                                          "--sharding-work-ms",
                                          "107"};
  const auto cpu = flatshard::testing::run_command(cpu_args);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  Cluster cores = h100_cluster(1, 2);
  cores.flops = 0.0787e12;
  cores.memory_bandwidth = 21e9;
  cores.intra = {1.64e9, 125e-6};
  cores.collective_compute_share = 1;
  TimeOptions co;
  co.sequences = 4;
  co.sequence_length = 32;
  co.param_bytes = co.reduce_bytes = 4;
  co.sharding_work_s = 0.107;
  const StepTime lost = predict_time(gpt(8, 512, 8, 8192, 32), cores, co);
  ASSERT_EQ(lost.limit, "contention");
  EXPECT_NE(cpu.output.find(fmt::format("{:9.1f}% {:10.1f}%  contention", 100 * lost.exposed_share(),
                                        100 * lost.contended_s / lost.step_s)),
            std::string::npos)
      << cpu.output;
  EXPECT_NE(cpu.output.find("  contended"), std::string::npos) << cpu.output;
  // With the link beside compute: the library's prediction with it, and its figures named.
  auto beside_args = cpu_args;
  for (const char* a : {"--intra-beside", "0.4", "--intra-beside-us", "600"}) beside_args.emplace_back(a);
  const auto slow = flatshard::testing::run_command(beside_args);
  ASSERT_EQ(slow.exit_code, 0) << slow.output;
  cores.intra_beside_compute = {0.4e9, 600e-6};
  const StepTime beside = predict_time(gpt(8, 512, 8, 8192, 32), cores, co);
  EXPECT_GT(beside.step_s, lost.step_s);
  EXPECT_NE(slow.output.find(
                fmt::format("full shard {:>24.0f} {:10.1f}", beside.tokens_per_s, 1e3 * beside.step_s)),
            std::string::npos)
      << slow.output;
  EXPECT_NE(slow.output.find("beside compute the intra-node link gives 0.40 GB/s, 600 us a step"),
            std::string::npos)
      << slow.output;
  // A hook: only the strategies that take it, each the library's prediction with it.
  const auto hooked =
      flatshard::testing::run_command({plan_path(), "--cluster", "16x8", "--model", "gpt-1b", "--seq", "1024",
                                       "--batch", "16", "--hook", "power_sgd:4"});
  ASSERT_EQ(hooked.exit_code, 0) << hooked.output;
  TimeOptions ho;
  ho.sequences = 16;
  ho.sequence_length = 1024;
  ho.strategy = Strategy::NoShard;
  ho.hook = parse_hook_model("power_sgd:4");
  const StepTime powered = predict_time(gpt_1b(), h100_cluster(16, 8), ho);
  EXPECT_NE(hooked.output.find(fmt::format("DDP {:>31.0f}", powered.tokens_per_s)), std::string::npos)
      << hooked.output;
  EXPECT_NE(hooked.output.find("each bucket reduced by the power_sgd:4 hook"), std::string::npos)
      << hooked.output;
  EXPECT_NE(hooked.output.find("hybrid (groups of 8)"), std::string::npos) << hooked.output;
  EXPECT_EQ(hooked.output.find("full shard"), std::string::npos) << "full shard takes no hook";
  // --peer-lag-ms and --peer-lag-interval-ms: the ranks' lag at PowerSGD's second round.
  const auto drifting = flatshard::testing::run_command(
      {plan_path(), "--cluster", "16x8", "--model", "gpt-1b", "--seq", "1024", "--batch", "16", "--hook",
       "power_sgd:4", "--peer-lag-ms", "20", "--peer-lag-interval-ms", "50"});
  ASSERT_EQ(drifting.exit_code, 0) << drifting.output;
  ho.peer_lag_s = 0.02;
  ho.peer_lag_interval_s = 0.05;
  const StepTime lagging = predict_time(gpt_1b(), h100_cluster(16, 8), ho);
  ASSERT_LT(lagging.tokens_per_s, 0.95 * powered.tokens_per_s);
  EXPECT_NE(drifting.output.find(fmt::format("DDP {:>31.0f}", lagging.tokens_per_s)), std::string::npos)
      << drifting.output;
  // --first-bucket-mb and --bucket-mb: DDP's and ZeRO-1's bucket caps in MiB. The small
  // GPT's untied 4 MiB head over a slow link: in a first bucket of its own (1 MiB, the
  // engine's default) it is reduced beside backward; in one bucket with the rest it is not.
  const std::vector<std::string> slow_link = {
      plan_path(), "--cluster", "1x2",      "--gpt", "4,256,8,4096,32", "--seq", "32",       "--batch", "4",
      "--dtype",   "fp32",      "--reduce", "fp32",  "--intra",         "0.06",  "--tflops", "0.05"};
  const auto ddp_tokens = [](const std::string& output) {
    const auto at = output.find("\nDDP ");
    return at == std::string::npos ? -1.0 : std::stod(output.substr(at + 5));
  };
  std::vector<std::string> one_bucket = slow_link;
  for (const char* x : {"--first-bucket-mb", "25", "--bucket-mb", "25"}) one_bucket.push_back(x);
  const auto split = flatshard::testing::run_command(slow_link);
  const auto joined = flatshard::testing::run_command(one_bucket);
  ASSERT_EQ(split.exit_code, 0) << split.output;
  ASSERT_EQ(joined.exit_code, 0) << joined.output;
  EXPECT_GT(ddp_tokens(split.output), 1.05 * ddp_tokens(joined.output)) << split.output << joined.output;
  EXPECT_GT(ddp_tokens(joined.output), 0) << joined.output;
  // --intra-allreduce and --inter-allreduce: an all-reduce's own bus bandwidth on each link.
  const auto in_place = flatshard::testing::run_command(
      {plan_path(), "--cluster", "16x8", "--model", "gpt-1b", "--seq", "1024", "--batch", "16",
       "--intra-allreduce", "90", "--inter-allreduce", "10"});
  ASSERT_EQ(in_place.exit_code, 0) << in_place.output;
  Cluster own = h100_cluster(16, 8);
  own.intra.all_reduce_bus_bandwidth = 90e9;
  own.inter.all_reduce_bus_bandwidth = 10e9 / 8;
  TimeOptions po;
  po.sequences = 16;
  po.sequence_length = 1024;
  po.strategy = Strategy::NoShard;
  const StepTime slow_ar = predict_time(gpt_1b(), own, po);
  ASSERT_LT(slow_ar.tokens_per_s, 0.95 * predict_time(gpt_1b(), h100_cluster(16, 8), po).tokens_per_s);
  EXPECT_NE(in_place.output.find(fmt::format("DDP {:>31.0f}", slow_ar.tokens_per_s)), std::string::npos)
      << in_place.output;
  const auto in_node =
      flatshard::testing::run_command({plan_path(), "--cluster", "1x8", "--model", "gpt-1b", "--seq", "1024",
                                       "--batch", "16", "--intra-allreduce", "30"});
  ASSERT_EQ(in_node.exit_code, 0) << in_node.output;
  Cluster node = h100_cluster(1, 8);
  node.intra.all_reduce_bus_bandwidth = 30e9;
  const StepTime node_ar = predict_time(gpt_1b(), node, po);
  ASSERT_LT(node_ar.tokens_per_s, 0.95 * predict_time(gpt_1b(), h100_cluster(1, 8), po).tokens_per_s);
  EXPECT_NE(in_node.output.find(fmt::format("DDP {:>31.0f}", node_ar.tokens_per_s)), std::string::npos)
      << in_node.output;
  // --group: hybrid sharding in groups within a node too, the library's prediction.
  const auto grouped = flatshard::testing::run_command(
      {plan_path(), "--cluster", "1x4", "--model", "gpt-1b", "--batch", "16", "--group", "2"});
  ASSERT_EQ(grouped.exit_code, 0) << grouped.output;
  TimeOptions go;
  go.sequences = 16;
  go.sequence_length = 1024;
  go.strategy = Strategy::HybridShard;
  go.shard_group_size = 2;
  EXPECT_NE(grouped.output.find(fmt::format("hybrid (groups of 2) {:>14.0f}",
                                            predict_time(gpt_1b(), h100_cluster(1, 4), go).tokens_per_s)),
            std::string::npos)
      << grouped.output;
  const auto late = flatshard::testing::run_command(
      {plan_path(), "--cluster", "2x8", "--model", "gpt-1b", "--batch", "16", "--staleness", "2"});
  ASSERT_EQ(late.exit_code, 0) << late.output;
  EXPECT_NE(late.output.find("ZeRO-1"), std::string::npos) << late.output;
  EXPECT_EQ(late.output.find("hybrid"), std::string::npos) << "only DDP and ZeRO-1 take staleness";
  EXPECT_EQ(r.output.find("contended"), std::string::npos) << "no column where collectives take no compute";
  const auto ddp = r.output.find("\nDDP");
  ASSERT_NE(ddp, std::string::npos);
  EXPECT_NE(r.output.substr(ddp, r.output.find('\n', ddp + 1) - ddp).find(" no"), std::string::npos)
      << "8B under DDP cannot fit 96 GiB: " << r.output;
  // Offloaded, a host of --host-gib per node must hold what its devices' shards ask of it:
  // 70B over one node of 8 asks about 18 bytes a parameter of the host, 1.2 TiB.
  const std::vector<std::string> offload_70b{plan_path(), "--cluster", "1x8",     "--model", "llama3-70b",
                                             "--seq",     "8192",      "--batch", "1",       "--recompute",
                                             "full",      "--offload", "1"};
  auto small_host = offload_70b;
  for (const char* extra : {"--host-gib", "512"}) small_host.push_back(extra);
  const auto roomy = flatshard::testing::run_command(offload_70b);
  const auto tight = flatshard::testing::run_command(small_host);
  ASSERT_EQ(roomy.exit_code, 0) << roomy.output;
  ASSERT_EQ(tight.exit_code, 0) << tight.output;
  EXPECT_NE(roomy.output.find("host GiB/node"), std::string::npos) << roomy.output;
  // The default device budget: an H100 80GB's 79.6 GiB less the CUDA context and NCCL's buffers.
  EXPECT_NE(roomy.output.find("fastest that fits 78.0 GiB: full shard"), std::string::npos) << roomy.output;
  EXPECT_NE(tight.output.find("nothing fits 78.0 GiB per device and 512.0 GiB of host per node"),
            std::string::npos)
      << tight.output;
  for (auto bad : std::vector<std::vector<std::string>>{
           {plan_path(), "--cluster", "2x"},
           {plan_path(), "--cluster", "2x8", "--model", "gpt-9"},
           {plan_path(), "--cluster", "2x8", "--recompute", "some"},
           {plan_path(), "--cluster", "2x8", "--tflops", "-3"},
           {plan_path(), "--cluster", "2x8", "--offload", "2"},
           {plan_path(), "--cluster", "2x8", "--host-gbs", "0"},
           {plan_path(), "--cluster", "2x8", "--intra-beside", "0.5"},
           {plan_path(), "--cluster", "2x8", "--intra-beside-us", "500"},
           {plan_path(), "--cluster", "2x8", "--hook", "bf8"},
           {plan_path(), "--cluster", "2x8", "--staleness", "9"},
           {plan_path(), "--cluster", "2x8", "--decentralized", "1", "--hook", "bf16"},
           {plan_path(), "--cluster", "2x8", "--decentralized", "1", "--offload", "1"},
           {plan_path(), "--cluster", "2x8", "--hook-work-ms", "-1"},
           {plan_path(), "--cluster", "2x8", "--peer-lag-ms", "-1"},
           {plan_path(), "--cluster", "2x8", "--intra-allreduce", "0"},
           {plan_path(), "--cluster", "2x8", "--inter-allreduce", "-5"},
           {plan_path(), "--cluster", "2x8", "--peer-lag-interval-ms", "0"},
           {plan_path(), "--cluster", "2x8", "--first-bucket-mb", "0"},
           {plan_path(), "--cluster", "2x8", "--bucket-mb", "-25"},
           {plan_path(), "--cluster", "2x8", "--group", "3"},
           {plan_path(), "--cluster", "2x8", "--group", "16"},
           {plan_path(), "--cluster", "2x8", "--group", "0"},
           // Groups that would straddle nodes, counts past any cluster, fields the GPT lacks
           // or has too many of, a sequence past its context, a host to check without offload.
           {plan_path(), "--cluster", "3x8", "--group", "12"},
           {plan_path(), "--cluster", "2x6", "--group", "4"},
           {plan_path(), "--cluster", "65536x32768"},
           {plan_path(), "--cluster", "2x8", "--staleness", "3e9"},
           {plan_path(), "--cluster", "2x8", "--batch", "3e9"},
           {plan_path(), "--cluster", "2x8", "--gpt", "12,768,12,50257,1024,99"},
           {plan_path(), "--cluster", "2x8", "--gpt", "12,768,12,50257,1024x"},
           {plan_path(), "--cluster", "2x8", "--gpt", "12,768,12,50257"},
           {plan_path(), "--cluster", "2x8", "--model", "gpt-1b", "--seq", "8192"},
           {plan_path(), "--cluster", "2x8", "--host-gib", "512"},
           // fp32 on the preset, whose throughput is bf16's: --tflops must say.
           {plan_path(), "--cluster", "2x8", "--dtype", "fp32"}}) {
    const auto refused = flatshard::testing::run_command(bad);
    EXPECT_EQ(refused.exit_code, 2) << refused.output;
    EXPECT_NE(refused.output.find("usage: flatshard-plan --cluster"), std::string::npos) << refused.output;
  }
}

}  // namespace
