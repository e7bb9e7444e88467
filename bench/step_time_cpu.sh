#!/usr/bin/env bash
# The step-time model (flatshard-plan --cluster) against the engine on this CPU machine, in one
# run: calibrates the model's inputs here (one rank's step with no communication for the
# compute throughput, the optimizer step's memory bandwidth, the loopback rings' bus bandwidth
# and latency at each world size, with the cores free and beside every rank's busy compute
# thread), then measures each strategy's step with bench_modes and
# prints predicted against measured, with the error and the exposed-communication share
# (predicted, and the engine's communication_wait split into the wait for the last rank to
# reach each collective and the wait for the collective: Note [Waiting for peers]), and where
# compute sets the pace what the ranks wait with no bytes to move (bench_desync: their drift
# between syncs, which gives the model its lag where every rank has a core); a hook's time
# in the step beside its time alone. Markdown.
#
#   bench/step_time_cpu.sh                     # WORLDS="2 4" MODES="full zero2 zero1 ddp"
#   MODEL="--layers 8 --dim 512 --heads 8 --vocab 8192 --context 32" BATCH=1 bench/step_time_cpu.sh
#   REPEAT=3 bench/step_time_cpu.sh            # each measurement three times in turn: the medians
#   THROTTLE="tcp 1gbit 100mbit" bench/step_time_cpu.sh   # also over TCP on the loopback, unthrottled
#                                                       # (tcp) and throttled with tc (root)
#   MODES="ddp ddp+bf16 ddp+power_sgd:4:0 ddp+async:1 ddp+decentralized:1" bench/step_time_cpu.sh
#                                              # hooks, staleness, decentralized (variant_flags below)
#   WORLDS=4 MODES="hybrid:2 hybrid:2+bf16" bench/step_time_cpu.sh   # hybrid, shard groups of 2
# Ranks on one machine copy each other's buffers directly (Note [Direct copies]) unless
# FLATSHARD_DIRECT_COPY=0: the rows other than "unthrottled" set it, so that their bytes cross
# the loopback interface that tc throttles.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/env.sh"
build="${BUILD:-$root/build}"
WORLDS="${WORLDS:-2 4}"
MODES="${MODES:-full zero2 zero1 ddp}"
MODEL="${MODEL:---layers 8 --dim 512 --heads 8 --vocab 8192 --context 32}"
BATCH="${BATCH:-4}"
STEPS="${STEPS:-6}"
REPEAT="${REPEAT:-1}"                    # each measurement this many times: the medians
THROTTLE="${THROTTLE:-}"
RATES="${RATES:-unthrottled $THROTTLE}"  # the rows to run (unthrottled: direct copies)
MAX_ERROR="${MAX_ERROR:-}"               # set: fail when a cell's step error passes this many percent
direct_copy="${FLATSHARD_DIRECT_COPY:-}"  # the unthrottled row's, as given
out="$(mktemp -d)"
cleanup() { rm -rf "$out"; tc qdisc del dev lo root 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 1' INT TERM
read -r layers dim heads vocab context < <(echo "$MODEL" |
  sed -E 's/.*--layers ([0-9]+).*--dim ([0-9]+).*--heads ([0-9]+).*--vocab ([0-9]+).*--context ([0-9]+).*/\1 \2 \3 \4 \5/')
gpt="$layers,$dim,$heads,$vocab,$context"

# A mode is a strategy (full, zero2, zero1, ddp, or hybrid:G, hybrid sharding in shard groups
# of G ranks) and may carry a way to communicate less (docs/communication.md): ddp+bf16,
# ddp+int8, ddp+top_k:0.01, zero1+power_sgd:4:0, hybrid:2+bf16 (a hook spec; hybrid's averages
# across its groups), ddp+async:1 (staleness 1), ddp+decentralized:1. variant_flags mode ->
# the flags that give bench_modes and flatshard-plan that variant; strategy_flags mode -> the
# strategy's, for bench_modes.
group_of() {  # mode -> G of hybrid:G, or nothing
  local s="${1%%+*}"
  case "$s" in hybrid:*) echo "${s#hybrid:}" ;; esac
}
strategy_flags() {
  local g
  g="$(group_of "$1")"
  if [ -n "$g" ]; then echo "--mode hybrid --group $g"; else echo "--mode ${1%%+*}"; fi
}
variant_flags() {
  local v="${1#*+}"
  [ "$v" != "$1" ] || return 0
  case "$v" in
    async:*) echo "--staleness ${v#async:}" ;;
    decentralized:*) echo "--decentralized ${v#decentralized:}" ;;
    *) echo "--hook $v" ;;
  esac
}
# Whether a mode runs at a world size: hybrid:G needs G to divide the world into two groups
# or more, and takes a hook but neither staleness nor decentralized training. A mode that
# does not is left out of that world's rows, with a line on stderr.
runs_at() {  # world mode
  [[ "${2%%+*}" == hybrid:* ]] || return 0
  local g
  g="$(group_of "$2")"
  if ! [[ "$g" =~ ^[1-9][0-9]*$ ]] || (($1 % g != 0 || g >= $1)); then
    echo "step_time_cpu.sh: $2 left out at world $1: its groups of $g do not make two groups or more" >&2
    return 1
  fi
  case "${2#*+}" in
    async:* | decentralized:*)
      echo "step_time_cpu.sh: $2 left out: hybrid sharding takes a hook, not staleness or decentralized training" >&2
      return 1
      ;;
  esac
}
modes_step() {  # world mode -> "step_ms comm_wait_share peer_wait_share op_wait_share core_wait_share hook_ms idle_share"
  "$build/flatshard-run" -n "$1" --deadline-s 1200 "$build/bench/bench_modes" $(strategy_flags "$2") $(variant_flags "$2") \
      $MODEL --batch "$BATCH" --steps "$STEPS" 2>/dev/null | sed -n 's/^\[rank 0\] //p' |
    awk -F, 'NF > 18 { print $4, $15, $16, $15 - $16 - $17, $17, $18, $19 }' | tail -1
}

