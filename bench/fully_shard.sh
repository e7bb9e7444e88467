#!/usr/bin/env bash
# Full shard against shard-grad-op on the GPT-style model at world 2 and 4: per-rank
# peak memory (counting allocator) and step time, next to the ZeRO formulas for fp32
# AdamW (full shard 16Ψ/N; shard-grad-op, i.e. ZeRO-2, 4Ψ + 12Ψ/N). Prints Markdown.
#   bench/fully_shard.sh [BUILD_DIR] [extra bench_fully_shard args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
shift || true
rows=""
for n in 2 4; do
  for s in full zero2; do
    rows+="$("$build/flatshard-run" -n "$n" "$build/bench/bench_modes" --mode "$s" "$@" 2>/dev/null \
             | sed -n 's/^\[rank 0\] //p')"$'\n'
  done
done
printf '%s' "$rows" | python3 -c '
import sys
mib = lambda b: float(b) / 2**20
rows = [l.strip().split(",") for l in sys.stdin if l.count(",") >= 11]
if not rows: sys.exit("no results")
print(f"GPT-style model, {int(rows[0][2]):,} parameters (Ψ), fp32, AdamW; per-rank figures are the largest over ranks.\n")
print("| strategy | world | step ms | peak MiB (allocator) | ZeRO formula MiB | param shards | grad shards | AdamW states | peak unsharded params | peak unsharded grads |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
name = {"full": "full shard (16Ψ/N)", "zero2": "shard grad op (4Ψ+12Ψ/N)"}
for s, n, p, ms, peak, rss, ps, gs, os_, up, ug, f, *_ in rows:
    print(f"| {name[s]} | {n} | {float(ms):.0f} | {mib(peak):.1f} | {mib(f):.1f} | {mib(ps):.1f} | {mib(gs):.1f} | {mib(os_):.1f} | {mib(up):.1f} | {mib(ug):.1f} |")
'
