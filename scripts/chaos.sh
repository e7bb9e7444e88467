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
#   SHRINK=1 RANKS=4 scripts/chaos.sh     # two elastic nodes (flatshard-run --nnodes 1:2) of RANKS/2
#                                         # ranks; after the kills, node 1 is lost for good and the
#                                         # job finishes at the world that remains: its loss curve
#                                         # must match the uninterrupted run's (the same global batch)
#   GROW=1 RANKS=4 scripts/chaos.sh       # node 0 of the two starts alone; after the kills node 1
#                                         # arrives, the job grows to both (Note [Growing an elastic
#                                         # job]) and its loss curve must match the uninterrupted run's
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
shrink="${SHRINK:-0}"
grow="${GROW:-0}"
elastic=0
[[ "$shrink" == 1 || "$grow" == 1 ]] && elastic=1
model=(--mode full --steps "$steps" --log-every "$save_every" --save-every "$save_every" --resume
       --layers 2 --dim 64 --vocab 256)
# Shrinking, every world the job runs at trains on the same global batch (4 sequences per rank at
# the start), so that the training is the same whatever the world.
[[ "$elastic" == 1 ]] && model+=(--global-batch "$((4 * ranks))")
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
if [[ "$elastic" == 1 ]]; then
  (( ranks % 2 == 0 )) || { echo "SHRINK=1 and GROW=1 need an even RANKS (two nodes)"; exit 2; }
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
  node() {  # node id
    FLATSHARD_JOB_SECRET=chaos-elastic exec "$run" -n "$((ranks / 2))" --nnodes 1:2 --node-rank "$1" \
      --master-port "$port" --rdzv-wait-s 3 --rdzv-timeout-s 120 --deadline-s 900 --max-restarts "$((kills + 2))" \
      "$gpt" "${model[@]}" --ckpt "$out/chaos"
  }
  node 0 >"$out/chaos.log" 2>&1 &
  job=$!
  if [[ "$shrink" == 1 ]]; then
    node 1 >"$out/chaos-node1.log" 2>&1 &
    node1=$!
  fi
else
  "$run" -n "$ranks" --deadline-s 900 --max-restarts "$((kills + 1))" "$gpt" "${model[@]}" --ckpt "$out/chaos" \
    >"$out/chaos.log" 2>&1 &
  job=$!
fi
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
# Waits until the job has saved a checkpoint newer than the one it had, then a moment more.
after_next_checkpoint() {
  local seen
  seen="$(cat "$out/chaos/latest" 2>/dev/null || true)"
  while kill -0 "$job" 2>/dev/null && [ "$(cat "$out/chaos/latest" 2>/dev/null || true)" == "$seen" ]; do
    sleep 0.1
  done
  sleep "0.$((RANDOM % 10))"
}
if [[ "$shrink" == 1 ]]; then
  # Node 1 is lost for good once the job has saved a checkpoint after the last kill: its
  # launcher is killed, and its ranks with it.
  after_next_checkpoint
  kill -9 "$node1" 2>/dev/null && echo "node 1 lost for good at $(date +%T.%N | cut -c1-12)"
  wait "$node1" 2>/dev/null || true
fi
node1_status=0
if [[ "$grow" == 1 ]]; then
  # Node 1 arrives once the job has saved a checkpoint after the last kill.
  after_next_checkpoint
  echo "node 1 arrives at $(date +%T.%N | cut -c1-12)"
  (node 1) >"$out/chaos-node1.log" 2>&1 || node1_status=$?  # a subshell: node() ends in exec
fi
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
if [[ "$elastic" == 1 ]]; then
  if [[ "$shrink" == 1 ]]; then
    grep -o 'the job goes on at world [0-9]* (was [0-9]*)' "$out/chaos.log" ||
      { echo "FAIL: the job never went on at a smaller world (see $out/chaos.log)"; exit 1; }
    change="the shrink"
  else
    [ "$node1_status" -eq 0 ] || { echo "FAIL: node 1 exited with $node1_status (see $out/chaos-node1.log)"; exit 1; }
    grep -o 'a node joins the job' "$out/chaos.log" | head -1 ||
      { echo "FAIL: the job never grew (see $out/chaos.log)"; exit 1; }
    grep -o 'round [0-9]*: nodes 0,1 (of 1..2); this is node 0 of world [0-9]*' "$out/chaos.log" | tail -1 ||
      { echo "FAIL: no round of both nodes (see $out/chaos.log)"; exit 1; }
    # Growing is no failure: one restart per kill, none for the growth.
    [ "$restarts" -eq "$done_kills" ] || { echo "FAIL: $done_kills kills but $restarts restarts"; exit 1; }
    change="the growth"
  fi
  # The loss at every logged step of the last start (after the world changed) against the
  # uninterrupted run's: the same global batches, so the same curve up to rounding.
  python3 - "$out/straight.log" "$out/chaos.log" "$change" <<'PY'
import re, sys
def curve(path, last_start_only):
    text = open(path).read()
    if last_start_only:
        text = text[text.rindex("round "):]
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+)/\d+  loss ([0-9.]+)", text)}
straight, shrunk = curve(sys.argv[1], False), curve(sys.argv[2], True)
resumed = re.findall(r"resumed from \S+ \(step (\d+), saved at world (\d+)", open(sys.argv[2]).read())
steps = sorted(shrunk)
if not steps:
    sys.exit("FAIL: the last start logged no step")
worst = max(abs(shrunk[s] - straight[s]) for s in steps)
print(f"after {sys.argv[3]}: resumed at step {resumed[-1][0]} (saved at world {resumed[-1][1]}); {len(steps)} logged "
      f"steps {steps[0]}..{steps[-1]}; largest |loss - uninterrupted loss| {worst:.4f}")
if worst > 2e-3:
    sys.exit(f"FAIL: the loss curve after {sys.argv[3]} left the uninterrupted run's")
PY
  if [[ "$shrink" == 1 ]]; then
    echo "OK: the job lost a node for good and finished at the world that remains on the uninterrupted run's loss curve"
  else
    echo "OK: a node joined the running job, which finished at the larger world on the uninterrupted run's loss curve"
  fi
  exit 0
fi
for f in "$out/straight/$final"/*; do
  cmp -s "$f" "$out/chaos/$final/$(basename "$f")" ||
    { echo "FAIL: $(basename "$f") of $final differs from the uninterrupted run's"; exit 1; }
done
echo "OK: the final checkpoint ($final) is byte for byte the uninterrupted run's"
