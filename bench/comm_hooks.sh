#!/usr/bin/env bash
# Communication hooks, asynchronous and decentralized DDP on the communication-bound GPT
# (33.6M parameters, 1 sequence of 32 tokens per rank) under DDP (NoShard) at 2 ranks (or
# each of $RANKS), in one run: bytes each rank sends per step, step time, the ratios
# against plain DDP, and the loss of the last step; with ranks on one machine copying
# directly (the default), through sockets alone (FLATSHARD_DIRECT_COPY=0, what a network
# sees), and through sockets over a loopback throttled to each rate in $LINKS (tc's token
# bucket on lo: a network of that bandwidth; needs root, removed on exit). Prints Markdown.
#   bench/comm_hooks.sh [BUILD_DIR]
#   HOOKS="none bf16 ... async:1 decentralized:1" (default: every hook, async:1,
#   decentralized:1; bench/variants.sh); MODEL_ARGS (default: --dim 512 --layers 8 --vocab
#   8192 --steps 6); RANKS (default 2); LINKS (e.g. "10gbit 1gbit"; default none)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/env.sh"
. "$root/bench/variants.sh"
build="${1:-$root/build}"
read -r -a args <<< "${MODEL_ARGS:---dim 512 --layers 8 --vocab 8192 --steps 6}"
hooks=(${HOOKS:-none bf16 int8 top_k:0.01 random_k:0.01 power_sgd:4:0 async:1 decentralized:1})
paths=(direct sockets)
for link in ${LINKS:-}; do paths+=("link:$link"); done
throttled=""
unthrottle() { [[ -z "$throttled" ]] || tc qdisc del dev lo root 2>/dev/null || true; }
trap unthrottle EXIT
for ranks in ${RANKS:-2}; do
  for path in "${paths[@]}"; do
    unthrottle
    throttled=""
    if [[ $path == link:* ]]; then
      if ! tc qdisc add dev lo root tbf rate "${path#link:}" burst 4mb latency 100ms 2>/dev/null; then
        echo "comm_hooks.sh: cannot throttle lo to ${path#link:} (tc needs root): skipped" >&2
        continue
      fi
      throttled=1
    fi
    rows=""
    for hook in "${hooks[@]}"; do
      read -r -a extra <<< "$(variant_args "$hook")"
      out="$(FLATSHARD_DIRECT_COPY=$([[ $path == direct ]] && echo 1 || echo 0) \
        "$build/flatshard-run" -n "$ranks" "$build/bench/bench_modes" --mode ddp --batch 1 --context 32 \
        "${extra[@]}" "${args[@]}" 2>/dev/null | sed -n 's/^\[rank 0\] //p')" ||
        echo "comm_hooks.sh: failed: $hook ($path, $ranks ranks)" >&2
      rows+="$hook,$out"$'\n'
    done
    case "$path" in
      direct) title="ranks copying directly" ;;
      sockets) title="sockets alone (FLATSHARD_DIRECT_COPY=0)" ;;
      *) title="sockets over loopback throttled to ${path#link:} (tc tbf)" ;;
    esac
    printf '%s' "$rows" | "$FLATSHARD_VENV/bin/python" -c '
import sys
rows = [l.strip().split(",") for l in sys.stdin if l.count(",") >= 14]
if not rows: sys.exit("no results")
base = next((r for r in rows if r[0] == "none"), rows[0])
print(f"#### {sys.argv[1]}: DDP, {base[2]} ranks, {int(base[3]):,} parameters\n")
print("| variant | MB sent per step per rank | bytes: none / variant | step ms | step time: none / variant (above 1: faster) | last loss |")
print("|---|---:|---:|---:|---:|---:|")
for r in rows:
    sent, ms = float(r[13]), float(r[4])
    ratio = f"{float(base[13]) / sent:.1f}" if sent > 0 else "-"
    print(f"| {r[0]} | {sent / 1e6:.1f} | {ratio} | {ms:.0f} | {float(base[4]) / ms:.2f} | {float(r[14]):.3f} |")
print()
' "$title"
  done
done
