// The planner's arithmetic under CPU offload, swept over modes, world sizes and dtypes: the
// offloaded states leave the device's figures for Plan::host, and largest_model finds the
// boundary of what fits. (The measured checks are in tests/multirank/test_plan.cpp and, on
// a GPU, tests/cuda/test_cuda.cpp.)
#include <gtest/gtest.h>

#include "flatshard/plan.h"
#include "flatshard/shard.h"

namespace {

namespace plan = flatshard::plan;
using flatshard::Strategy;

class OffloadSweep : public ::testing::TestWithParam<std::tuple<Strategy, int, int>> {
 protected:
  // A model of a prime count in 5 units (every unit pads), and the sweep's mode, world and
  // compute dtype with `activations`.
  const plan::ModelShape shape = plan::uniform_shape(1000003, 5);
  plan::PlanOptions options(std::int64_t activations) const {
    const auto [mode, world, param_bytes] = GetParam();
    plan::PlanOptions o;
    o.strategy = mode;
    o.world_size = world;
    o.param_bytes = param_bytes;
    o.activation_bytes = activations;
    return o;
  }
};

// What offload takes off the device is on the host, byte for byte: the fp32 masters (whole,
// or this rank's slices or shards), their gradients and the optimizer state. The device
// keeps the parameters, their gradients and activations; the sharded modes add, under bf16
// without the masters' bf16 copies, one fp32 shard of staging.
TEST_P(OffloadSweep, StatesMoveFromTheDeviceToTheHost) {
  const auto [mode, world, param_bytes] = GetParam();
  const std::int64_t psi = shape.total();
  auto o = options(64 << 20);  // the peak at the start of backward, with or without offload
  const auto on_device = plan::predict(shape, o);
  o.cpu_offload = true;
  const auto offloaded = plan::predict(shape, o);
  EXPECT_EQ(on_device.host, 0);
  EXPECT_EQ(on_device.host_construction, 0);
  EXPECT_EQ(offloaded.optimizer_state, 0);
  EXPECT_EQ(offloaded.masters, 0);
  EXPECT_EQ(offloaded.activations, on_device.activations);
  EXPECT_EQ(offloaded.gathered_params, on_device.gathered_params);
  EXPECT_LT(offloaded.peak, on_device.peak);
  const bool sharded = mode == Strategy::ShardGradOp || mode == Strategy::FullShard;
  if (sharded) {
    // Master shards, gradient shards (4 bytes each) and AdamW's 8 bytes, per padded shard.
    std::int64_t shards = 0;
    for (auto u : shape.unit_numels) shards += flatshard::padded_numel(u, world, 16 / param_bytes) / world;
    // Under bf16, the masters' bf16 copies too (2 bytes per element; Note [The bf16 copy of an
    // offloaded master]).
    EXPECT_EQ(offloaded.host, shards * (param_bytes == 2 ? 18 : 16));
    auto without_copies = o;
    without_copies.offload_bf16_copy = false;
    EXPECT_EQ(plan::predict(shape, without_copies).host, shards * 16);
    EXPECT_EQ(offloaded.params, 0);
    EXPECT_EQ(offloaded.late_host_grads, shards * 4);
    // The bf16 copies cross straight into the gathered buffer; without them bf16 gathers
    // convert an fp32 shard on the device.
    EXPECT_EQ(offloaded.staging, 0);
    EXPECT_EQ(plan::predict(shape, without_copies).staging,
              param_bytes == 4
                  ? 0
                  : flatshard::padded_numel(shape.unit_numels[0], world, 16 / param_bytes) / world * 4);
    EXPECT_EQ(offloaded.construction, 0);  // built on the host, each shard goes to host memory
    // The host holds the model as built and the master shards cut from it; built into
    // shards, the shards and one unit at full size (the root here has no parameters).
    EXPECT_EQ(offloaded.host_construction, psi * 4 + shards * 4);  // the copies come with the first step
    o.build_into_shards = true;
    EXPECT_EQ(plan::predict(shape, o).host_construction, shards * 4 + shape.unit_numels[0] * 4);
  } else {
    const std::int64_t master = mode == Strategy::NoShard ? psi * 4 : (psi * 4 + world - 1) / world;
    const std::int64_t state = mode == Strategy::NoShard ? psi * 8 : (psi * 8 + world - 1) / world;
    const std::int64_t copy = param_bytes == 2 ? master / 2 : 0;
    EXPECT_EQ(offloaded.host, 2 * master + state + copy);
    EXPECT_EQ(offloaded.host_construction, psi * 4 + master);  // the model and its masters
    // ZeRO-1 gathers every rank's slices on the host to lay its buckets out again (not
    // under fp32, where the parameters hold them, nor on one rank, where the slices are all).
    const bool gathers = mode == Strategy::ShardOptimizerState && world > 1 && param_bytes != 4;
    EXPECT_EQ(offloaded.host_rebuild, gathers ? psi * 4 + offloaded.host - copy : 0);
    EXPECT_EQ(offloaded.host_peak(),
              std::max({offloaded.host, offloaded.host_construction, offloaded.host_rebuild}));
    EXPECT_EQ(offloaded.late_host_grads, 0);
    EXPECT_EQ(offloaded.params, psi * param_bytes);
    // Under bf16 on a GPU the buckets' gradients come after the peak in the loss's
    // backward (Note [The device peak in the loss's backward]).
    EXPECT_EQ(offloaded.grads, param_bytes == 2 ? 0 : psi * param_bytes);
    EXPECT_EQ(offloaded.staging, 0);
    // Without offload the same states are on the device (DDP and ZeRO-1 at one rank in fp32
    // keep no separate master: the parameters are the masters).
    // Under bf16 on a GPU ZeRO-1's reduced gradient slices exist at the device's peak, as
    // DDP's masters' gradients do.
    const bool aliased = param_bytes == 4 && (mode == Strategy::NoShard || world == 1);
    const bool grads_on_device = mode == Strategy::NoShard || param_bytes == 2;
    EXPECT_EQ(on_device.training() - offloaded.training(), on_device.masters + on_device.optimizer_state);
    EXPECT_EQ(offloaded.host - copy - (on_device.masters + on_device.optimizer_state),
              aliased ? 2 * master : (grads_on_device ? 0 : master));
    o.offload_bf16_copy = false;
    EXPECT_EQ(plan::predict(shape, o).host, offloaded.host - copy);
  }
}

// Built on the host and placed by options.device (Note [Construction]): training is the
// same, but the device receives only what it keeps (the sharded modes' fp32 shards; DDP's
// and ZeRO-1's flat buffer and masters, with one parameter crossing for the broadcast),
// and the host holds the model as it is built. Offload implies it.
TEST_P(OffloadSweep, BuiltOnTheHostTheDeviceNeverHoldsTheWholeModel) {
  const auto [mode, world, param_bytes] = GetParam();
  const std::int64_t psi = shape.total();
  auto o = options(1 << 20);  // small: construction and rebuild matter to the peak
  const auto on_device = plan::predict(shape, o);
  o.build_on_host = true;
  const auto on_host = plan::predict(shape, o);
  EXPECT_EQ(on_host.training(), on_device.training());
  EXPECT_EQ(on_host.rebuild, on_device.rebuild);
  EXPECT_EQ(on_host.host, 0);
  EXPECT_EQ(on_host.host_construction, psi * 4);  // the model as built, and nothing offloaded
  EXPECT_LT(on_host.construction, on_device.construction);
  EXPECT_LE(on_host.peak, on_device.peak);
  const bool sharded = mode == Strategy::ShardGradOp || mode == Strategy::FullShard;
  if (sharded) {
    std::int64_t shards = 0;
    for (auto u : shape.unit_numels) shards += flatshard::padded_numel(u, world, 16 / param_bytes) / world;
    EXPECT_EQ(on_host.construction, shards * 4);  // the fp32 shards, and nothing gathered
    o.build_into_shards = true;
    const auto into_shards = plan::predict(shape, o);
    EXPECT_EQ(into_shards.construction, shards * 4);
    EXPECT_EQ(into_shards.host_construction, shape.unit_numels[0] * 4);  // one unit at full size
  } else {
    // DDP's masters without their gradients (made by the first bucket); a parameter
    // crosses to the device for the broadcast above one rank.
    const std::int64_t masters =
        mode == Strategy::NoShard || param_bytes == 2 ? on_host.masters / 2 : on_host.masters;
    const std::int64_t crossing = world > 1 ? shape.largest_param_numel * 4 : 0;
    EXPECT_EQ(on_host.construction, on_host.params + masters + crossing);
    EXPECT_EQ(on_device.construction - on_host.construction, psi * 4 - crossing);
  }
  o.cpu_offload = true;
  o.build_into_shards = false;
  const auto offloaded = plan::predict(shape, o);
  o.build_on_host = false;
  const auto implied = plan::predict(shape, o);
  EXPECT_EQ(offloaded.construction, implied.construction);
  EXPECT_EQ(offloaded.host_construction, implied.host_construction);
  EXPECT_EQ(offloaded.peak, implied.peak);
}

INSTANTIATE_TEST_SUITE_P(Planner, OffloadSweep,
                         ::testing::Combine(::testing::Values(Strategy::NoShard,
                                                              Strategy::ShardOptimizerState,
                                                              Strategy::ShardGradOp, Strategy::FullShard),
                                            ::testing::Values(1, 2, 3, 8), ::testing::Values(4, 2)));

// Note [Late in backward]: where the states outweigh the activations, the sharded modes
// peak at the end of backward, with every gradient shard (16 bytes per parameter of
// AdamW's states in all); offload moves those to the host.
TEST(Planner, StatesHeavyModelsPeakAtTheEndOfBackward) {
  const auto shape = plan::uniform_shape(std::int64_t{1} << 24, 8);
  for (Strategy mode : {Strategy::ShardGradOp, Strategy::FullShard}) {
    for (int world : {1, 4}) {
      plan::PlanOptions o;
      o.strategy = mode;
      o.world_size = world;
      o.param_bytes = 2;
      o.activation_bytes = 1 << 20;
      const auto p = plan::predict(shape, o);
      const std::int64_t shards = shape.total() / world;  // 2^24 divides: no padding
      const std::int64_t unit = shape.unit_numels[0];
      EXPECT_EQ(p.peak, shards * 16 + (mode == Strategy::FullShard ? unit : shape.total()) * 2);
      EXPECT_EQ(p.grads, shards * 4);
      EXPECT_EQ(p.activations, 0);
      // Stepping in backward only one unit's gradient shard is in flight (no root here).
      o.step_in_backward = true;
      const auto stepped = plan::predict(shape, o);
      const std::int64_t late =
          shards * 12 + unit / world * 4 + (mode == Strategy::FullShard ? unit : shape.total()) * 2;
      EXPECT_GE(stepped.peak, late);
      EXPECT_EQ(stepped.peak, std::max({late, stepped.training(), stepped.construction}));
      EXPECT_LT(stepped.peak, p.peak);
      // On the CPU the pool's two largest blocks are still held then.
      o.step_in_backward = false;
      o.cpu_compute = true;
      const auto on_cpu = plan::predict(shape, o);
      EXPECT_EQ(on_cpu.peak, p.peak + 2 * unit * 2);
      EXPECT_EQ(on_cpu.pool, 2 * unit * 2);
      o.cpu_compute = false;
      o.cpu_offload = true;
      const auto offloaded = plan::predict(shape, o);
      EXPECT_EQ(offloaded.host, shards * 18);           // with the masters' bf16 copies
      EXPECT_LE(offloaded.peak + shards * 12, p.peak);  // at least masters and AdamW's state leave
    }
  }
}

// largest_model returns the boundary: that size fits, one more parameter per unit does not;
// offload fits a larger model on the same device, and a host limit bounds it.
TEST(Planner, LargestModelIsTheBoundaryOfWhatFits) {
  constexpr int kUnits = 26;
  const std::int64_t device = std::int64_t{80} << 30, host = std::int64_t{120} << 30;
  for (Strategy mode : {Strategy::NoShard, Strategy::ShardOptimizerState, Strategy::FullShard}) {
    for (int world : {1, 8}) {
      SCOPED_TRACE(::testing::Message() << flatshard::mode_name(mode) << " world " << world);
      plan::PlanOptions o;
      o.strategy = mode;
      o.world_size = world;
      o.param_bytes = 2;
      o.activation_bytes = std::int64_t{12} << 30;
      const auto plain = plan::largest_model(o, kUnits, device);
      ASSERT_GT(plain, 0);
      EXPECT_LE(plan::predict(plan::uniform_shape(plain, kUnits), o).peak, device);
      EXPECT_GT(plan::predict(plan::uniform_shape(plain + kUnits, kUnits), o).peak, device);
      // Built on the host, the device never holds the whole model; the host does.
      o.build_on_host = true;
      const auto on_host = plan::largest_model(o, kUnits, device, host);
      const auto placed = plan::predict(plan::uniform_shape(on_host, kUnits), o);
      const auto placed_over = plan::predict(plan::uniform_shape(on_host + kUnits, kUnits), o);
      EXPECT_GE(on_host, plain);
      EXPECT_LE(placed.peak, device);
      EXPECT_LE(placed.host_construction, host);
      EXPECT_TRUE(placed_over.peak > device || placed_over.host_construction > host);
      if (mode == Strategy::FullShard && world == 8) {
        // Built whole on the device, the whole fp32 model is what stops it (4 bytes per
        // parameter on 80 GiB: 20B); placed from the host, the host's 120 GiB does (30B).
        plan::PlanOptions whole = o;
        whole.build_on_host = false;
        EXPECT_GT(plan::predict(plan::uniform_shape(plain + kUnits, kUnits), whole).construction, device);
        EXPECT_GT(on_host, 3 * plain / 2);
        EXPECT_GE(placed.host_construction + 4 * kUnits, host);
      }
      o.build_on_host = false;
      o.cpu_offload = true;
      const auto offloaded = plan::largest_model(o, kUnits, device, host);
      EXPECT_GT(offloaded, plain);
      const auto fit = plan::predict(plan::uniform_shape(offloaded, kUnits), o);
      const auto over = plan::predict(plan::uniform_shape(offloaded + kUnits, kUnits), o);
      EXPECT_LE(fit.peak, device);
      EXPECT_LE(fit.host_peak(), host);
      EXPECT_TRUE(over.peak > device || over.host_peak() > host);
      EXPECT_GE(plan::largest_model(o, kUnits, device), offloaded);  // without a host limit
      if (mode == Strategy::FullShard && world == 8) {
        // Built whole, each rank's host holds the model (4 bytes per parameter), which
        // bounds it before the states (2 bytes per parameter at 8 ranks) do; built into
        // shards it holds one unit at full size, and the states bound it.
        EXPECT_GT(fit.host_construction, fit.host);
        EXPECT_GE(fit.host_construction + 64 * kUnits, host);  // the host is what stops it
        o.build_into_shards = true;
        const auto into_shards = plan::largest_model(o, kUnits, device, host);
        EXPECT_GT(into_shards, 3 * offloaded / 2);
        const auto built = plan::predict(plan::uniform_shape(into_shards, kUnits), o);
        EXPECT_GT(built.host, built.host_construction);
        EXPECT_GE(built.host + 64 * kUnits, host);
      }
    }
  }
  plan::PlanOptions o;
  o.activation_bytes = std::int64_t{1} << 40;
  EXPECT_EQ(plan::largest_model(o, kUnits, std::int64_t{80} << 30), 0);  // activations alone exceed it
}

// A fine-tuning (three quarters of every unit frozen: no gradient, no optimizer state for
// them) fits a larger model than training every parameter, in every mode, on the device and
// offloaded; largest_model returns the boundary of the shape it plans.
TEST(Planner, LargestFineTuningIsTheBoundaryOfWhatFits) {
  constexpr int kUnits = 26;
  constexpr double kFrozen = 0.75;
  const std::int64_t device = std::int64_t{80} << 30, host = std::int64_t{120} << 30;
  for (Strategy mode : {Strategy::NoShard, Strategy::ShardOptimizerState, Strategy::FullShard}) {
    for (bool offload : {false, true}) {
      SCOPED_TRACE(::testing::Message() << flatshard::mode_name(mode) << (offload ? " offloaded" : ""));
      plan::PlanOptions o;
      o.strategy = mode;
      o.world_size = 8;
      o.param_bytes = 2;
      o.cpu_offload = offload;
      o.build_into_shards = mode == Strategy::FullShard;  // the states bound it, not the build
      o.activation_bytes = std::int64_t{12} << 30;
      const auto trained = plan::largest_model(o, kUnits, device, host);
      const auto fine_tuned = plan::largest_model(o, kUnits, device, host, kFrozen);
      EXPECT_GT(fine_tuned, trained);
      const auto shape = plan::uniform_shape(fine_tuned, kUnits, kFrozen);
      EXPECT_NEAR(static_cast<double>(shape.frozen()), kFrozen * static_cast<double>(fine_tuned),
                  static_cast<double>(kUnits));
      const auto fit = plan::predict(shape, o);
      const auto over = plan::predict(plan::uniform_shape(fine_tuned + kUnits, kUnits, kFrozen), o);
      EXPECT_LE(fit.peak, device);
      EXPECT_LE(fit.host_peak(), host);
      EXPECT_TRUE(over.peak > device || over.host_peak() > host);
    }
  }
}

}  // namespace

