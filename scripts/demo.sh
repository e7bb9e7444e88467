#!/usr/bin/env bash
# The main job, on CPU, on this machine:
#  1. trains a GPT-style model under full shard at RANKS ranks (default 4), with a
#     progress line (loss, tokens/s), saving sharded checkpoints;
#  2. resumes that checkpoint at 2 ranks under DDP (resharded across world size and mode);
#  3. measures per-rank peak memory and step time of DDP, ZeRO-1, ZeRO-2 and full shard
#     at world sizes 1..RANKS, prints them next to the ZeRO formulas, and writes
#     out/memory.csv and out/memory.png;
#  4. shows a GPT whose fp32 parameters alone exceed a per-rank memory budget: DDP and
#     full shard over a whole build are refused at construction (need and budget
#     stated); full shard built into shards with recomputation trains it at 4 ranks with
#     every rank's peak, from before construction, under the budget (broken down).
#  5. fine-tunes a Hugging Face Llama made with transformers: loaded into shards at 2 and
#     4 ranks, stopped and resumed, exported and read back by transformers.
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
echo "== 4. a GPT whose fp32 parameters alone (54.7 MiB) exceed a per-rank budget of 48 MiB, at 4 ranks"
big=(--layers 32 --dim 192 --heads 4 --vocab 256 --context 64 --embedding-units --batch 2 --steps 6
     --log-every 3 --optimizer sgd --lr 0.05 --budget-mib 48)
echo "-- DDP (expected: refused at construction, need and budget stated)"
if "$run" -n 4 "$gpt" --mode ddp "${big[@]}"; then
  echo "demo: DDP was expected to be refused" >&2
  exit 1
fi
echo "-- full shard over a model built whole (expected: refused: the build alone exceeds the budget)"
if "$run" -n 4 "$gpt" --mode full "${big[@]}"; then
  echo "demo: full shard over a whole build was expected to be refused" >&2
  exit 1
fi
echo "-- full shard, built into shards, without recomputation (expected: activations take it over the budget)"
if "$run" -n 4 "$gpt" --mode full --build-into-shards "${big[@]}" --steps 2; then
  echo "demo: without recomputation the run was expected to exceed the budget" >&2
  exit 1
fi
echo "-- full shard, built into shards, every block recomputed"
"$run" -n 4 "$gpt" --mode full --build-into-shards --recompute "${big[@]}"

echo
echo "== 5. fine-tuning a Hugging Face Llama (made with transformers): loaded into shards, trained at 2 and 4"
echo "   ranks, stopped and resumed, exported and checked with transformers (scripts/finetune_llama.sh)"
OUT="$out/finetune" STEPS=20 BUILD="$root/build" "$root/scripts/finetune_llama.sh"
