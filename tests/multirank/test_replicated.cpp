// The replicated strategies, NoShard (DDP) and ShardOptimizerState (ZeRO-1), against
// single-process LibTorch training on the same global batch, and their contracts:
// broadcast from rank 0, same-model check, buckets and their rebuild, unused parameters,
// accumulation, clipping, mixed precision, buffers, the optimizer state's share.
#include <gtest/gtest.h>

#include "tests/support/cases.h"
#include "tests/support/multirank.h"

namespace {

using namespace flatshard::testing;
using flatshard::Strategy;

const std::vector<Strategy> kReplicated = {Strategy::NoShard, Strategy::ShardOptimizerState};

template <typename Holder>
void expect_replicated_matches(const std::string& model, const std::function<Holder()>& make,
                               const std::function<Batch(int, int)>& batch,
                               const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss) {
  auto world = flatshard::init();
  for (Strategy strategy : kReplicated) {
    for (OptKind opt : {OptKind::SGD, OptKind::Adam, OptKind::AdamW}) {
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = opt;
      const auto r = train_and_compare<Holder>(
          world, make, [&](int s) { return batch(s, spec.global_batch); }, loss, spec);
      if (world.rank() == 0) {
        std::printf("%s %s %s world %d: rel weight diff %.3g (%s), element-wise %.3g, rel loss diff %.3g\n",
                    model.c_str(), to_string(strategy), to_string(opt), world.world_size(),
                    r.max_rel_weight_diff, r.worst_param.c_str(), r.max_elementwise_diff,
                    r.max_rel_loss_diff);
      }
      SCOPED_TRACE(::testing::Message() << model << " " << to_string(strategy) << " " << to_string(opt));
      EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << r.worst_param;
      EXPECT_LE(r.max_rel_loss_diff, kFp32Tolerance);
      if (opt == OptKind::SGD) EXPECT_LE(r.max_elementwise_diff, kFp32Tolerance);
    }
  }
}

TEST(Replicated, MlpMatchesSingleProcess) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(120));
  expect_replicated_matches<torch::nn::Sequential>("mlp", mlp_factory(), mlp_batch, mse);
}

TEST(Replicated, GptMatchesSingleProcess) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(180));
  expect_replicated_matches<GPT>("gpt", gpt_factory(), gpt_batch, token_loss);
}

TEST(Replicated, MnistCnnMatchesSingleProcess) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(300));
  expect_replicated_matches<MnistNet>("cnn", cnn_factory(), cnn_batch, nll);
}

TEST(Replicated, AccumulationClippingUnusedAndMixedPrecision) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(180));
  auto world = flatshard::init();
  auto gpt = [&](const TrainSpec& spec, int rows) {
    return train_and_compare<GPT>(
        world, gpt_factory(), [&](int s) { return gpt_batch(s, rows); }, token_loss, spec);
  };
  for (Strategy strategy : kReplicated) {
    const char* name = to_string(strategy);
    {  // no_sync accumulation over two micro-batches; plain SGD, which a gradient scaled by a
       // wrong divisor moves in proportion (AdamW would not see it)
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = OptKind::PlainSGD;
      spec.global_batch = 24;
      spec.micro_batches = 2;
      const auto r = gpt(spec, 24);
      EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << name << " accumulation " << r.worst_param;
      EXPECT_LE(r.max_rel_loss_diff, kFp32Tolerance) << name << " accumulation";
      expect_no_sync_sends_no_reduction(r, spec, world.world_size());
    }
    {  // clipping
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = OptKind::SGD;
      spec.clip = 0.25;
      const auto r = gpt(spec, 12);
      EXPECT_GT(r.max_grad_norm, spec.clip) << "the test must actually clip";
      EXPECT_LE(r.max_elementwise_diff, kFp32Tolerance) << name << " clipping";
    }
    for (OptKind opt : {OptKind::SGD, OptKind::AdamW}) {  // a block no rank uses in odd steps
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = opt;
      spec.find_unused_parameters = true;
      spec.before_step = [](int step, torch::nn::Module& ref, torch::nn::Module& sharded) {
        dynamic_cast<GPTImpl&>(ref).skip_block = step % 2 == 1 ? 1 : -1;
        dynamic_cast<GPTImpl&>(sharded).skip_block = step % 2 == 1 ? 1 : -1;
      };
      const auto r = gpt(spec, 12);
      EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance)
          << name << " unused " << to_string(opt) << " " << r.worst_param;
    }
    // bf16 compute, fp32 masters; plain SGD (no clipping) shows a wrong averaging divisor in
    // the masters, which AdamW would hide.
    for (auto [reduce, opt] :
         {std::pair{at::kFloat, OptKind::AdamW}, std::pair{at::kBFloat16, OptKind::AdamW},
          std::pair{at::kFloat, OptKind::PlainSGD}, std::pair{at::kBFloat16, OptKind::PlainSGD}}) {
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = opt;
      spec.param_dtype = at::kBFloat16;
      spec.reduce_dtype = reduce;
      const auto r = gpt(spec, 12);
      if (world.rank() == 0) {
        std::printf(
            "bf16 %s reduce %s %s world %d: model rel weight diff %.3g, masters %.3g, rel loss diff %.3g\n",
            name, reduce == at::kFloat ? "fp32" : "bf16", to_string(opt), world.world_size(),
            r.global_rel_weight_diff, r.global_rel_master_diff, r.max_rel_loss_diff);
      }
      // Note [bf16 tolerance] in test_fully_shard.cpp.
      EXPECT_LE(r.global_rel_weight_diff, kBf16Tolerance) << name << " " << to_string(opt);
      EXPECT_LE(r.max_rel_loss_diff, kBf16Tolerance) << name << " " << to_string(opt);
      EXPECT_LE(r.global_rel_master_diff, bf16_master_tolerance(opt)) << name << " " << to_string(opt);
      EXPECT_GT(r.max_rel_loss_diff, 1e-6) << "bf16 must be in use";
    }
  }
}

