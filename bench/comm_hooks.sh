#!/usr/bin/env bash
# Communication hooks on the communication-bound GPT (33.6M parameters, 1 sequence of 32
# tokens per rank) under DDP (NoShard) at 2 ranks (or $RANKS), in one run: bytes each
# rank sends per step, step time and the ratios against no hook; once with ranks on one
# machine copying directly (the default) and once through sockets alone
# (FLATSHARD_DIRECT_COPY=0, what a network sees). Prints a Markdown table.
#   bench/comm_hooks.sh [BUILD_DIR]
#   HOOKS="none bf16 ..." (default: every hook); MODEL_ARGS (default: --dim 512 --layers 8
#   --vocab 8192 --steps 6); RANKS (default 2)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/env.sh"
build="${1:-$root/build}"
read -r -a args <<< "${MODEL_ARGS:---dim 512 --layers 8 --vocab 8192 --steps 6}"
ranks="${RANKS:-2}"
hooks=(${HOOKS:-none bf16 int8 top_k:0.01 random_k:0.01 power_sgd:4:0})
for path in direct sockets; do
  rows=""
  for hook in "${hooks[@]}"; do
    out="$(FLATSHARD_DIRECT_COPY=$([[ $path == direct ]] && echo 1 || echo 0) \
      "$build/flatshard-run" -n "$ranks" "$build/bench/bench_modes" --mode ddp --batch 1 --context 32 \
      --hook "$hook" "${args[@]}" 2>/dev/null | sed -n 's/^\[rank 0\] //p')" ||
      echo "comm_hooks.sh: failed: $hook ($path)" >&2
    rows+="$hook,$out"$'\n'
  done
  printf '%s' "$rows" | "$FLATSHARD_VENV/bin/python" -c '
import sys
rows = [l.strip().split(",") for l in sys.stdin if l.count(",") >= 14]
if not rows: sys.exit("no results")
base = next((r for r in rows if r[0] == "none"), rows[0])
print(f"### {sys.argv[1]}: DDP, {base[2]} ranks, {int(base[3]):,} parameters\n")
print("| hook | MB sent per step per rank | bytes: none / hook | step ms | step time: none / hook (above 1: faster) |")
print("|---|---:|---:|---:|---:|")
for r in rows:
    sent, ms = float(r[13]), float(r[4])
    print(f"| {r[0]} | {sent / 1e6:.1f} | {float(base[13]) / sent:.1f} | {ms:.0f} | {float(base[4]) / ms:.2f} |")
print()
' "$([[ $path == direct ]] && echo "ranks copying directly" || echo "sockets alone (FLATSHARD_DIRECT_COPY=0)")"
done
