// flatshard-plan: per-rank peak memory of each training mode, from a parameter count.
//
//   flatshard-plan --params 1.3e9 --units 24 --world 1,2,4,8 [--dtype bf16]
//                  [--optimizer adamw|adam|sgd|sgd-momentum] [--mode full]
//                  [--activation-mib 512] [--recompute 1] [--build-into-shards 1] [--prefetch 1]
//                  [--budget-mib 16000] [--shard-group-size G]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "flatshard/plan.h"

namespace {

int usage(const char* why) {
  if (why) std::fprintf(stderr, "flatshard-plan: %s\n\n", why);
  std::fprintf(stderr,
               "usage: flatshard-plan --params N [--units K] [--root N] [--world 1,2,4] [--mode "
               "ddp|zero1|zero2|full]\n"
               "                      [--dtype fp32|bf16] [--optimizer adamw|adam|sgd|sgd-momentum]\n"
               "                      [--activation-mib M] [--recompute 0|1] [--build-into-shards 0|1] "
               "[--prefetch P]\n"
               "                      [--budget-mib B] [--shard-group-size G (hybrid: zero2/full shard "
               "within groups of G ranks)]\n"
               "Predicts per-rank peak memory (MiB) of each mode; see docs/memory-model.md.\n");
  return why ? 2 : 0;
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::atoi(item.c_str()));
  return out;
}

double mib(std::int64_t b) { return static_cast<double>(b) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  using namespace flatshard::plan;
  using flatshard::Strategy;
  double params = 0, root = 0, activation_mib = 0, budget_mib = 0;
  int units = 1, prefetch = 1, param_bytes = 4, state_bytes = 8, shard_group_size = 0;
  bool recompute = false, build_into_shards = false;
  std::vector<int> worlds{1, 2, 4, 8};
  std::vector<Strategy> modes{Strategy::NoShard, Strategy::ShardOptimizerState, Strategy::ShardGradOp,
                              Strategy::FullShard};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") return usage(nullptr);
    if (i + 1 >= argc) return usage(("missing value for " + a).c_str());
    const std::string v = argv[++i];
    if (a == "--params")
      params = std::atof(v.c_str());
    else if (a == "--units")
      units = std::atoi(v.c_str());
    else if (a == "--root")
      root = std::atof(v.c_str());
    else if (a == "--world")
      worlds = parse_list(v);
    else if (a == "--prefetch")
      prefetch = std::atoi(v.c_str());
    else if (a == "--shard-group-size")
      shard_group_size = std::atoi(v.c_str());
    else if (a == "--recompute")
      recompute = std::atoi(v.c_str()) != 0;
    else if (a == "--build-into-shards")
      build_into_shards = std::atoi(v.c_str()) != 0;
    else if (a == "--activation-mib")
      activation_mib = std::atof(v.c_str());
    else if (a == "--budget-mib")
      budget_mib = std::atof(v.c_str());
    else if (a == "--dtype") {
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
  if (params <= 0) return usage("--params is required (a count, e.g. 1.3e9)");
  for (int w : worlds)
    if (w < 1) return usage("--world sizes must be at least 1");
  ModelShape shape = uniform_shape(static_cast<std::int64_t>(params - root), units);
  shape.root_numel = static_cast<std::int64_t>(root);
  std::printf("%s\n",
              fmt::format("{:.0f} parameters in {} units{}, {}, {} bytes of optimizer state per parameter",
                          params, units, root > 0 ? fmt::format(" + {:.0f} in the root", root) : "",
                          param_bytes == 2 ? "bf16 compute with fp32 masters" : "fp32", state_bytes)
                  .c_str());
  std::printf("%-6s %6s %14s %14s %14s %14s %14s %14s%s\n", "mode", "world", "peak MiB", "params+grads",
              "optim state", "gathered", "construction", "ZeRO formula", budget_mib > 0 ? "  fits" : "");
  for (Strategy m : modes) {
    for (int w : worlds) {
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
      const Plan p = predict(shape, o);
      std::printf("%-6s %6d %14.1f %14.1f %14.1f %14.1f %14.1f %14.1f%s\n", mode_name(m), w, mib(p.peak),
                  mib(p.params + p.masters + p.grads), mib(p.optimizer_state),
                  mib(p.gathered_params + p.gathered_grads), mib(std::max(p.construction, p.rebuild)),
                  mib(p.zero_formula), budget_mib > 0 ? (mib(p.peak) <= budget_mib ? "  yes" : "  no") : "");
    }
  }
  return 0;
}
