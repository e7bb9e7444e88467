#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs a multi-rank collective
# demo on this machine (4 ranks by default) through flatshard-run.
#   scripts/demo.sh [RANKS]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ranks="${1:-4}"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" "$root/build"
"$root/build/flatshard-run" -n "$ranks" "$root/build/examples/collective_demo" --mib 32
