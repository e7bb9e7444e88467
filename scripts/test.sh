#!/usr/bin/env bash
# The test command: installs what is missing, builds, and runs every test with ctest.
#   scripts/test.sh [BUILD_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" "$build"
cd "$build"
# One test at a time: multi-rank tests start up to 4 ranks on a 2-core machine.
ctest --output-on-failure --timeout 600