# The optimizer step's memory bandwidth: FlatShard's AdamW over 64 Mi elements on one thread.
mem_gbs="$("$build/bench/bench_optimizer_step" --benchmark_filter='BM_FlatShard_AdamW/numel:67108864/threads:1' \
  --benchmark_format=csv 2>/dev/null | python3 -c '
import csv, sys
rows = [r for r in csv.DictReader(l for l in sys.stdin if l.count(",") > 3)]
print(float(rows[0]["bytes_per_second"]) / 1e9)')"
# Compute: N ranks at once, each alone in its world (no communication): bench_modes' DDP at
# world 1 is the model and its optimizer step. Ranks beyond the cores share them, and ranks on
# one socket share its memory bandwidth: the throughput a rank sustains depends on how many run.
# The sharded strategies' own work (Note [The sharded path's own work]: copies of the shard
# into the gather buffers and of the reduced gradients, the units' hooks; on this CPU a fifth
# to three quarters of the model's compute) is their lone step less DDP's, run the same way.
side_by_side() {  # ranks command... -> the mean of the first number each of that many copies prints, run at once
  local k n="$1"
  shift
  for k in $(seq "$n"); do "$@" > "$out/alone.$k" & done
  wait
  cat "$out"/alone.* | awk -v what="$*" '{ s += $1; n++ }
    END { if (n == 0) { print "step_time_cpu.sh: " what " gave nothing" > "/dev/stderr"; exit 1 }
          printf "%.1f", s / n }'
  rm -f "$out"/alone.*
}
alone_ms() {  # ranks [mode] -> the mean step of that many lone ranks run side by side
  side_by_side "$1" modes_step 1 "${2:-ddp}"
}
# A hook's own work (bench_modes --hook-work 1: the model as one bucket, compressed and
# decompressed at world 1) on N lone ranks side by side, as the compute is measured.
hook_work_ms() {  # spec -> the median of its runs
  "$build/flatshard-run" -n 1 "$build/bench/bench_modes" --hook-work 1 --hook "$1" $MODEL --steps 5 2>/dev/null |
    sed -n 's/^\[rank 0\] hook_work,//p' | awk -F, '{ print $4 }'
}
hook_alone_ms() {  # ranks spec -> the mean of their medians
  side_by_side "$1" hook_work_ms "$2"
}
lone_of() {  # mode -> the strategy whose lone ranks give its sharding work, or nothing
  # (a lone hybrid rank is a lone full-shard rank: one group of one)
  case "${1%%+*}" in
    full | hybrid:*) echo full ;;
    zero2) echo zero2 ;;
  esac
}
hook_of() {  # mode -> its hook spec, or nothing
  local v="${1#*+}"
  [ "$v" != "$1" ] || return 0
  case "$v" in async:* | decentralized:* | none) ;; *) echo "$v" ;; esac
}
median() {  # column -> the median of that column of stdin's lines
  awk -v c="$1" 'NF { print $c }' | sort -g | awk '{ v[NR] = $1 }
    END { if (NR == 0) { print "step_time_cpu.sh: a measurement gave nothing" > "/dev/stderr"; exit 1 }
          printf "%s", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
calibrate() {  # step_ms [memory GB/s] -> TFLOP/s
  "$build/flatshard-plan" --cluster 1x1 --gpt "$gpt" --seq "$context" --batch "$BATCH" --dtype fp32 --reduce fp32 \
    --memory-gbs "${2:-$mem_gbs}" --calibrate-ms "$1" --csv 1 | awk -F, '/CALIBRATED/ { print $2 }'
}
one_ms="$(alone_ms 1)"
tflops="$(calibrate "$one_ms")"
echo "Calibration on $(nproc) cores: one rank's step ${one_ms} ms with no communication -> ${tflops} TFLOP/s sustained;"
echo "the optimizer step's memory bandwidth ${mem_gbs} GB/s. Model: $MODEL, $BATCH sequences per rank, fp32."
echo

# The all-reduce apart (Link::all_reduce_bus_bandwidth): the rings run it in place, which
# skips the copies the other two make, so its bus bandwidth is its own.
link() {  # world [--beside-compute] -> "bus_GBps latency_us allreduce_bus_GBps": at 64 KiB and 64 MiB
  local ops='all_gather|reduce_scatter|all_reduce'
  [ -z "${2:-}" ] || ops='all_gather|reduce_scatter'  # beside compute: the all-reduce is scaled alike
  "$build/flatshard-run" -n "$1" "$build/bench/bench_collectives" ${2:-} --benchmark_format=csv \
      --benchmark_filter="Communicator/($ops)/(65536|67108864)/" 2>/dev/null |
    sed -n 's/^\[rank 0\] //p' | python3 -c '
import csv, sys
n = int(sys.argv[1]); t = {}
for row in csv.DictReader(l for l in sys.stdin if l.count(",") > 3):
    _, op, size = row["name"].strip("\"").split("/")[:3]
    t.setdefault((op == "all_reduce", int(size)), []).append(int(size) / float(row["bytes_per_second"]))  # s per op
small, large = (sum(t[False, s]) / len(t[False, s]) for s in (65536, 67108864))
steps = n - 1
bus = (67108864 - 65536) * steps / n / (large - small)          # bytes/s
lat = max(0.0, (small - 65536 * steps / n / bus) / steps)      # seconds per ring step
ar_bus = bus  # as the other two where the all-reduce was not timed, or timed no slower at 64 MiB
if (True, 65536) in t and (True, 67108864) in t:
    ar_small, ar_large = (sum(t[True, s]) / len(t[True, s]) for s in (65536, 67108864))
    if ar_large > ar_small:
        ar_bus = (67108864 - 65536) * 2 * steps / n / (ar_large - ar_small)
print(f"{bus / 1e9:.4f} {lat * 1e6:.2f} {ar_bus / 1e9:.4f}")' "$1"
}

# A collective's copies and reductions are CPU work only while bytes move: over a throttled
# link the communicator waits most of the collective out in poll(). Each world's rings over
# the unthrottled loopback's TCP (copies at the CPU's own pace) give the bytes per second of
# that work; a throttled row's collectives take the cores for bus / cpu_bus of their time.
declare -A cpu_bus peer_lag
for rate in $RATES; do
  if [ "$rate" != unthrottled ] && [ "$rate" != tcp ]; then
    for n in $WORLDS; do
      read -r "cpu_bus[$n]" _ < <(FLATSHARD_DIRECT_COPY=0 link "$n")
    done
    break
  fi
done

echo "| loopback | world | mode | predicted step ms | measured step ms | error | predicted exposed | measured comm wait | of it, for peers | of it, for a core | of it, for the op | predicted contended | link GB/s, µs, all-reduce GB/s | beside compute GB/s, µs | collective share | lone DDP rank's step ms | sharding work ms | hook work ms | hook in the step ms | peer lag ms | cores idle |"
echo "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"
for rate in $RATES; do
  throttled=1  # the link, not the CPU, moves this row's bytes at its pace
  case "$rate" in unthrottled | tcp) throttled=0 ;; esac
  # Each row sets its own link, whatever the row before it left.
  if [ "$rate" != unthrottled ]; then
    export FLATSHARD_DIRECT_COPY=0
  elif [ -n "$direct_copy" ]; then
    export FLATSHARD_DIRECT_COPY="$direct_copy"
  else
    unset FLATSHARD_DIRECT_COPY
  fi
  tc qdisc del dev lo root 2>/dev/null || true
  if [ "$throttled" = 1 ]; then
    tc qdisc add dev lo root handle 1: htb default 10
    tc class add dev lo parent 1: classid 1:10 htb rate "$rate" ceil "$rate" 2>/dev/null
  fi
  for n in $WORLDS; do
    modes=""
    for mode in $MODES; do
      if runs_at "$n" "$mode"; then modes+=" $mode"; fi
    done
    # The links, the lone ranks and every mode, REPEAT times in turn: the medians, so that the
    # machine's drift over minutes (and one slow measurement of a throttled link) falls on
    # calibration and measurement alike.
    rm -f "$out"/measured.*
    for r in $(seq "$REPEAT"); do
      link "$n" >> "$out/measured.link"
      # Note [Collectives beside compute]: the same link with every rank's compute thread
      # busy, where the CPU sets the pace (a throttled link's collectives wait out its rate
      # with the cores idle).
      [ "$throttled" = 1 ] || link "$n" --beside-compute >> "$out/measured.beside"
      # The lone ranks: DDP's, and right after it each sharded strategy's that a mode needs,
      # once for all the modes that share it.
      for lone in ddp $(for mode in $modes; do lone_of "$mode"; done | sort -u); do
        alone_ms "$n" "$lone" >> "$out/measured.alone.$lone"
        echo >> "$out/measured.alone.$lone"
      done
      for mode in $modes; do
        if [ -n "$(hook_of "$mode")" ]; then
          hook_alone_ms "$n" "$(hook_of "$mode")" >> "$out/measured.hook.$mode"
          echo >> "$out/measured.hook.$mode"
        fi
        modes_step "$n" "$mode" >> "$out/measured.$mode"
      done
    done
    bus="$(median 1 < "$out/measured.link")"
    lat="$(median 2 < "$out/measured.link")"
    ar_bus="$(median 3 < "$out/measured.link")"
    beside=()
    if [ -s "$out/measured.beside" ]; then
      beside=(--intra-beside "$(median 1 < "$out/measured.beside")" --intra-beside-us "$(median 2 < "$out/measured.beside")")
    fi
    # Ranks beyond the cores share them: each rank's memory bandwidth is its share of a core's.
    rank_gbs="$(awk -v g="$mem_gbs" -v n="$n" -v c="$(nproc)" 'BEGIN { printf "%.4f", g * (n > c ? c / n : 1) }')"
    # Note [Collectives on the compute's cores]: each rank runs a compute thread and a
    # communicator thread; from as many ranks as cores, every core holds compute and a running
    # collective's copies and reductions take it (share 1); at half as many each thread has a
    # core of its own (share 0). Throttled, only the part of its time that moves bytes.
    cpu="${cpu_bus[$n]:-0}"
    [ "$throttled" = 1 ] || cpu=0  # unthrottled, its bytes move at the CPU's pace
    share="$(awk -v n="$n" -v c="$(nproc)" -v bus="$bus" -v cpu="$cpu" 'BEGIN {
      s = 2 * n / c - 1; if (s < 0) s = 0; if (s > 1) s = 1
      if (cpu > 0 && bus < cpu) s *= bus / cpu
      printf "%.4f", s }')"
    ms_n="$(median 1 < "$out/measured.alone.ddp")"
    rank_tflops="$(calibrate "$ms_n" "$rank_gbs")"
    # What communication_wait counts with no bytes to move: ranks doing the same work between
    # barriers drift apart, and the one ahead waits (bench/bench_desync.cpp). Every tenth of a
    # lone step (about a unit's compute) and every step; where compute sets the pace (over a
    # throttled link the waits are the link's). A failure leaves its row out, not the grid.
    # Note [Ranks drifting apart] in src/plan/step_time.cpp: the last rank's lag at a barrier,
    # its wait less the wait for a core and the bare barrier's own time, fitted as
    # sigma * sqrt(interval) over both intervals, is the model's --peer-lag-ms after a lone
    # step's work. Only where every rank has a core of its own: beyond that a rank waiting
    # for a peer lends it its core, and the lone ranks' step already holds that time. A row
    # that measures none takes its world's from the row before it.
    fracs="10 1"
    [ "$throttled" = 0 ] || fracs=""
    fit=""
    for frac in $fracs; do
      iv="$(awk -v t="$ms_n" -v f="$frac" 'BEGIN { printf "%.1f", t / f }')"
      if ! "$build/flatshard-run" -n "$n" --deadline-s 600 "$build/bench/bench_desync" --interval-ms "$iv" --seconds 4 \
          > "$out/desync.run" 2>&1; then
        echo "step_time_cpu.sh: bench_desync failed at world $n, every $iv ms:" >&2
        tail -5 "$out/desync.run" >&2
        continue
      fi
      # world,interval_ms,wall_interval_ms,wait_share,barrier_ms,core_share
      desync="$(sed -n 's/^\[rank 0\] //p' "$out/desync.run")"
      awk -F, -v r="$rate" '{ printf "| %s | %d | %.1f | %.1f | %.0f%% | %.0f%% | %.2f |\n", r, $1, $2, $3, 100 * $4, 100 * $6, $5 }' \
        <<< "$desync" >> "$out/desync"
      fit+="$(awk -F, '{ print $3, ($4 - $6) * $3 - $5 }' <<< "$desync") "
    done
    if [ -n "$fit" ]; then
      peer_lag[$n]="$(echo "$fit" | awk -v t="$ms_n" -v n="$n" -v c="$(nproc)" '{
        for (i = 1; i < NF; i += 2) { lag = $(i + 1) < 0 ? 0 : $(i + 1); s += lag * sqrt($i); w += $i }
        printf "%.3f", (n > c || w == 0) ? 0 : s / w * sqrt(t) }')"
    fi
    lag="${peer_lag[$n]:-0}"
    for mode in $modes; do
      group=()
      case "${mode%%+*}" in
        full) row="full shard" ;;
        zero2) row="shard-grad-op" ;;
        zero1) row="ZeRO-1" ;;
        ddp) row="DDP" ;;
        hybrid:*)
          row="hybrid (groups of $(group_of "$mode"))"
          group=(--group "$(group_of "$mode")")
          ;;
      esac
      work=0
      lone="$(lone_of "$mode")"
      if [ -n "$lone" ]; then
        work="$(awk -v a="$(median 1 < "$out/measured.alone.$lone")" -v d="$ms_n" 'BEGIN { w = a - d; if (w < 0) w = 0; printf "%.1f", w }')"
      fi
      hook_ms=0
      [ ! -f "$out/measured.hook.$mode" ] || hook_ms="$(median 1 < "$out/measured.hook.$mode")"
      "$build/flatshard-plan" --cluster "1x$n" --gpt "$gpt" --seq "$context" --batch "$BATCH" --dtype fp32 --reduce fp32 \
        --hook-work-ms "$hook_ms" \
        --tflops "$rank_tflops" --memory-gbs "$rank_gbs" --intra "$bus" --intra-us "$lat" --intra-allreduce "$ar_bus" \
        --collective-share "$share" --sharding-work-ms "$work" ${beside[@]+"${beside[@]}"} $(variant_flags "$mode") \
        --peer-lag-ms "$lag" --peer-lag-interval-ms "$ms_n" \
        ${group[@]+"${group[@]}"} \
        --csv 1 > "$out/plan.csv"
      ms="$(median 1 < "$out/measured.$mode")"
      wait="$(median 2 < "$out/measured.$mode")"
      peer="$(median 3 < "$out/measured.$mode")"
      op="$(median 4 < "$out/measured.$mode")"
      core="$(median 5 < "$out/measured.$mode")"
      in_step="$(median 6 < "$out/measured.$mode")"
      idle="$(median 7 < "$out/measured.$mode")"
      python3 - "$out/plan.csv" "$row" "$ms" "$wait" "$peer" "$op" "$core" "$rate" "$n" "$mode" "$bus" "$lat" "$ar_bus" "$share" "$ms_n" "$work" "$hook_ms" "$in_step" "$lag" "$idle" "${beside[1]:-}" "${beside[3]:-}" <<'PY'