namespace {

// Frozen parameters (plan::ModelShape::unit_frozen) take no gradient and no optimizer state
// in any mode, on the device or offloaded, and the sharded modes pad a partly frozen unit's
// two groups apart; the parameters themselves (and their masters) stay.
TEST(Planner, FrozenParametersTakeNoGradientOrState) {
  const std::int64_t unit = 1 << 20, frozen = 3 << 18;  // three quarters of the first unit frozen
  plan::ModelShape tuned = plan::uniform_shape(4 * unit, 4);
  const plan::ModelShape full = tuned;
  tuned.unit_frozen = {frozen, 0, 0, 0};
  EXPECT_EQ(tuned.frozen(), frozen);
  for (Strategy mode :
       {Strategy::NoShard, Strategy::ShardOptimizerState, Strategy::ShardGradOp, Strategy::FullShard}) {
    for (int world : {1, 4}) {
      for (bool offload : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << flatshard::to_string(mode) << " world " << world << (offload ? " offloaded" : ""));
        plan::PlanOptions o;
        o.strategy = mode;
        o.world_size = world;
        o.optimizer_state_bytes = 8;
        o.cpu_offload = offload;
        const auto a = plan::predict(full, o), b = plan::predict(tuned, o);
        const bool sharded = mode == Strategy::ShardGradOp || mode == Strategy::FullShard;
        const std::int64_t per_rank = sharded || mode == Strategy::ShardOptimizerState ? world : 1;
        // AdamW's 8 bytes and the fp32 gradient's 4 per frozen element (this rank's share).
        const std::int64_t state = 8 * frozen / per_rank, grad = 4 * frozen / per_rank;
        if (offload) {
          EXPECT_EQ(a.host - b.host, state + grad) << "the master gradients and the state on the host";
        } else {
          EXPECT_EQ(a.optimizer_state - b.optimizer_state, state);
          if (sharded) {
            EXPECT_EQ(b.params, a.params) << "the masters stay";
          } else {
            EXPECT_EQ(a.grads - b.grads, 4 * frozen) << "no bucket holds them";
            EXPECT_EQ(b.params, a.params);
          }
        }
        EXPECT_LE(b.peak, a.peak);
        if (!offload) EXPECT_LT(b.training(), a.training());
      }
    }
  }
}

}  // namespace

