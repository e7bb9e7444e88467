#!/usr/bin/env bash
# The main job: installs what is missing, builds, runs a multi-rank collective demo on
# this machine (4 ranks by default) through flatshard-run, then trains the GPT-style
# model under full shard and shard-grad-op at 2 and 4 ranks and prints per-rank peak
# memory and step time next to the ZeRO formulas.
#   scripts/demo.sh [RANKS]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ranks="${1:-4}"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" "$root/build"
"$root/build/flatshard-run" -n "$ranks" "$root/build/examples/collective_demo" --mib 32
echo
"$root/bench/fully_shard.sh" "$root/build"
