#!/usr/bin/env bash
# One machine: N ranks through flatshard-run.
#   examples/launch/local.sh N PROGRAM [ARGS...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
n="$1"; shift
exec "$root/build/flatshard-run" -n "$n" "$@"
