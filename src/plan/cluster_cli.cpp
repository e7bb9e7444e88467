// flatshard-plan --cluster: predicted step time, tokens/s per device, MFU, exposed
// communication and peak memory of every strategy on a cluster, and the fastest that fits.
#include "src/plan/cluster_cli.h"
#include "src/plan/cli_numbers.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "flatshard/plan.h"
#include "flatshard/step_time.h"

namespace flatshard::plan {
namespace {

int usage(const char* why) {
  if (why) std::fprintf(stderr, "flatshard-plan: %s\n\n", why);
  std::fprintf(
      stderr,
      "usage: flatshard-plan --cluster NODESxDEVICES [--gpu h100] [--model gpt-1b|llama3-8b|llama3-70b |\n"
      "                      --gpt LAYERS,DIM,HEADS,VOCAB,CONTEXT] [--seq S] [--batch B (sequences per\n"
      "                      device)] [--recompute none|selective|full] [--dtype bf16|fp32]\n"
      "                      [--reduce fp32|bf16] [--prefetch P] [--device-gib G] [--host-gib H (offloaded:\n"
      "                      each node's host memory, checked against what its devices' shards ask)]\n"
      "                      [--first-bucket-mb M] [--bucket-mb M] (DDP's and ZeRO-1's bucket caps\n"
      "                      in MiB of the compute dtype, as FullyShardOptions': 1 and 25)\n"
      "                      [--group G (also hybrid sharding in groups of G devices)]\n"
      "                      [--tflops T (sustained per device)] [--intra GB/s] [--intra-us U]\n"
      "                      [--inter Gb/s] [--inter-us U] [--memory-gbs GB/s]\n"
      "                      [--intra-allreduce GB/s] [--inter-allreduce Gb/s] (an all-reduce's own bus\n"
      "                      bandwidth, where it is not the other collectives')\n"
      "                      [--intra-beside GB/s --intra-beside-us U (the intra-node link as it runs\n"
      "                      beside compute: a CPU host's collectives wait for cores the ranks fill)]\n"
      "                      [--offload 0|1] [--bf16-copy 0|1] [--step-in-backward 0|1]\n"
      "                      [--pcie GB/s (each way)] [--host-gbs GB/s (the host's optimizer step)]\n"
      "                      [--collective-share S (0 to 1: the share of a device's compute a\n"
      "                      collective takes while it moves bytes; 1 on a CPU host whose cores the\n"
      "                      ranks fill)]\n"
      "                      [--sharding-work-ms T (the sharded strategies' own work per step on one\n"
      "                      rank alone: its step less DDP's)]\n"
      "                      [--hook none|all_reduce|bf16|fp16|int8[:CHUNK]|top_k:RATIO|random_k:RATIO|\n"
      "                      power_sgd:RANK[:START] (DDP and ZeRO-1's buckets; hybrid's all-reduce across\n"
      "                      groups)] [--hook-work-ms T (the hook's work on the whole model, one rank\n"
      "                      alone: bench_modes --hook-work 1)] [--peer-lag-ms L --peer-lag-interval-ms T\n"
      "                      (ranks drifting apart: the last rank L ms behind at a round waited for at\n"
      "                      once, after T ms of work since they met; bench_desync)]\n"
      "                      [--staleness S (DDP, ZeRO-1)]\n"
      "                      [--decentralized K (DDP)]\n"
      "                      [--calibrate-ms T (the sustained throughput that makes this model's step\n"
      "                      on one device take T ms)] [--csv 1]\n"
      "Predicts each strategy's step (docs/scaling.md): tokens/s per device, MFU, the share of\n"
      "the step spent waiting for communication, what limits it, and per-device peak memory;\n"
      "names the fastest strategy that fits --device-gib (78: an H100 80GB holds 79.6 GiB, less\n"
      "the CUDA context's and NCCL's buffers). With --dtype fp32 give --tflops. With --hook, --staleness or\n"
      "--decentralized only the strategies that take it are listed.\n");
  return why ? 2 : 0;
}

// A number above 0 (the whole text).
bool positive_number(const std::string& text, double& out) { return parse_double(text, out) && out > 0; }

// The largest count an option takes (sequences, tokens, devices, steps): past it the
// figures would overflow, and no cluster has as many.
constexpr double kMostCount = 1 << 24;

// A whole number from 1 to kMostCount.
bool count(const std::string& text, double& out) {
  return positive_number(text, out) && out == std::floor(out) && out <= kMostCount;
}

}  // namespace

int cluster_main(int argc, char** argv) {
  int nodes = 0, per_node = 0;
  TransformerShape model = gpt_1b();
  TimeOptions base;
  base.sequences = 4;
  base.sequence_length = 1024;
  double device_gib = 78;  // an H100 80GB's 79.6 GiB, less the CUDA context and NCCL's buffers
  double host_gib = 0;     // offloaded: each node's host memory (0: not checked)
  double tflops = 0, intra = 0, intra_us = -1, inter = 0, inter_us = -1, intra_ar = 0, inter_ar = 0,
         memory_gbs = 0, calibrate_ms = 0;
  double pcie = 0, host_gbs = 0, collective_share = -1, beside = 0, beside_us = -1;
  bool csv = false;
  std::string hook_spec = "none";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") return usage(nullptr);
    if (i + 1 >= argc) return usage(("missing value for " + a).c_str());
    const std::string v = argv[++i];
    double x = 0;
    const bool positive = positive_number(v, x);
    auto need = [&](bool ok, const char* what) {
      return ok ? 0 : usage(fmt::format("{} takes {}, got '{}'", a, what, v).c_str());
    };
    if (a == "--cluster") {
      if (std::sscanf(v.c_str(), "%dx%d", &nodes, &per_node) != 2 || nodes < 1 || per_node < 1 ||
          v != fmt::format("{}x{}", nodes, per_node) || static_cast<double>(nodes) * per_node > kMostCount)
        return usage(
            fmt::format("--cluster takes NODESxDEVICES (e.g. 16x8, at most {:.0f} devices), got '{}'",
                        kMostCount, v)
                .c_str());
    } else if (a == "--gpu") {
      if (v != "h100") return usage("--gpu is h100 (or give --tflops, --intra, --inter, --memory-gbs)");
    } else if (a == "--model") {
      try {
        model = named_model(v);
      } catch (const std::invalid_argument& e) {
        return usage(e.what());
      }
    } else if (a == "--gpt") {
      std::vector<int> f;  // exactly five whole numbers
      const bool ok = parse_list(v, f) &&
                      std::all_of(f.begin(), f.end(), [](int x) { return x >= 1 && x <= kMostCount; });
      if (!ok || f.size() != 5 || f[1] % f[2] != 0)
        return usage(
            fmt::format("--gpt takes LAYERS,DIM,HEADS,VOCAB,CONTEXT (DIM a multiple of HEADS), got '{}'", v)
                .c_str());
      model = gpt(f[0], f[1], f[2], f[3], f[4]);
    } else if (a == "--seq") {
      if (int r = need(count(v, x), "a whole number from 1")) return r;
      base.sequence_length = static_cast<std::int64_t>(x);
    } else if (a == "--batch") {
      if (int r = need(count(v, x), "a whole number from 1")) return r;
      base.sequences = static_cast<int>(x);
    } else if (a == "--first-bucket-mb" || a == "--bucket-mb") {
      if (int r = need(positive, "MiB above 0")) return r;
      (a == "--bucket-mb" ? base.bucket_bytes : base.first_bucket_bytes) =
          std::max<std::int64_t>(1, static_cast<std::int64_t>(std::llround(x * (1 << 20))));
    } else if (a == "--prefetch") {
      if (v != "0" && !count(v, x)) return usage("--prefetch takes a whole number");
      base.prefetch = v == "0" ? 0 : static_cast<int>(x);
    } else if (a == "--recompute") {
      if (v == "none")
        base.recompute = Recompute::None;
      else if (v == "selective")
        base.recompute = Recompute::Selective;
      else if (v == "full")
        base.recompute = Recompute::Full;
      else
        return usage("--recompute is none, selective or full");
    } else if (a == "--dtype") {
      if (v != "bf16" && v != "fp32") return usage("--dtype is bf16 or fp32");
      base.param_bytes = v == "bf16" ? 2 : 4;
    } else if (a == "--reduce") {
      if (v != "bf16" && v != "fp32") return usage("--reduce is bf16 or fp32");
      base.reduce_bytes = v == "bf16" ? 2 : 4;
    } else if (a == "--group") {
      if (int r = need(count(v, x), "a whole number from 1")) return r;
      base.shard_group_size = static_cast<int>(x);
    } else if (a == "--device-gib" || a == "--host-gib") {
      if (int r = need(positive && x <= 1e9, "a number of GiB")) return r;
      (a == "--device-gib" ? device_gib : host_gib) = x;
    } else if (a == "--tflops" || a == "--intra" || a == "--inter" || a == "--memory-gbs" || a == "--pcie" ||
               a == "--host-gbs" || a == "--intra-beside" || a == "--intra-allreduce" ||
               a == "--inter-allreduce") {
      if (int r = need(positive, "a positive number")) return r;
      (a == "--tflops"            ? tflops
       : a == "--intra"           ? intra
       : a == "--inter"           ? inter
       : a == "--intra-allreduce" ? intra_ar
       : a == "--inter-allreduce" ? inter_ar
       : a == "--memory-gbs"      ? memory_gbs
       : a == "--pcie"            ? pcie
       : a == "--host-gbs"        ? host_gbs
                                  : beside) = x;
    } else if (a == "--offload" || a == "--bf16-copy" || a == "--step-in-backward") {
      if (v != "0" && v != "1") return usage(fmt::format("{} takes 0 or 1", a).c_str());
      (a == "--offload"     ? base.offload
       : a == "--bf16-copy" ? base.offload_bf16_copy
                            : base.step_in_backward) = v == "1";
    } else if (a == "--calibrate-ms") {
      if (int r = need(positive, "milliseconds")) return r;
      calibrate_ms = x;
    } else if (a == "--hook") {
      try {
        base.hook = parse_hook_model(v);
        hook_spec = v;
      } catch (const std::invalid_argument& e) {
        return usage(e.what());
      }
    } else if (a == "--hook-work-ms") {
      double ms = 0;
      if (!parse_double(v, ms) || ms < 0)
        return usage(fmt::format("--hook-work-ms takes milliseconds (0 or more), got '{}'", v).c_str());
      base.hook_work_s = ms * 1e-3;
    } else if (a == "--peer-lag-ms" || a == "--peer-lag-interval-ms") {
      double ms = 0;
      const bool interval = a == "--peer-lag-interval-ms";
      if (!parse_double(v, ms) || ms < 0 || (interval && ms == 0))
        return usage(
            fmt::format("{} takes milliseconds ({}), got '{}'", a, interval ? "above 0" : "0 or more", v)
                .c_str());
      (interval ? base.peer_lag_interval_s : base.peer_lag_s) = ms * 1e-3;
    } else if (a == "--staleness" || a == "--decentralized") {
      if (int r = need(count(v, x), "a whole number above 0")) return r;
      (a == "--staleness" ? base.staleness : base.decentralized_every) = static_cast<int>(x);
    } else if (a == "--csv") {
      if (v != "0" && v != "1") return usage("--csv takes 0 or 1");
      csv = v == "1";
    } else if (a == "--sharding-work-ms") {
      double ms = 0;
      if (!parse_double(v, ms) || ms < 0)
        return usage(fmt::format("--sharding-work-ms takes milliseconds (0 or more), got '{}'", v).c_str());
      base.sharding_work_s = ms * 1e-3;
    } else if (a == "--collective-share") {
      if (!parse_double(v, collective_share) || collective_share < 0 || collective_share > 1)
        return usage(fmt::format("--collective-share takes a share from 0 to 1, got '{}'", v).c_str());
    } else if (a == "--intra-us" || a == "--inter-us" || a == "--intra-beside-us") {
      double us = 0;
      if (!parse_double(v, us) || us < 0)
        return usage(fmt::format("{} takes microseconds (0 or more), got '{}'", a, v).c_str());
      (a == "--intra-us" ? intra_us : a == "--inter-us" ? inter_us : beside_us) = us;
    } else {
      return usage(("unknown option " + a).c_str());
    }
  }
  if (nodes < 1) return usage("--cluster NODESxDEVICES is required");
  if (model.context > 0 && base.sequence_length > model.context)
    return usage(fmt::format("--seq {} is longer than the GPT's context of {} tokens (its learned positions)",
                             base.sequence_length, model.context)
                     .c_str());
  if (host_gib > 0 && !base.offload) return usage("--host-gib checks offloaded runs (--offload 1)");
  if (host_gib > 0 && csv) return usage("--host-gib is not in the CSV's columns: leave --csv out");
  // Totals past these would overflow the figures (and no model or batch is as large).
  if (static_cast<double>(model.layers) * 16.0 * static_cast<double>(model.dim) *
              static_cast<double>(model.dim) +
          2.0 * static_cast<double>(model.vocab) * static_cast<double>(model.dim) >
      1e15)
    return usage("the model has more than 10^15 parameters");
  // The activations' estimate in bytes (Note [Activations from the shapes], in fp32 at most).
  const double per_token = static_cast<double>(model.layers) *
                               (18.0 * static_cast<double>(model.dim) +
                                8.0 * static_cast<double>(std::max(model.ffn, 2 * model.dim))) *
                               2.0 +
                           10.0 * static_cast<double>(model.vocab);
  if (static_cast<double>(base.sequences) * static_cast<double>(base.sequence_length) * per_token > 1e18)
    return usage("--batch x --seq is too many tokens for this model's activations to be counted");
  if (base.decentralized_every > 0 && (base.staleness > 0 || base.hook.kind != HookModel::Kind::None))
    return usage("--decentralized takes neither --hook nor --staleness: it averages no gradient");
  if (base.offload && base.hook.kind != HookModel::Kind::None)
    return usage("--hook with --offload 1 is not modelled");
  if (base.staleness > 8) return usage("--staleness is at most 8 (FullyShardOptions::kMaxStaleness)");
  if (base.decentralized_every > 0 && base.offload)
    return usage("--decentralized and --offload 1 do not combine (the engine refuses them)");
  Cluster c = h100_cluster(nodes, per_node);
  if (base.param_bytes == 4) {
    // The preset's throughput and peak are bf16's: fp32 compute runs on TF32 tensor cores at
    // best (half bf16's dense peak, 495 TFLOP/s), or plain FP32 (67).
    if (!(tflops > 0) && !(calibrate_ms > 0)) {
      return usage(
          "--dtype fp32: the H100 preset's throughput (530 TFLOP/s sustained) is bf16's; give --tflops, the "
          "sustained fp32 throughput (TF32 tensor cores: about half of bf16's; MFU is then against TF32's "
          "dense peak, 495 TFLOP/s), or --calibrate-ms");
    }
    c.peak_flops = 495e12;
  }
  if (tflops > 0) c.flops = tflops * 1e12;
  if (intra > 0) c.intra.bus_bandwidth = intra * 1e9;
  if (intra_us >= 0) c.intra.latency = intra_us * 1e-6;
  if (inter > 0) c.inter.bus_bandwidth = inter * 1e9 / 8;  // Gb/s per device
  if (intra_ar > 0) c.intra.all_reduce_bus_bandwidth = intra_ar * 1e9;
  if (inter_ar > 0) c.inter.all_reduce_bus_bandwidth = inter_ar * 1e9 / 8;
  if (inter_us >= 0) c.inter.latency = inter_us * 1e-6;
  if (memory_gbs > 0) c.memory_bandwidth = memory_gbs * 1e9;
  if (pcie > 0) c.pcie.bus_bandwidth = pcie * 1e9;
  if (host_gbs > 0) c.host_bandwidth = host_gbs * 1e9;
  if (collective_share >= 0) c.collective_compute_share = collective_share;
  if ((beside > 0) != (beside_us >= 0)) return usage("--intra-beside and --intra-beside-us go together");
  if (beside > 0) c.intra_beside_compute = Link{beside * 1e9, beside_us * 1e-6};
  if (base.shard_group_size > 0 &&
      (base.shard_group_size >= c.world() || c.world() % base.shard_group_size != 0))
    return usage(fmt::format("--group {} does not divide {} devices into two groups or more",
                             base.shard_group_size, c.world())
                     .c_str());
  if (base.shard_group_size > 0 && !groups_fit_nodes(c, base.shard_group_size))
    return usage(fmt::format("--group {} would put a group on parts of two nodes of {} devices: give a "
                             "divisor of {} or a multiple of it",
                             base.shard_group_size, per_node, per_node)
                     .c_str());
  if (calibrate_ms > 0) {
    // The step on one device is compute / flops + the optimizer step: solve for flops.
    Cluster one = c;
    one.nodes = one.per_node = 1;
    one.flops = 1;
    TimeOptions alone = base;
    alone.strategy = Strategy::NoShard;
    alone.offload = false;  // the device's throughput: its compute and its own step
    const StepTime unit = predict_time(model, one, alone);
    const double compute = calibrate_ms * 1e-3 - unit.optimizer_s;
    if (compute <= 0)
      return usage(fmt::format("--calibrate-ms {} is shorter than the optimizer step alone ({:.1f} ms)",
                               calibrate_ms, unit.optimizer_s * 1e3)
                       .c_str());
    c.flops = (unit.forward_s + unit.backward_s) / compute;
    if (csv) std::printf("CALIBRATED,%.6g\n", c.flops / 1e12);
  }
  const int n = c.world();

