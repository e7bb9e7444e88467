// flatshard-plan: per-rank peak memory of each training mode, from a parameter count.
//
//   flatshard-plan --params 1.3e9 --units 24 --world 1,2,4,8 [--dtype bf16]
//                  [--optimizer adamw|adam|sgd|sgd-momentum] [--mode full]
//                  [--activation-mib 512] [--recompute 1] [--build-into-shards 1] [--prefetch 1]
//                  [--budget-mib 16000] [--shard-group-size G] [--offload 1] [--build-on-host 1]
//                  [--step-in-backward 1] [--find-unused-parameters 1] [--cpu 1] [--offload-bf16-copy 0]
//                  [--fit-mib 81559 [--host-mib 122880]]
//   flatshard-plan --cluster 16x8 --gpu h100 --model llama3-8b --seq 8192 --batch 2 (step time:
//                  src/plan/cluster_cli.cpp)
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "flatshard/plan.h"
#include "src/plan/cli_numbers.h"
#include "src/plan/cluster_cli.h"

namespace {

using flatshard::plan::parse_double;
using flatshard::plan::parse_int;

int usage(const char* why) {
  if (why) std::fprintf(stderr, "flatshard-plan: %s\n\n", why);
  std::fprintf(
      stderr,
      "usage: flatshard-plan --params N [--units K] [--root N] [--world 1,2,4] [--mode "
      "ddp|zero1|zero2|full]\n"
      "                      [--dtype fp32|bf16] [--optimizer adamw|adam|sgd|sgd-momentum]\n"
      "                      [--activation-mib M] [--recompute 0|1] [--build-into-shards 0|1] "
      "[--prefetch P]\n"
      "                      [--budget-mib B] [--shard-group-size G (hybrid: zero2/full shard "
      "within groups of G ranks)]\n"
      "                      [--offload 0|1 (cpu_offload: states in host memory)]\n"
      "                      [--offload-bf16-copy 0|1 (under offload in bf16: the masters' bf16 copies on "
      "the "
      "host; default 1)]\n"
      "                      [--build-on-host 0|1 (built on the host, placed by options.device)]\n"
      "                      [--step-in-backward 0|1 (sharded modes: each unit steps in backward)]\n"
      "                      [--find-unused-parameters 0|1 (sharded modes: every unit reduced when backward "
      "ends)]\n"
      "                      [--cpu 0|1 (training on the CPU: its buffer pool counted)]\n"
      "                      [--frozen F (fine-tuning: this fraction of every unit's parameters frozen)]\n"
      "                      [--fit-mib D [--host-mib H]: the largest model of K units whose peak fits "
      "D MiB\n"
      "                       per rank: built on the device, built on the host, and offloaded (the host's\n"
      "                       peak within H MiB)]\n"
      "Predicts per-rank peak memory (MiB) of each mode; see docs/memory-model.md.\n");
  return why ? 2 : 0;
}

double mib(std::int64_t b) { return static_cast<double>(b) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  using namespace flatshard::plan;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--cluster") {  // the step-time model
      try {
        return cluster_main(argc, argv);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "flatshard-plan: %s\n", e.what());
        return 2;
      }
    }
  }
  using flatshard::Strategy;
  double params = 0, root = 0, activation_mib = 0, budget_mib = 0, fit_mib = 0, host_mib = 0, frozen = 0;
  bool offload = false, offload_bf16_copy = true;
  int units = 1, prefetch = 1, param_bytes = 4, state_bytes = 8, shard_group_size = 0;
  bool recompute = false, build_into_shards = false, build_on_host = false, step_in_backward = false,
       cpu_compute = false, find_unused = false;
  std::vector<int> worlds{1, 2, 4, 8};
  std::vector<Strategy> modes{Strategy::NoShard, Strategy::ShardOptimizerState, Strategy::ShardGradOp,
                              Strategy::FullShard};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") return usage(nullptr);
    if (i + 1 >= argc) return usage(("missing value for " + a).c_str());
    const std::string v = argv[++i];
    const auto number = [&](double& out) {
      if (parse_double(v, out)) return true;
      usage(("option " + a + " takes a number, got '" + v + "'").c_str());
      return false;
    };
    const auto whole = [&](int& out) {
      if (parse_int(v, out)) return true;
      usage(("option " + a + " takes a whole number, got '" + v + "'").c_str());
      return false;
    };
    const auto flag = [&](bool& out) {
      int n;
      if (!parse_int(v, n) || (n != 0 && n != 1)) {
        usage(("option " + a + " takes 0 or 1, got '" + v + "'").c_str());
        return false;
      }
      out = n == 1;
      return true;
    };
    if (a == "--params") {
      if (!number(params)) return 2;
    } else if (a == "--units") {
      if (!whole(units)) return 2;
    } else if (a == "--root") {
      if (!number(root)) return 2;
    } else if (a == "--world") {
      if (!parse_list(v, worlds))
        return usage(("--world takes sizes such as 1,2,4, got '" + v + "'").c_str());
    } else if (a == "--prefetch") {
      if (!whole(prefetch)) return 2;
    } else if (a == "--shard-group-size") {
      if (!whole(shard_group_size)) return 2;
    } else if (a == "--recompute") {
      if (!flag(recompute)) return 2;
    } else if (a == "--build-into-shards") {
      if (!flag(build_into_shards)) return 2;
    } else if (a == "--build-on-host") {
      if (!flag(build_on_host)) return 2;
    } else if (a == "--step-in-backward") {
      if (!flag(step_in_backward)) return 2;
    } else if (a == "--find-unused-parameters") {
      if (!flag(find_unused)) return 2;
    } else if (a == "--cpu") {
      if (!flag(cpu_compute)) return 2;
    } else if (a == "--activation-mib") {
      if (!number(activation_mib)) return 2;
    } else if (a == "--budget-mib") {
      if (!number(budget_mib)) return 2;
    } else if (a == "--frozen") {
      if (!number(frozen)) return 2;
    } else if (a == "--fit-mib") {
      if (!number(fit_mib)) return 2;
    } else if (a == "--host-mib") {
      if (!number(host_mib)) return 2;
    } else if (a == "--offload") {
      if (!flag(offload)) return 2;
    } else if (a == "--offload-bf16-copy") {
      if (!flag(offload_bf16_copy)) return 2;
    } else if (a == "--dtype") {
      if (v != "fp32" && v != "bf16") return usage("--dtype is fp32 or bf16");
      param_bytes = v == "bf16" ? 2 : 4;
    } else if (a == "--optimizer") {
      if (v == "adamw" || v == "adam")
        state_bytes = 8;
      else if (v == "sgd-momentum")
        state_bytes = 4;
      else if (v == "sgd")
        state_bytes = 0;
      else
        return usage("--optimizer is adamw, adam, sgd or sgd-momentum");
    } else if (a == "--mode") {
      Strategy m;
      if (!flatshard::parse_strategy(v, m) || m == Strategy::HybridShard)
        return usage("--mode is ddp, zero1, zero2 or full (hybrid: --shard-group-size)");
      modes = {m};
    } else {
      return usage(("unknown option " + a).c_str());
    }
  }
  if (params <= 0 && fit_mib <= 0) return usage("--params is required (a count, e.g. 1.3e9), or --fit-mib");
  for (int w : worlds)
    if (w < 1) return usage("--world sizes must be at least 1");
  if (units < 1 || units > 1000000) return usage("--units is from 1 to 1,000,000");
  if (prefetch < 0 || prefetch > 1024) return usage("--prefetch is from 0 to 1,024");
  if (params > 1e15 || root > 1e15) return usage("--params and --root are at most 1e15");
  if (shard_group_size < 0) return usage("--shard-group-size must be at least 0 (0: no hybrid groups)");
  for (int w : worlds) {
    if (shard_group_size > 0 && shard_group_size < w && w % shard_group_size != 0)
      return usage(("--shard-group-size " + std::to_string(shard_group_size) +
                    " does not divide the world size " + std::to_string(w) + " (FullyShard refuses it)")
                       .c_str());
  }
  if (params < 0 || root < 0 || root > params)
    return usage("--params and --root are counts, --root at most --params");
  if (activation_mib < 0 || budget_mib < 0 || fit_mib < 0 || host_mib < 0)
    return usage("MiB figures are at least 0");
  auto options_for = [&](Strategy m, int w) {
    PlanOptions o;
    o.strategy = m;
    o.world_size = w;
    o.param_bytes = param_bytes;
    o.optimizer_state_bytes = state_bytes;
    o.prefetch = prefetch;
    o.shard_group_size = shard_group_size;
    o.activation_bytes = static_cast<std::int64_t>(activation_mib * (1 << 20));
    o.recompute = recompute;
    o.build_into_shards = build_into_shards;
    o.cpu_offload = offload;
    o.offload_bf16_copy = offload_bf16_copy;
    o.build_on_host = build_on_host;
    o.step_in_backward = step_in_backward;
    o.find_unused_parameters = find_unused;
    o.cpu_compute = cpu_compute;
    return o;
  };
  if (frozen < 0 || frozen > 1) return usage("--frozen is a fraction in [0, 1]");
  const std::string frozen_note = frozen > 0 ? fmt::format(" ({:.0f}% of each frozen)", 100 * frozen) : "";
  if (fit_mib > 0) {
    const auto device = static_cast<std::int64_t>(fit_mib * (1 << 20));
    const auto host = static_cast<std::int64_t>(host_mib * (1 << 20));
    std::printf(
        "%s\n",
        fmt::format("the largest model of {} equal units{} whose per-rank peak fits {:.0f} MiB{}, "
                    "{}, {} bytes of optimizer state per parameter, {:.0f} MiB of activations",
                    units, frozen_note, fit_mib,
                    host > 0 ? fmt::format(" (built on the host or offloaded, the host's peak within {:.0f} "
                                           "MiB: the model while built, or the offloaded states)",
                                           host_mib)
                             : "",
                    param_bytes == 2 ? "bf16 compute with fp32 masters" : "fp32", state_bytes, activation_mib)
            .c_str());
    std::printf("%-6s %6s %18s %18s %18s %18s %18s\n", "mode", "world", "built on device", "built on host",
                "host MiB then", "offloaded", "host MiB then");
    for (Strategy m : modes) {
      for (int w : worlds) {
        // The same model three ways: moved to the device whole, placed from the host, offloaded.
        auto whole = options_for(m, w);
        whole.cpu_offload = false;
        whole.build_on_host = false;
        auto placed = whole;
        placed.build_on_host = true;
        auto offload_opts = placed;
        offload_opts.cpu_offload = true;
        const auto host_peak = [&](const PlanOptions& with, std::int64_t params) {
          return params > 0 ? mib(predict(uniform_shape(params, units, frozen), with).host_peak()) : 0.0;
        };
        const auto on_device = largest_model(whole, units, device, 0, frozen);
        const auto on_host = largest_model(placed, units, device, host, frozen);
        const auto offloaded = largest_model(offload_opts, units, device, host, frozen);
        std::printf("%-6s %6d %18.4g %18.4g %18.1f %18.4g %18.1f\n", mode_name(m), w,
                    static_cast<double>(on_device), static_cast<double>(on_host), host_peak(placed, on_host),
                    static_cast<double>(offloaded), host_peak(offload_opts, offloaded));
      }
    }
    return 0;
  }
  ModelShape shape = uniform_shape(static_cast<std::int64_t>(params - root), units, frozen);
  shape.root_numel = static_cast<std::int64_t>(root);
  // The root's parameters (an embedding, a head) may be the largest tensor of all: taken as
  // one tensor, as a unit is.
  shape.largest_param_numel = std::max(shape.largest_param_numel, shape.root_numel);
  shape.root_frozen = static_cast<std::int64_t>(frozen * static_cast<double>(shape.root_numel));
  std::printf(
      "%s\n",
      fmt::format("{:.0f} parameters in {} units{}{}, {}, {} bytes of optimizer state per parameter", params,
                  units, root > 0 ? fmt::format(" + {:.0f} in the root", root) : "", frozen_note,
                  param_bytes == 2 ? "bf16 compute with fp32 masters" : "fp32", state_bytes)
          .c_str());
  const bool host_columns = offload || build_on_host;
  std::printf("%-6s %6s %14s %14s %14s %14s %14s %14s%s%s\n", "mode", "world", "peak MiB", "params+grads",
              "optim state", "gathered", "construction", "ZeRO formula",
              host_columns ? "       host MiB  host built MiB host rebuild MiB" : "",
              budget_mib > 0 ? "  fits" : "");
  for (Strategy m : modes) {
    for (int w : worlds) {
      const Plan p = predict(shape, options_for(m, w));
      const std::string host = host_columns ? fmt::format(" {:14.1f} {:15.1f} {:16.1f}", mib(p.host),
                                                          mib(p.host_construction), mib(p.host_rebuild))
                                            : "";
      std::printf("%-6s %6d %14.1f %14.1f %14.1f %14.1f %14.1f %14.1f%s%s\n", mode_name(m), w, mib(p.peak),
                  mib(p.params + p.masters + p.grads), mib(p.optimizer_state),
                  mib(p.gathered_params + p.gathered_grads + p.staging),
                  mib(std::max(p.construction, p.rebuild)), mib(p.zero_formula), host.c_str(),
                  budget_mib > 0 ? (mib(p.peak) <= budget_mib ? "  yes" : "  no") : "");
    }
  }
  return 0;
}
