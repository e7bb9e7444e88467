#!/usr/bin/env bash
# The main job: installs what is missing, builds, runs a multi-rank collective demo on
# this machine (4 ranks by default) through flatshard-run, then trains a 34M-parameter
# GPT-style model at 2 ranks in every mode (DDP, ZeRO-1, ZeRO-2, full shard) next to
# PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2, and prints step time and per-rank
# memory with the ratios and the ZeRO formulas.
#   scripts/demo.sh [RANKS]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ranks="${1:-4}"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" "$root/build"
"$root/build/flatshard-run" -n "$ranks" "$root/build/examples/collective_demo" --mib 32
echo
"$root/bench/modes.sh" "$root/build"