// CPU offload under the replicated strategies (Note [Offloaded buckets]): the master, its
// gradient and the optimizer's state in host memory, each bucket's average landed there
// through a staging copy, the parameters refreshed from the host. The arithmetic is the
// same as without offload, so training is bit for bit the same: fp32 and bf16 compute,
// accumulation (under no_sync, and reducing every micro-batch) and clipping, and with
// staleness and a hook (whose averages land late).
TEST(Replicated, CpuOffloadTrainsBitForBitAsWithout) {
  FLATSHARD_RUN_RANKS({1, 2, 3}, std::chrono::seconds(300));
  auto world = flatshard::init();
  for (Strategy strategy : kReplicated) {
    for (int variant = 0; variant < 3; ++variant) {
      TrainSpec spec;
      spec.strategy = strategy;
      spec.optimizer = OptKind::AdamW;
      spec.steps = 4;
      spec.global_batch = 24;
      spec.micro_batches = 2;
      spec.clip = 0.25;
      if (variant == 1) {
        spec.param_dtype = at::kBFloat16;
        spec.reduce_dtype = at::kFloat;
      }
      if (variant == 2) {
        spec.staleness = 1;
        spec.hook = flatshard::hooks::low_precision();
      }
      // Each micro-batch reduced: the second backward's averages are added to the first's
      // (with fp32 masters apart from the parameters: without offload, DDP's fp32 master is
      // the flat gradient, which adds before it averages, rounding otherwise).
      spec.reduce_every_micro_batch = variant == 1;
      const auto batch = [](int s) { return gpt_batch(s, 24); };
      const auto plain = train_and_compare<GPT>(world, gpt_factory(), batch, token_loss, spec);
      spec.cpu_offload = true;
      spec.build_on_host = true;  // options.device = the CPU: the same placement, said explicitly
      const auto offloaded = train_and_compare<GPT>(world, gpt_factory(), batch, token_loss, spec);
      SCOPED_TRACE(::testing::Message()
                   << to_string(strategy) << " variant " << variant << " world " << world.world_size());
      EXPECT_TRUE(offloaded.shard_device.is_cpu());
      ASSERT_EQ(plain.weights.size(), offloaded.weights.size());
      for (const auto& [name, w] : plain.weights)
        EXPECT_TRUE(at::equal(w, offloaded.weights.at(name))) << name;
      EXPECT_EQ(offloaded.max_rel_loss_diff, plain.max_rel_loss_diff);
      EXPECT_EQ(offloaded.max_grad_norm, plain.max_grad_norm);
      EXPECT_GT(offloaded.max_grad_norm, spec.clip) << "the test must actually clip";
      if (variant == 0) EXPECT_LE(offloaded.max_rel_weight_diff, kFp32Tolerance) << offloaded.worst_param;
      if (variant == 1) EXPECT_LE(offloaded.global_rel_weight_diff, 5e-3);
    }
  }
}

