#include "flatshard/strategy.h"

namespace flatshard {

namespace {
constexpr Strategy kAll[] = {Strategy::FullShard, Strategy::ShardGradOp, Strategy::HybridShard,
                             Strategy::NoShard, Strategy::ShardOptimizerState};
}

const char* to_string(Strategy s) {
  switch (s) {
    case Strategy::FullShard: return "FullShard";
    case Strategy::ShardGradOp: return "ShardGradOp";
    case Strategy::HybridShard: return "HybridShard";
    case Strategy::NoShard: return "NoShard";
    case Strategy::ShardOptimizerState: return "ShardOptimizerState";
  }
  return "unknown";
}

const char* mode_name(Strategy s) {
  switch (s) {
    case Strategy::FullShard: return "full";
    case Strategy::ShardGradOp: return "zero2";
    case Strategy::HybridShard: return "hybrid";
    case Strategy::NoShard: return "ddp";
    case Strategy::ShardOptimizerState: return "zero1";
  }
  return "unknown";
}

bool parse_strategy(const std::string& name, Strategy& out) {
  for (Strategy s : kAll) {
    if (name == to_string(s) || name == mode_name(s)) {
      out = s;
      return true;
    }
  }
  return false;
}

}  // namespace flatshard
