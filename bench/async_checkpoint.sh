#!/usr/bin/env bash
# Asynchronous against synchronous sharded checkpoints, in one run: for each mode and world
# size, the GPT trainer runs STEPS steps three times, saving every EVERY steps synchronously
# (save_sharded), asynchronously (checkpoint::AsyncSaver), and not at all. Prints, as a
# Markdown table, how long a save kept training waiting (synchronous: the mean over the
# saves; asynchronous: the first save, which allocates the saver's host buffers, and the
# mean of the later ones) and the mean step time (saves excluded), with the ratios.
#
#   bench/async_checkpoint.sh                 # MODES="full zero1" WORLDS="2 4" STEPS=60 EVERY=20
#   MODEL="--layers 12 --dim 768 --heads 12 --vocab 8192 --context 64" bench/async_checkpoint.sh
#   REPEAT=3 bench/async_checkpoint.sh        # the runs without saves and with asynchronous saves
#                                             # alternate REPEAT times; the step times are medians
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD:-$root/build}"
MODES="${MODES:-full zero1}"
WORLDS="${WORLDS:-2 4}"
STEPS="${STEPS:-60}"
EVERY="${EVERY:-20}"
REPEAT="${REPEAT:-1}"
MODEL="${MODEL:---layers 12 --dim 768 --heads 12 --vocab 8192 --context 64}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
echo "| mode | world | params | sync save blocks (ms) | async: first save blocks (ms) | async: later saves block (ms) | later / sync | step without saves (ms) | step with async saves (ms) | overhead |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for mode in $MODES; do
  for n in $WORLDS; do
    run() {  # extra args...
      rm -rf "$out/ckpt"
      "$build/flatshard-run" -n "$n" --deadline-s 3000 "$build/examples/train_gpt" --mode "$mode" $MODEL \
          --batch 1 --steps "$STEPS" --log-every 1000 --optimizer adamw --result --save-timing "$@" 2>/dev/null |
        sed -n 's/^\[rank 0\] //p'
    }
    run --ckpt "$out/ckpt" --save-every "$EVERY" > "$out/sync.txt"
    for r in $(seq "$REPEAT"); do  # alternating, so that the machine's drift falls on both
      run > "$out/none.$r.txt"
      run --ckpt "$out/ckpt" --save-every "$EVERY" --async-save > "$out/async.$r.txt"
    done
    python3 - "$out" "$mode" "$n" "$REPEAT" <<'PY'
import statistics, sys
out, mode, n, repeat = sys.argv[1:]
def read(name):
    saves, step, params = [], None, None
    for line in open(f"{out}/{name}.txt"):
        f = line.strip().split(",")
        if f[0] == "SAVE": saves.append(float(f[2]))
        if f[0] == "RESULT": params, step = int(f[3]), float(f[4])
    return saves, step, params
runs = range(1, int(repeat) + 1)
none_step = statistics.median(read(f"none.{r}")[1] for r in runs)
params = read("none.1")[2]
sync, _, _ = read("sync")
asyn = [t for r in runs for t in read(f"async.{r}")[0][1:]]  # later saves of every run
asyn.insert(0, read("async.1")[0][0])
async_step = statistics.median(read(f"async.{r}")[1] for r in runs)
s = sum(sync) / len(sync)
later = asyn[1:] or asyn  # the first save allocates the saver's host buffers; later ones copy into them
a = sum(later) / len(later)
print(f"| {mode} | {n} | {params / 1e6:.1f}M | {s:.0f} | {asyn[0]:.0f} | {a:.0f} | {a / s:.3f} | {none_step:.0f} | "
      f"{async_step:.0f} | {100 * (async_step / none_step - 1):+.1f}% |")
PY
  done
done