  const auto device_bytes =
      static_cast<std::int64_t>(device_gib * static_cast<double>(std::int64_t{1} << 30));
  std::vector<StrategyPlan> rows = plan_cluster(model, c, base, device_bytes);
  // Offloaded, the host holds every rank's shards, gradients and optimizer state (and, built
  // on it, the model): what its devices' rows ask of one node's host must fit it too.
  const auto host_bytes_per_node = [&](const StrategyPlan& r) {
    return static_cast<double>(r.memory.host_peak()) * std::min(per_node, n);
  };
  if (host_gib > 0) {
    for (auto& r : rows) {
      if (host_bytes_per_node(r) > host_gib * static_cast<double>(std::int64_t{1} << 30)) r.fits = false;
    }
  }

  std::string header = fmt::format(
      "{} ({:.2f}B parameters) on {} ({} devices): {} sequences of {} tokens per device, {}, recompute {}; "
      "{:.0f} TFLOP/s sustained per device, {:.3g} GB/s within a node, {:.3g} GB/s across nodes",
      model.name, static_cast<double>(model.params()) / 1e9, c.name, n, base.sequences, base.sequence_length,
      base.param_bytes == 2 ? "bf16" : "fp32",
      base.recompute == Recompute::None        ? "none"
      : base.recompute == Recompute::Selective ? "selective"
                                               : "full",
      c.flops / 1e12, c.intra.bus_bandwidth / 1e9, c.inter.bus_bandwidth / 1e9);
  if (base.offload)
    header += fmt::format(
        "; offloaded ({}{}), {:.0f} GB/s each way to the host, the host's step at {:.0f} GB/s "
        "per device",
        base.offload_bf16_copy ? "bf16 copies sent" : "fp32 masters sent",
        base.step_in_backward ? ", stepping in backward" : "", c.pcie.bus_bandwidth / 1e9,
        c.host_bandwidth / 1e9);
  if (base.hook.kind != HookModel::Kind::None)
    header += fmt::format("; each bucket reduced by the {} hook", hook_spec);
  if (base.staleness > 0)
    header += fmt::format("; gradients applied {} steps late (staleness)", base.staleness);
  if (base.decentralized_every > 0)
    header +=
        fmt::format("; no gradient averaged, parameters averaged with the ring neighbours every {} steps",
                    base.decentralized_every);
  // Where collectives take compute, the share of the step it lost to them (contended).
  const bool contended = c.collective_compute_share > 0;
  if (contended)
    header += fmt::format("; a collective takes {:.0f}% of a device's compute while it moves bytes",
                          100 * c.collective_compute_share);
  if (c.intra_beside_compute.bus_bandwidth > 0)
    header += fmt::format("; beside compute the intra-node link gives {:.2f} GB/s, {:.0f} us a step",
                          c.intra_beside_compute.bus_bandwidth / 1e9, c.intra_beside_compute.latency * 1e6);
  if (!csv) std::printf("%s\n", header.c_str());
  if (!csv)
    std::printf("%-22s %12s %10s %7s %10s%s %11s %12s%s %6s\n", "strategy", "tokens/s/dev", "step ms", "MFU",
                "exposed", contended ? "  contended" : "", "limit", "peak GiB",
                base.offload ? "  host GiB/node" : "", "fits");
  for (const StrategyPlan& r : rows) {
    const StepTime& t = r.time;
    const double gib = static_cast<double>(r.memory.peak) / (1 << 30);
    if (csv)
      std::printf("TIME,%s,%.3f,%.1f,%.4f,%s,%.3f,%.4f\n", r.name.c_str(), t.step_s * 1e3, t.tokens_per_s,
                  t.exposed_share(), t.limit.c_str(), gib, t.step_s > 0 ? t.contended_s / t.step_s : 0);
    else
      std::printf("%-22s %12.0f %10.1f %6.1f%% %9.1f%%%s %11s %12.1f%s %6s\n", r.name.c_str(), t.tokens_per_s,
                  t.step_s * 1e3, 100 * t.mfu, 100 * t.exposed_share(),
                  contended ? fmt::format(" {:10.1f}%", 100 * t.contended_s / t.step_s).c_str() : "",
                  t.limit.c_str(), gib,
                  base.offload ? fmt::format(" {:15.1f}", host_bytes_per_node(r) / (1 << 30)).c_str() : "",
                  r.fits ? "yes" : "no");
  }
  const StrategyPlan* best = fastest_that_fits(rows);
  if (csv) return 0;
  if (best)
    std::printf("fastest that fits %.1f GiB%s: %s, %.0f tokens/s per device (%.0f for the cluster)\n",
                device_gib,
                host_gib > 0 ? fmt::format(" (and {:.1f} GiB of host per node)", host_gib).c_str() : "",
                best->name.c_str(), best->time.tokens_per_s, best->time.tokens_per_s * n);
  else
    std::printf("nothing fits %.1f GiB per device%s: more devices, recomputation or fewer sequences\n",
                device_gib,
                host_gib > 0 ? fmt::format(" and {:.1f} GiB of host per node", host_gib).c_str() : "");
  return 0;
}

}  // namespace flatshard::plan