// Loading a whole model adds one parameter's piece to what a rank holds between steps;
// exporting one adds one flat group at full size in fp32 (the largest unit's or the
// root's, padded; the replicated strategies' one group is the model).
TEST(Planner, LoadingAndExportingAddOnePieceOrOneGroup) {
  plan::ModelShape shape;
  shape.root_numel = 10;
  shape.unit_numels = {100, 301};
  shape.largest_param_numel = 200;
  for (int world = 1; world <= 4; ++world) {
    for (auto strategy : {flatshard::Strategy::FullShard, flatshard::Strategy::ShardGradOp,
                          flatshard::Strategy::NoShard, flatshard::Strategy::ShardOptimizerState}) {
      plan::PlanOptions o;
      o.strategy = strategy;
      o.world_size = world;
      const auto p = plan::predict(shape, o);
      const std::int64_t held = p.params + p.masters + p.optimizer_state;
      EXPECT_EQ(p.load_whole - held, 200 * 4);
      const bool sharded =
          strategy == flatshard::Strategy::FullShard || strategy == flatshard::Strategy::ShardGradOp;
      const std::int64_t group = sharded ? flatshard::padded_numel(301, world, 4) * 4 : 411 * 4;
      EXPECT_EQ(p.export_whole - held, group) << flatshard::to_string(strategy) << " at " << world;
      EXPECT_EQ(p.async_save_host, (4 + 8) * ((411 + world - 1) / world)) << flatshard::to_string(strategy);
    }
  }
}
