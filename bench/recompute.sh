#!/usr/bin/env bash
# Activation recomputation on the GPT-style model at world 2, in every mode: per-rank peak
# memory (counting allocator, from before the model is built; the largest over ranks) and
# step time, without and with every block recomputed. Prints Markdown.
#   bench/recompute.sh [BUILD_DIR] [extra train_gpt args...]
# Default model: 6 blocks, dim 256, 8 heads, vocab 4096, context 256, 4 sequences per rank.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
shift || true
rows=""
for mode in full zero2 zero1 ddp; do
  for rc in 0 1; do
    flag=()
    ((rc)) && flag=(--recompute)
    line="$("$build/flatshard-run" -n 2 "$build/examples/train_gpt" --mode "$mode" --steps 6 --layers 6 \
              --dim 256 --heads 8 --context 256 --batch 4 --log-every 100 --result "${flag[@]}" "$@" 2>/dev/null \
            | sed -n 's/^\[rank 0\] RESULT,//p')"
    rows+="$rc,$line"$'\n'
  done
done
printf '%s' "$rows" | python3 -c '
import sys
rows = [l.strip().split(",") for l in sys.stdin if l.count(",") >= 8]
if not rows: sys.exit("no results")
by = {(r[1], r[0]): r for r in rows}
mib = lambda b: float(b) / 2**20
print(f"GPT-style model, {int(rows[0][3]):,} parameters, fp32 AdamW, world 2, 4 x 256 tokens per rank.\n")
print("| mode | peak MiB | peak MiB, recomputed | ratio | step ms | step ms, recomputed | ratio |")
print("|---|---:|---:|---:|---:|---:|---:|")
for mode in ("full", "zero2", "zero1", "ddp"):
    if (mode, "0") in by and (mode, "1") in by:
        a, b = by[(mode, "0")], by[(mode, "1")]
        print(f"| {mode} | {mib(a[5]):.1f} | {mib(b[5]):.1f} | {float(b[5])/float(a[5]):.2f} | "
              f"{float(a[4]):.0f} | {float(b[4]):.0f} | {float(b[4])/float(a[4]):.2f} |")
'