TEST(Replicated, MissingGradientIsAnErrorNamingTheParameters) {
  FLATSHARD_RUN_RANKS({1, 2});
  auto world = flatshard::init();
  for (Strategy strategy : kReplicated) {
    GPT model = gpt_factory()();
    flatshard::FullyShard<GPT> ddp(model, world, options_for(strategy));
    model->skip_block = 1;
    const auto b = gpt_batch(0, 2 * world.world_size());
    auto loss = token_loss(ddp.forward(b.input.narrow(0, 2 * world.rank(), 2)),
                           b.target.narrow(0, 2 * world.rank(), 2));
    try {
      loss.backward();
      ADD_FAILURE() << to_string(strategy)
                    << ": backward with unused parameters succeeded although find_unused_parameters is off";
    } catch (const std::exception& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("got no gradient"), std::string::npos) << what;
      EXPECT_NE(what.find("h1.attn.qkv.weight"), std::string::npos) << what;
      EXPECT_NE(what.find("find_unused_parameters"), std::string::npos) << what;
    }
  }
}

TEST(Replicated, ConstructionBroadcastsRankZerosWeightsAndBuffers) {
  FLATSHARD_RUN_RANKS({2, 3});
  auto world = flatshard::init();
  for (Strategy strategy : kReplicated) {
    torch::manual_seed(100 + world.rank());  // every rank starts from different weights
    auto seq = make_mlp(8, 16, 4, 2);
    seq->register_buffer("marker", at::full({3}, static_cast<float>(world.rank())));
    flatshard::FullyShard<torch::nn::Sequential> ddp(seq, world, options_for(strategy));
    auto sum = at::zeros({1}, at::kDouble);
    for (const auto& p : seq->parameters()) sum += p.to(at::kDouble).sum();
    auto sums = at::zeros({world.world_size()}, at::kDouble);
    ddp.comm().all_gather(sums, sum).wait();
    EXPECT_TRUE(at::allclose(sums, sums[0].expand({world.world_size()}), 0, 0)) << sums;
    // Buffers follow rank 0 before each forward.
    auto marker = seq->named_buffers()["marker"];
    marker.fill_(static_cast<float>(world.rank()) + 10);
    ddp.forward(at::randn({2, 8}));
    EXPECT_TRUE(at::equal(marker, at::full({3}, 10.0f))) << to_string(strategy);
  }
}

TEST(Replicated, DifferentModelsAcrossRanksAreRefused) {
  FLATSHARD_RUN_RANKS({2, 3});
  auto world = flatshard::init();
  GPTConfig c;
  if (world.rank() == world.world_size() - 1) c.dim = 16;  // the last rank builds another model
  GPT model(c);
  try {
    flatshard::FullyShard<GPT> ddp(model, world, options_for(Strategy::NoShard));
    FAIL() << "NoShard accepted different models";
  } catch (const flatshard::InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("differs across ranks"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 0 has parameter 'wte.weight' Float 64x32, rank " +
                        std::to_string(world.world_size() - 1) + " has parameter 'wte.weight' Float 64x16"),
              std::string::npos)
        << what;
  }
}

TEST(Replicated, BucketsFollowReverseOrderCapsAndAreRebuiltAlike) {
  FLATSHARD_RUN_RANKS({1, 2, 3});
  auto world = flatshard::init();
  for (Strategy strategy : kReplicated) {
    GPT model = gpt_factory()();
    std::vector<std::string> registered;
    std::map<std::string, std::int64_t> bytes;
    for (const auto& item : model->named_parameters()) {
      registered.push_back(item.key());
      bytes[item.key()] = item.value().nbytes();
    }
    auto options = options_for(strategy);
    options.first_bucket_bytes = 4 << 10;
    options.bucket_bytes = 32 << 10;
    flatshard::FullyShard<GPT> ddp(model, world, options);
    auto check_caps = [&](const std::vector<std::vector<std::string>>& layout) {
      std::size_t count = 0;
      for (std::size_t b = 0; b < layout.size(); ++b) {
        std::int64_t total = 0;
        for (const auto& name : layout[b]) total += bytes[name];
        const std::int64_t cap = b == 0 ? options.first_bucket_bytes : options.bucket_bytes;
        if (layout[b].size() > 1) EXPECT_LE(total, cap) << "bucket " << b;
        count += layout[b].size();
      }
      EXPECT_EQ(count, registered.size());
    };
    auto layout = ddp.bucket_layout();
    ASSERT_GT(layout.size(), 2u);
    EXPECT_EQ(layout.front().front(), registered.back()) << "the first bucket starts with the last parameter";
    check_caps(layout);
    EXPECT_TRUE(ddp.bucket_order().empty()) << "no rebuild before the first backward";
    // One step: the buckets are laid out again in the order gradients arrived (rank 0's),
    // and the optimizer made before keeps stepping the same master shard.
    flatshard::optim::SGD opt(ddp, {0.1});
    const auto before = ddp.shards().front().clone();
    const auto b = gpt_batch(0, 2 * world.world_size());
    token_loss(ddp.forward(b.input.narrow(0, 2 * world.rank(), 2)), b.target.narrow(0, 2 * world.rank(), 2))
        .backward();
    opt.step();
    EXPECT_FALSE(ddp.bucket_order().empty());
    EXPECT_TRUE(opt.shards().front().is_same(ddp.shards().front()));
    layout = ddp.bucket_layout();
    check_caps(layout);
    std::string flat;
    for (const auto& bucket : layout) {
      for (const auto& name : bucket) flat += name + ",";
      flat += "|";
    }
    const auto hash = static_cast<std::int64_t>(std::hash<std::string>{}(flat)&0x7fffffffffff);
    auto hashes = at::zeros({world.world_size()}, at::kLong);
    ddp.comm().all_gather(hashes, at::full({1}, hash, at::kLong)).wait();
    EXPECT_TRUE(at::all(hashes == hash).item<bool>()) << "ranks built different buckets";
  }
}