import sys
plan, row, ms, wait, peer, op, core, rate, n, mode, bus, lat, ar_bus, share, alone, work, hook, in_step, lag, idle, bbus, blat = sys.argv[1:]
beside = f"{float(bbus):.2f}, {float(blat):.0f}" if bbus else "-"
for line in open(plan):
    f = line.strip().split(",")
    if f[0] == "TIME" and f[1] == row:
        p, exposed, contended = float(f[2]), float(f[4]), float(f[-1])
        error = 100 * (p / float(ms) - 1)
        print(f"| {rate} | {n} | {mode} | {p:.0f} | {float(ms):.0f} | {error:+.1f}% | "
              f"{100 * exposed:.0f}% | {100 * float(wait):.0f}% | {100 * float(peer):.0f}% | {100 * float(core):.0f}% | "
              f"{100 * float(op):.0f}% | {100 * contended:.0f}% | "
              f"{float(bus):.2f}, {float(lat):.0f}, {float(ar_bus):.2f} | {beside} | {float(share):.2f} | {alone} | {work} | {hook} | "
              f"{float(in_step):.1f} | {float(lag):.2f} | {100 * float(idle):.0f}% |")
        open(plan + ".errors", "a").write(f"{abs(error):.1f} {rate} {n} {mode}\n")
PY
    done
  done
done
if [ -f "$out/desync" ]; then
  echo
  echo "With no bytes to move (bench_desync: the same work on every rank between barriers), the share of the time the ranks wait:"
  echo
  echo "| loopback | world | work between barriers ms | measured interval ms | wait | of it, for a core | a bare barrier ms |"
  echo "|---|---|---:|---:|---:|---:|---:|"
  cat "$out/desync"
fi
if [ -n "$MAX_ERROR" ]; then
  worst="$(sort -rn "$out/plan.csv.errors" | head -1)"
  echo "largest |error|: $worst"
  awk -v max="$MAX_ERROR" '$1 > max { bad = 1 } END { exit bad }' "$out/plan.csv.errors" ||
    { echo "FAIL: a predicted step is more than $MAX_ERROR% from the measured one"; exit 1; }
fi
