#!/usr/bin/env bash
# A job killed at random still finishes right: trains the GPT example under
# `flatshard-run --max-restarts` with a checkpoint every SAVE_EVERY steps while this script
# SIGKILLs a random rank every 1-4 s (mid-save included, when it falls there), KILLS
# times; then checks that the job succeeded and that its final checkpoint is byte for
# byte the checkpoint of the same run uninterrupted (deterministic data by step, exact
# resume). Prints the failures survived, the seconds from each failure to the new start and
# to the end of the first step after it.
#
#   scripts/chaos.sh                      # 3 kills, 2 ranks, 1000 steps (build/ by default)
#   KILLS=10 RANKS=4 STEPS=3000 scripts/chaos.sh
#   ASYNC=1 scripts/chaos.sh              # the job saves asynchronously (kills land mid-write)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD:-$root/build}"
kills="${KILLS:-3}"
ranks="${RANKS:-2}"
steps="${STEPS:-1000}"
save_every="${SAVE_EVERY:-25}"
out="${OUT:-$(mktemp -d /tmp/flatshard-chaos.XXXXXX)}"
run="$build/flatshard-run"
gpt="$build/examples/train_gpt"
model=(--mode full --steps "$steps" --log-every "$save_every" --save-every "$save_every" --resume
       --layers 2 --dim 64 --vocab 256)
[[ "${ASYNC:-0}" == 1 ]] && model+=(--async-save)  # checkpoints written beside training (AsyncSaver)
mkdir -p "$out"
rm -rf "$out/straight" "$out/chaos"

rank_pids() {  # the ranks: processes whose command starts with the trainer (not the launcher)
  local p cmd
  for p in /proc/[0-9]*; do
    cmd="$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null)" || continue
    [[ "$cmd" == "$gpt "* ]] && echo "${p#/proc/}"
  done
  return 0
}

echo "== uninterrupted: $ranks ranks, $steps steps"
"$run" -n "$ranks" --deadline-s 600 "$gpt" "${model[@]}" --ckpt "$out/straight" >"$out/straight.log" 2>&1

echo "== killed $kills times at random"
"$run" -n "$ranks" --deadline-s 900 --max-restarts "$((kills + 1))" "$gpt" "${model[@]}" --ckpt "$out/chaos" \
  >"$out/chaos.log" 2>&1 &
job=$!
done_kills=0
while [ "$done_kills" -lt "$kills" ] && kill -0 "$job" 2>/dev/null; do
  sleep "$((1 + RANDOM % 3)).$((RANDOM % 10))"
  mapfile -t pids < <(rank_pids)
  [ "${#pids[@]}" -gt 0 ] || continue
  victim="${pids[$((RANDOM % ${#pids[@]}))]}"
  if kill -9 "$victim" 2>/dev/null; then
    done_kills=$((done_kills + 1))
    echo "kill $done_kills: pid $victim at $(date +%T.%N | cut -c1-12)"
  fi
done
status=0
wait "$job" || status=$?

final="$(printf 'step-%09d' "$steps")"
restarts="$(grep -c 'starting every rank again' "$out/chaos.log" || true)"
echo "job exit code $status; kills $done_kills; restarts $restarts"
grep -o 'restart [0-9]* of [0-9]*, [0-9.]* s after the failure' "$out/chaos.log" || true
grep -o 'resumed from [^ ]* (step [0-9]*' "$out/chaos.log" | sed 's/^/  /' || true
# From each failure to the end of the first step of the next start (the trainer's report):
grep -o 'first step after the failure .*' "$out/chaos.log" | sed 's/^/  /' || true
[ "$status" -eq 0 ] || { echo "FAIL: the job did not finish (see $out/chaos.log)"; exit 1; }
[ "$done_kills" -eq "$kills" ] || { echo "FAIL: the job ended after $done_kills of $kills kills: raise STEPS"; exit 1; }
[ "$restarts" -ge "$done_kills" ] || { echo "FAIL: $done_kills kills but $restarts restarts"; exit 1; }
for f in "$out/straight/$final"/*; do
  cmp -s "$f" "$out/chaos/$final/$(basename "$f")" ||
    { echo "FAIL: $(basename "$f") of $final differs from the uninterrupted run's"; exit 1; }
done
echo "OK: the final checkpoint ($final) is byte for byte the uninterrupted run's"