// ShardOptimizerState keeps 1/N of the optimizer state and of the reduced gradients on
// each rank (within one padding per bucket); NoShard all of it. The consolidated state
// equals torch::optim::AdamW's.
TEST(Replicated, OptimizerStateShareAndConsolidation) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4});
  auto world = flatshard::init();
  const int n = world.world_size();
  for (Strategy strategy : kReplicated) {
    GPT reference = gpt_factory()();
    torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
    GPT model = gpt_factory()();
    std::int64_t numel = 0;
    for (const auto& p : model->parameters()) numel += p.numel();
    auto options = options_for(strategy);
    options.first_bucket_bytes = 4 << 10;
    options.bucket_bytes = 32 << 10;
    flatshard::FullyShard<GPT> ddp(model, world, options);
    flatshard::optim::AdamW opt(ddp, flatshard::optim::AdamWOptions{1e-3, 0.9, 0.999, 1e-8, 0.1});
    for (int step = 0; step < 3; ++step) {
      const auto b = gpt_batch(step, 4 * n);
      ref_opt.zero_grad();
      token_loss(reference->forward(b.input), b.target).backward();
      ref_opt.step();
      token_loss(ddp.forward(b.input.narrow(0, 4 * world.rank(), 4)), b.target.narrow(0, 4 * world.rank(), 4))
          .backward();
      if (step == 2) {
        const auto grad_bytes = ddp.memory().grad_shard_bytes;
        const std::int64_t buckets = static_cast<std::int64_t>(ddp.bucket_layout().size());
        const double want = strategy == Strategy::NoShard ? 4.0 * numel : 4.0 * numel / n;
        EXPECT_LE(std::abs(grad_bytes - want), 4.0 * 4 * n * buckets) << to_string(strategy);
      }
      opt.step();
      opt.zero_grad();
    }
    const double share = strategy == Strategy::NoShard ? 8.0 * numel : 8.0 * numel / n;
    const std::int64_t buckets = static_cast<std::int64_t>(ddp.bucket_layout().size());
    EXPECT_LE(std::abs(opt.state_bytes() - share), 8.0 * 4 * n * buckets)
        << to_string(strategy) << ": within the padding of each bucket";
    if (world.rank() == 0) {
      std::printf("%s world %d: optimizer state %lld bytes on this rank, total/N %.0f\n", to_string(strategy),
                  n, static_cast<long long>(opt.state_bytes()), 8.0 * numel / n);
    }
    const auto state = flatshard::checkpoint::full_optimizer_state_dict(ddp, opt, 0);
    if (world.rank() != 0) {
      EXPECT_TRUE(state.empty());
      continue;
    }
    expect_adamw_state_matches(state, reference, ref_opt, 3);
  }
}

