#!/usr/bin/env bash
# Configures and builds FlatShard against the pinned LibTorch (after scripts/setup.sh).
#   scripts/build.sh [BUILD_DIR] [extra cmake args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/env.sh"
build="${1:-$root/build}"
shift || true
torch_prefix="$("$FLATSHARD_VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
# Optimized, with line tables only (-g1): backtraces and profiles keep files and lines, and
# each translation unit that includes LibTorch compiles in about 0.7x the time of -g
# (configure with -DCMAKE_BUILD_TYPE=Debug, or pass other flags after BUILD_DIR, for more).
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DCMAKE_PREFIX_PATH="$torch_prefix" "$@"
fi
cmake --build "$build" -j "$(nproc)"
