#!/usr/bin/env bash
# FlatShard's collectives over MPI (Transport::Mpi, Debian's Open MPI, ranks started by
# mpirun with FLATSHARD_TRANSPORT=mpi) against the same over its TCP rings (flatshard-run),
# side by side in one run at $RANKS ranks (default 2) on this machine: the Communicator's
# bandwidth per op and size, then the GPT's step time under each strategy (bench_modes,
# MPI's non-blocking collectives, the default, and its blocking ones, FLATSHARD_MPI_BLOCKING=1;
# the compute-bound model unless MODEL_ARGS says otherwise). Prints Markdown.
#   bench/mpi_vs_rings.sh [BUILD_DIR]      RUNS (default 2) alternating runs of each
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/env.sh"
build="${1:-$root/build}"
ranks="${RANKS:-2}"
runs="${RUNS:-2}"
read -r -a model <<< "${MODEL_ARGS:---dim 512 --layers 8 --vocab 8192 --steps 4}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
port() { "$FLATSHARD_VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
over_mpi() {  # [mpirun options] command...: at $ranks ranks under mpirun, collectives over MPI
  MASTER_PORT="$(port)" FLATSHARD_TRANSPORT=mpi OMP_NUM_THREADS=1 \
    mpirun --allow-run-as-root --oversubscribe -np "$ranks" -x MASTER_PORT -x FLATSHARD_TRANSPORT \
    -x OMP_NUM_THREADS "$@"
}
over_rings() { "$build/flatshard-run" -n "$ranks" "$@" | sed 's/^\[rank [0-9]*\] //'; }
for ((i = 0; i < runs; ++i)); do
  over_rings "$build/bench/bench_collectives" --benchmark_format=csv --benchmark_filter=Communicator 2>/dev/null \
    | grep '^"Communicator' | sed 's/^/rings,/' >> "$out/collectives.csv"
  over_mpi "$build/bench/bench_collectives" --benchmark_format=csv --benchmark_filter=Communicator 2>/dev/null \
    | grep '^"Communicator' | sed 's/^/mpi,/' >> "$out/collectives.csv"
  FLATSHARD_MPI_BLOCKING=1 over_mpi -x FLATSHARD_MPI_BLOCKING "$build/bench/bench_collectives" --benchmark_format=csv \
    --benchmark_filter=Communicator 2>/dev/null | grep '^"Communicator' | sed 's/^/mpiblocking,/' >> "$out/collectives.csv"
  for mode in ddp zero1 zero2 full; do
    over_rings "$build/bench/bench_modes" --mode "$mode" "${model[@]}" 2>/dev/null | grep "^$mode," \
      | sed 's/^/rings,/' >> "$out/modes.csv"
    over_mpi "$build/bench/bench_modes" --mode "$mode" "${model[@]}" 2>/dev/null | grep "^$mode," \
      | sed 's/^/mpi,/' >> "$out/modes.csv"
    FLATSHARD_MPI_BLOCKING=1 over_mpi -x FLATSHARD_MPI_BLOCKING "$build/bench/bench_modes" --mode "$mode" \
      "${model[@]}" 2>/dev/null | grep "^$mode," | sed 's/^/mpiblocking,/' >> "$out/modes.csv"
  done
done
"$FLATSHARD_VENV/bin/python" - "$out" "$ranks" "$runs" <<'PY'
import csv, statistics, sys
out, ranks, runs = sys.argv[1], sys.argv[2], sys.argv[3]
rate = {}
for row in csv.reader(open(f"{out}/collectives.csv")):
    # transport, "Communicator/op/bytes...", iterations, real_time, cpu_time, time_unit, bytes_per_second, ...
    _, op, size = row[1].strip('"').split("/")[:3]
    rate.setdefault((row[0], op, int(size)), []).append(float(row[6]) / 1e6)
print(f"Collectives at {ranks} ranks on this machine, MB/s of the full buffer (median of {runs} runs; higher is better)\n")
print("| op | bytes | TCP rings | MPI non-blocking | MPI blocking | non-blocking / rings | blocking / rings |")
print("|---|---:|---:|---:|---:|---:|---:|")
for op in ["all_gather", "reduce_scatter", "all_reduce"]:
    for size in sorted({k[2] for k in rate if k[1] == op}):
        r, m, b = (statistics.median(rate.get((t, op, size), [0])) for t in ("rings", "mpi", "mpiblocking"))
        print(f"| {op} | {size} | {r:.0f} | {m:.0f} | {b:.0f} | {m / r:.2f} | {b / r:.2f} |")
step = {}
for row in csv.reader(open(f"{out}/modes.csv")):
    step.setdefault((row[0], row[1]), []).append(float(row[4]))
print(f"\nGPT step time at {ranks} ranks, ms (median of {runs} runs; lower is better)\n")
print("| strategy | TCP rings | MPI non-blocking | MPI blocking | non-blocking / rings | blocking / rings |")
print("|---|---:|---:|---:|---:|---:|")
for mode in ["ddp", "zero1", "zero2", "full"]:
    if all((t, mode) in step for t in ("rings", "mpi", "mpiblocking")):
        r, m, b = (statistics.median(step[(t, mode)]) for t in ("rings", "mpi", "mpiblocking"))
        print(f"| {mode} | {r:.1f} | {m:.1f} | {b:.1f} | {m / r:.2f} | {b / r:.2f} |")
PY