// Note [Frozen parameters in the replicated strategies]: fine-tuning with the GPT's position
// embedding and first block frozen trains as single-process training does (clipping
// included), the frozen parameters are in no bucket (a backward sends exactly the
// reductions of the buckets, which hold the trained parameters only) but in a part of
// their own that gets no gradient, and AdamW keeps state for the trained parameters only.
TEST(Replicated, FrozenParametersAreInNoBucketAndGetNoState) {
  FLATSHARD_RUN_RANKS({1, 2, 3}, std::chrono::seconds(120));
  auto world = flatshard::init();
  auto frozen = [](const std::string& name) {
    return name.rfind("wpe", 0) == 0 || name.rfind("h0.", 0) == 0;
  };
  for (Strategy strategy : kReplicated) {
    SCOPED_TRACE(to_string(strategy));
    TrainSpec spec;
    spec.strategy = strategy;
    spec.optimizer = OptKind::AdamW;
    spec.clip = 0.05;
    spec.frozen = frozen;
    const auto r = train_and_compare<GPT>(
        world, gpt_factory(), [&](int s) { return gpt_batch(s, spec.global_batch); }, token_loss, spec);
    EXPECT_LE(r.max_rel_weight_diff, kFp32Tolerance) << r.worst_param;
    EXPECT_LE(r.max_rel_loss_diff, kFp32Tolerance);
    EXPECT_GT(r.max_grad_norm, spec.clip);
    // Plain SGD without clipping moves each weight by its gradient: a frozen layout that
    // summed the ranks' gradients instead of averaging them (which AdamW and a clip that
    // always clips would hide) shows.
    spec.optimizer = OptKind::PlainSGD;
    spec.clip = 0;
    const auto plain = train_and_compare<GPT>(
        world, gpt_factory(), [&](int s) { return gpt_batch(s, spec.global_batch); }, token_loss, spec);
    EXPECT_LE(plain.max_rel_weight_diff, kFp32Tolerance) << "plain SGD: " << plain.worst_param;

    auto model = gpt_factory()();
    std::int64_t trained = 0, held_frozen = 0;
    for (auto& item : model->named_parameters()) {
      if (frozen(item.key())) {
        item.value().requires_grad_(false);
        held_frozen += item.value().numel();
      } else {
        trained += item.value().numel();
      }
    }
    auto options = options_for(strategy);
    options.first_bucket_bytes = 2 << 10;
    options.bucket_bytes = 16 << 10;
    flatshard::FullyShard<GPT> fsdp(model, world, options);
    flatshard::optim::AdamW opt(fsdp, flatshard::optim::AdamWOptions{1e-3});
    std::uint64_t sent = 0;
    for (int step = 0; step < 3; ++step) {  // the first lays the buckets out again
      const auto b = gpt_batch(step, 2 * world.world_size());
      const auto rows = [&](const at::Tensor& t) { return t.narrow(0, 2 * world.rank(), 2); };
      auto loss = token_loss(fsdp.forward(rows(b.input)), rows(b.target));
      const auto before = fsdp.bytes_sent();
      loss.backward();
      sent = fsdp.bytes_sent() - before;
      const auto shards = fsdp.shards();
      ASSERT_EQ(shards.size(), 2u) << "the buckets, and the frozen part";
      EXPECT_TRUE(shards[0].grad().defined());
      EXPECT_FALSE(shards[1].grad().defined());
      opt.step();
      opt.zero_grad();
    }
    const auto shards = fsdp.shards();
    const auto layout = fsdp.layout();
    for (const auto& p : layout[0].params) EXPECT_FALSE(frozen(p.name)) << p.name << " is in a bucket";
    for (const auto& p : layout[1].params) EXPECT_TRUE(frozen(p.name)) << p.name << " is in the frozen part";
    EXPECT_LT(layout[0].padded_numel,
              trained + 64 * static_cast<std::int64_t>(layout[0].segments.size()) * world.world_size());
    EXPECT_GE(layout[1].padded_numel, held_frozen);
    EXPECT_EQ(opt.state_bytes(), 8 * shards[0].numel())
        << "AdamW's two moments, for the trained parameters only";
    // What reducing each bucket sends from this rank, bucket by bucket.
    auto comm_options = options.comm;
    comm_options.name = "probe";
    auto probe = flatshard::Communicator::create(world, comm_options);
    std::uint64_t expected = 0;
    for (const auto& seg : layout[0].segments) {
      const auto input = at::zeros({seg.padded_numel});
      const auto before = probe->bytes_sent();
      if (world.world_size() > 1) {
        if (strategy == Strategy::NoShard) {
          probe->all_reduce(input, flatshard::ReduceOp::Avg).wait();
        } else {
          probe->reduce_scatter(at::empty({seg.slice}), input, flatshard::ReduceOp::Avg).wait();
        }
      }
      expected += probe->bytes_sent() - before;
    }
    EXPECT_EQ(sent, expected);
  }
}

}  // namespace
