#!/usr/bin/env bash
# Save and load throughput (MB/s) of sharded and full checkpoints at world 2 and 4,
# GPT-style model under full shard with AdamW state. Prints Markdown.
#   bench/checkpoint.sh [BUILD_DIR] [extra bench_checkpoint args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
shift || true
rows=""
for n in 2 4; do
  rows+="$("$build/flatshard-run" -n "$n" "$build/bench/bench_checkpoint" "$@" 2>/dev/null \
           | sed -n 's/^\[rank 0\] //p')"$'\n'
done
printf '%s' "$rows" | python3 -c '
import sys
rows = [l.strip().split(",") for l in sys.stdin if l.count(",") == 6]
if not rows: sys.exit("no results")
print("| checkpoint | world | size MB | save s | load s | save MB/s | load MB/s |")
print("|---|---:|---:|---:|---:|---:|---:|")
for kind, n, b, s, l, smb, lmb in rows:
    print(f"| {kind} | {n} | {int(b)/1e6:.0f} | {float(s):.3f} | {float(l):.3f} | {float(smb):.0f} | {float(lmb):.0f} |")
'
