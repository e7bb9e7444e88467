#!/usr/bin/env bash
# The test command: installs what is missing, builds, and runs every test with ctest.
#   scripts/test.sh [BUILD_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" "$build"
# A machine with the CUDA toolkit builds the CUDA path (it cannot run here): a dependency
# that went missing would otherwise drop it with a warning only.
if { command -v nvcc || [ -x /usr/local/cuda/bin/nvcc ]; } > /dev/null 2>&1 && [ ! -x "$build/flatshard_cuda_tests" ]; then
  echo "test.sh: the CUDA toolkit is here but the CUDA path was not built ($build/flatshard_cuda_tests is" \
       "missing): read the FlatShard CUDA warning in cmake's output" >&2
  exit 1
fi
cd "$build"
# One test at a time: multi-rank tests start up to 4 ranks on a 2-core machine.
ctest --output-on-failure --timeout 600
