#!/usr/bin/env bash
# The main job, on CPU, on this machine:
#  1. trains a GPT-style model under full shard at RANKS ranks (default 4), with a
#     progress line (loss, tokens/s), saving sharded checkpoints;
#  2. resumes that checkpoint at 2 ranks under DDP (resharded across world size and mode);
#  3. measures per-rank peak memory and step time of DDP, ZeRO-1, ZeRO-2 and full shard
#     at world sizes 1..RANKS, prints them next to the ZeRO formulas, and writes
#     out/memory.csv and out/memory.png;
#  4. shows a model that does not fit a per-rank memory budget under DDP (refused with
#     the need and the budget) training under full shard within it.
#   scripts/demo.sh [RANKS]       (FLATSHARD_OUT: where out/ goes)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ranks="${1:-4}"
out="${FLATSHARD_OUT:-$root/out}"
"$root/scripts/setup.sh"
. "$root/scripts/env.sh"
"$root/scripts/build.sh" "$root/build"
run="$root/build/flatshard-run"
gpt="$root/build/examples/train_gpt"
rm -rf "$out/ckpt" && mkdir -p "$out"

echo
echo "== 1. full shard training at $ranks ranks, checkpoints in $out/ckpt"
"$run" -n "$ranks" "$gpt" --mode full --steps 60 --log-every 6 --ckpt "$out/ckpt" --save-every 30

echo
echo "== 2. resuming it at 2 ranks under DDP for 10 more steps"
"$run" -n 2 "$gpt" --mode ddp --steps 70 --log-every 5 --ckpt "$out/ckpt" --resume

echo
echo "== 3. per-rank memory and step time of every mode at world sizes 1..$ranks"
results="$out/results.txt"
: > "$results"
for n in $(seq 1 "$ranks"); do
  for m in ddp zero1 zero2 full; do
    "$run" -n "$n" "$gpt" --mode "$m" --steps 4 --log-every 100 --result 2>/dev/null | grep RESULT >> "$results"
  done
done
"$FLATSHARD_VENV/bin/python" "$root/scripts/memory_report.py" "$results" "$out"

echo
echo "== 4. a 33M-parameter model with a per-rank budget of 400 MiB"
big=(--layers 8 --dim 512 --vocab 8192 --context 64 --batch 2 --steps 6 --log-every 3 --budget-mib 400)
echo "-- DDP at 2 ranks (expected: refused)"
if "$run" -n 2 "$gpt" --mode ddp "${big[@]}"; then
  echo "demo: DDP was expected to be refused" >&2
  exit 1
fi
echo "-- full shard at 2 ranks"
"$run" -n 2 "$gpt" --mode full "${big[@]}"
